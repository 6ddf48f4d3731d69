"""ElasticMem sampling, greedy decoding and exact scoring on the real SmolLM2-135M (offline, CPU).

    pytest tests/integration/test_model_smollm2.py
"""

from __future__ import annotations

import pytest
import torch

from conftest import ROOT, requires_smollm2


@requires_smollm2
@pytest.mark.parametrize("content", ["hidden", "kv"])
def test_sample_greedy_score_on_smollm2(tmp_path, content):
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import Bank, build_bank
    from elasticmem.config import BankConfig, BackboneConfig, load_config
    from elasticmem.data.synthetic import generate
    from elasticmem.model.elasticmem import ElasticMem

    cfg = load_config(ROOT / "configs/quickstart.yaml", ["data.synthetic.num_histories=10", "memory.top_z=6",
                                                         "memory.policy.max_budget=6", f"memory.content={content}",
                                                         "memory.retrieval_map=null"])  # no trained map here
    examples = generate(cfg.data.synthetic, seed=0)["test"][:3]
    backbone = load_backbone(BackboneConfig(name_or_path="smollm2", device="cpu"))
    build_bank({"test": examples}, backbone, cfg.chunking, BankConfig(dir=str(tmp_path / "bank"), n_cache=6,
                                                                               kv_cache=content == "kv",
                                                                               key=cfg.bank.key),
               torch.float32, show_progress=False)
    bank = Bank.open(tmp_path / "bank", expect_fingerprint=backbone.fingerprint)
    torch.manual_seed(0)
    model = ElasticMem(backbone, cfg.memory, bank).eval()

    greedy = model.greedy(examples)
    assert len(greedy.answers) == 3 and all(isinstance(a, str) for a in greedy.answers)
    assert greedy.rows.shape == (3, 6) and greedy.mask.all()
    for i, ex in enumerate(examples):  # retrieval stays inside the example's own history
        a, b = bank.group_rows(ex.group)
        assert ((greedy.rows[i] >= a) & (greedy.rows[i] < b)).all()
    alone = model.greedy(examples[1:2])
    n = int(alone.answer_mask.sum())
    assert alone.answer_ids[0, :n].tolist() == greedy.answer_ids[1, :n].tolist()
    assert torch.equal(alone.budgets[0], greedy.budgets[1])

    traj = model.sample(examples[:2], group_size=2)
    out = model.score(traj)
    for got, want in [(out.logp_control, traj.logp_control), (out.logp_budget, traj.logp_budget),
                      (out.logp_answer, traj.logp_answer)]:
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert (traj.memory_tokens == traj.soft_counts.sum(-1)).all()
