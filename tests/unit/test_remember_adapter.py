"""Live appends with a trained adapter (issue 41 item 1): ``ElasticMem.remember`` (``LiveMemory.add``,
the server) must encode new rows with the frozen base model, as ``build_bank`` does, also when the
LoRA adapter is trained (B != 0, where adapter on and off differ); tiny random model, CPU.

    pytest tests/unit/test_remember_adapter.py
"""

from __future__ import annotations

import torch

from elasticmem.backbone import load_backbone
from elasticmem.bank import Bank, build_bank
from elasticmem.bank.append import SessionAdd, append_sessions, create_bank
from elasticmem.config import BankConfig, ChunkingConfig, LoraConfig, MemoryConfig, BackboneConfig
from elasticmem.data.schema import Example, Turn
from elasticmem.model.elasticmem import ElasticMem

CHUNKING = ChunkingConfig(max_tokens=32)
N_CACHE = 6
WORDS = "cat dog sun box cup hat key map pen bed car egg fox owl".split()


def _backbone():
    return load_backbone(BackboneConfig(name_or_path="tiny", device="cpu"))


def _sessions(group: str) -> list[list[Turn]]:
    return [[Turn("user", f"{group} {' '.join(WORDS[(s * 3 + j) % 14] for j in range(4 + s))} {s}"),
             Turn("assistant", f"the {WORDS[s % 14]} {s}")] for s in range(3)]


def _group_rows(bank: Bank, group: str) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    rows = bank.group_row_ids(group)
    return ([bank.chunks()[r]["text"] for r in rows.tolist()], bank.gather_keys(rows), bank.gather(rows)[0])


def test_remember_encodes_with_the_base_model_when_the_adapter_is_trained(tmp_path):
    bb = _backbone()
    cfg = BankConfig(dir=str(tmp_path / "live"), n_cache=N_CACHE)
    bank = create_bank(cfg.dir, bb, CHUNKING, cfg, torch.float32)
    torch.manual_seed(0)
    model = ElasticMem(bb, MemoryConfig(top_z=2, lora=LoraConfig(r=4, alpha=8, dropout=0.0)), bank).eval()
    with torch.no_grad():  # LoRA B starts at zero, where adapter on and off agree: train it (randomly)
        for n, p in model.lm.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.2)
    hist = {g: _sessions(g) for g in ("alice", "bob")}
    items = [SessionAdd(g, t) for g, h in hist.items() for t in h]
    live = model.remember(items).bank
    assert model.bank is live and live.num_chunks == 6

    # what build_bank makes of the same histories with the base model (a fresh load: no adapter)
    examples = [Example(id=f"{g}-q", source="test", group=g, question="?", choices=["x", "y"], answer_index=0,
                        question_type="t", history=h) for g, h in hist.items()]
    built_cfg = BankConfig(dir=str(tmp_path / "built"), n_cache=N_CACHE)
    build_bank({"x": examples}, _backbone(), CHUNKING, built_cfg, torch.float32, show_progress=False)
    built = Bank.open(built_cfg.dir)
    # and the same appends encoded by the reasoner, the adapter on
    on_cfg = BankConfig(dir=str(tmp_path / "on"), n_cache=N_CACHE)
    on = append_sessions(create_bank(on_cfg.dir, bb, CHUNKING, on_cfg, torch.float32), items,
                         model.base.get_decoder(), model.tokenizer, model.fingerprint).bank
    for g in hist:
        texts, keys, cache = _group_rows(live, g)
        b_texts, b_keys, b_cache = _group_rows(built, g)
        o_texts, o_keys, o_cache = _group_rows(on, g)
        assert texts == b_texts == o_texts
        assert (keys - b_keys).abs().max() <= 1e-5 and (cache - b_cache).abs().max() <= 1e-5, g
        assert (keys - o_keys).abs().max() > 1e-2 and (cache - o_cache).abs().max() > 1e-2, g  # the adapter matters
