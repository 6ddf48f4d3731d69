"""The MemGen baseline on the tiny random backbone: exact scoring of sampled decisions and answers,
batching, the weaver's effect on the answer, which parameters train, save/load.

    pytest tests/unit/test_memgen.py
"""

from __future__ import annotations

import pytest
import torch
from test_elasticmem import bank, data, memory_cfg, tiny_backbone  # noqa: F401  (fixtures)

from elasticmem.baselines.memgen import MemGen
from elasticmem.config import MemGenConfig

# With every token ending in a lowercase letter a delimiter, the tiny model's answers offer the
# trigger several decision points each (the defaults ',' '.' newline rarely come up in its answers).
LETTERS = list("abcdefghijklmnopqrstuvwxyz")


def make_memgen(bank_, seed: int = 0, invoke_bias: float = 0.0, **kw) -> MemGen:
    """A MemGen whose adapter and trigger are perturbed away from their (inert) initial values."""
    mem = kw.pop("memory", {})
    mg = MemGenConfig(**{"prompt_latents": 3, "inference_latents": 2, "trigger_hidden": 16, "delimiters": LETTERS,
                         "max_insertions": 3, **kw})
    torch.manual_seed(seed)
    model = MemGen(tiny_backbone(), memory_cfg(**{"retrieval": "frozen", "top_z": 2, "max_new_tokens": 6, **mem}),
                   mg, bank_)
    with torch.no_grad():
        for n, p in model.lm.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.2)
        for p in model.trigger.parameters():
            p.normal_(0, 0.5)
        model.trigger.net[-1].bias.copy_(torch.tensor([0.0, invoke_bias]))
    return model.eval()


def _close(a, b, atol=1e-5):
    assert a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=atol), (a - b).abs().max()


def test_score_reproduces_sampled_decisions_and_answers(bank):  # noqa: F811
    bank, examples = bank
    model = make_memgen(bank)
    torch.manual_seed(1)
    traj = model.sample(examples[:4], group_size=4)
    offered, invoked = traj.mask.sum(-1), (traj.budgets > 0).sum(-1)
    # what the test needs to mean something: skips, single and repeated insertions
    assert bool((traj.mask & (traj.budgets == 0)).any()) and int(invoked.max()) >= 2
    assert (traj.logp_budget[traj.mask] < 0).all() and (traj.logp_budget[~traj.mask] == 0).all()
    assert torch.equal(traj.memory_tokens, 3 + 2 * invoked)
    assert (traj.decision_pos[traj.mask] < traj.answer_mask.sum(-1, keepdim=True).expand_as(traj.mask)[traj.mask]).all()
    assert int(offered.max()) <= 3
    out = model.score(traj)
    _close(out.logp_answer, traj.logp_answer)
    _close(out.logp_budget, traj.logp_budget)
    _close(out.entropy_budget, traj.entropy_budget)
    assert (out.logp_control == 0).all()
    # the loss sees one unit per offered decision (the trigger's), none for the history memories
    from elasticmem.grpo.loss import PartMasks

    assert torch.equal(PartMasks.of(traj).budget, traj.mask)


def test_batched_greedy_equals_one_at_a_time(bank):  # noqa: F811
    bank, examples = bank
    model = make_memgen(bank, invoke_bias=3.0)
    batch = examples[:5]
    together = model.greedy(batch)
    assert int((together.budgets > 0).sum()) >= 2, "greedy decisions should insert somewhere"
    for i, ex in enumerate(batch):
        alone = model.greedy([ex])
        n = int(alone.answer_mask.sum())
        assert alone.answer_ids[0, :n].tolist() == together.answer_ids[i, :n].tolist()
        d = alone.decision_pos.shape[1]
        assert alone.decision_pos[0].tolist() == together.decision_pos[i, :d].tolist()
        assert (together.decision_pos[i, d:] == -1).all()
        assert alone.budgets[0].tolist() == together.budgets[i, :d].tolist()
        assert torch.equal(alone.memory_rows, together.memory_rows[i : i + 1])


def test_weaver_latents_change_the_answer_distribution(bank):  # noqa: F811
    """K prompt latents are inserted, and what they are (the weaver's queries) moves every answer's
    log-probs; with history=retrieved the weaver reads the retrieved chunks, which move them too."""
    bank, examples = bank
    model = make_memgen(bank, trigger="never")
    torch.manual_seed(2)
    traj = model.sample(examples[:4], group_size=2)
    assert (traj.memory_tokens == 3).all() and traj.mask.numel() == 0
    assert (traj.memory_rows >= 0).all() and (traj.history_tokens > 0).all()
    with torch.no_grad():
        before = model.score(traj).logp_answer
        model.weaver.prompt_queries.add_(torch.randn_like(model.weaver.prompt_queries))
        after = model.score(traj).logp_answer
        m = traj.answer_mask
        assert ((before - after).abs()[m] > 1e-3).float().mean() > 0.9
        other = traj.select(list(range(len(traj))))
        other.memory_rows = other.memory_rows.roll(1, 0)  # another query's history
        moved = model.score(other).logp_answer
        assert ((after - moved).abs()[m] > 1e-4).any()
    # no history: the weaver reads the prompt only
    bare = make_memgen(bank, trigger="never", history="none")
    t = bare.greedy(examples[:2])
    assert t.memory_rows.shape[1] == 0 and (t.history_tokens == 0).all() and (t.memory_tokens == 3).all()


@pytest.mark.parametrize("parts", [["weaver", "trigger"], ["trigger"], ["weaver"]])
def test_gradients_reach_exactly_the_trained_parts(bank, parts):  # noqa: F811
    bank, examples = bank
    model = make_memgen(bank, train_parts=parts)
    torch.manual_seed(3)
    traj = model.sample(examples[:3], group_size=3)
    assert bool(traj.mask.any())
    model.train()
    out = model.score(traj)
    (out.logp_answer.sum() + out.logp_budget.sum()).backward()
    got = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert got <= trainable
    assert any("lora_" in n for n in got) == ("weaver" in parts)
    assert any(n.startswith("weaver.") for n in got) == ("weaver" in parts)
    assert any(n.startswith("trigger.") for n in got) == ("trigger" in parts)
    assert not any(n.startswith(("policy.", "projector.")) for n, _ in model.named_parameters())


def test_save_load_roundtrip_and_bad_settings(bank, tmp_path):  # noqa: F811
    bank, examples = bank
    model = make_memgen(bank, invoke_bias=3.0)
    model.save_pretrained(tmp_path / "ckpt")
    saved = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"adapter", "memgen.safetensors", "elasticmem_config.json"} <= saved
    loaded = MemGen.from_pretrained(tmp_path / "ckpt", tiny_backbone(), bank).eval()
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ta, tb = model.greedy(examples[:3]), loaded.greedy(examples[:3])
    assert torch.equal(ta.answer_ids, tb.answer_ids) and torch.equal(ta.budgets, tb.budgets)
    from elasticmem.model.elasticmem import ElasticMem

    with pytest.raises(FileNotFoundError, match="budget_policy"):
        ElasticMem.from_pretrained(tmp_path / "ckpt", tiny_backbone(), bank)
    from elasticmem.config import ConfigError

    with pytest.raises(ConfigError, match="set memory.retrieval=frozen"):  # a config error, not a traceback
        make_memgen(bank, memory={"retrieval": "control"})
    with pytest.raises(ValueError, match="train_parts"):
        MemGenConfig(train_parts=["projector"])


@pytest.mark.parametrize("trigger", ["always", "learned", "never"])
def test_teacher_forced_places_latents_as_an_invoking_rollout_and_scores_the_target(bank, trigger):  # noqa: F811
    """The weaver's supervised stage: forced to a sampled answer, the trajectory inserts the weaver
    where a rollout whose trigger invoked at every offered delimiter did (none with trigger=never),
    and ``score`` gives that rollout's answer log-probs; the trigger's decisions are not offered."""
    bank, examples = bank
    model = make_memgen(bank, trigger=trigger, invoke_bias=30.0)  # learned: invokes with probability ~1
    batch = examples[:4]
    torch.manual_seed(4)
    ref = model.sample(batch, group_size=1)
    n = ref.answer_mask.sum(-1).tolist()
    if trigger != "never":
        assert bool((ref.budgets > 0).any()) and bool(((ref.budgets > 0) == ref.mask).all())
    answers = [ref.answer_ids[i, : n[i]].tolist() for i in range(len(batch))]
    tf = model.teacher_forced(batch, answers)
    assert not tf.mask.any() and torch.equal(tf.memory_rows, ref.memory_rows)
    assert torch.equal(tf.decision_pos, ref.decision_pos) and torch.equal(tf.budgets, ref.budgets)
    assert torch.equal(tf.memory_tokens, ref.memory_tokens) and torch.equal(tf.answer_ids, ref.answer_ids)
    with torch.no_grad():
        _close(model.score(tf).logp_answer, ref.logp_answer)
        assert (model.score(tf).logp_budget == 0).all()
    # evidence rows join the history the weaver reads
    group_rows = bank.group_row_ids(batch[0].group).tolist()
    missing = [r for r in group_rows if r not in ref.memory_rows[0].tolist()][0]
    tf = model.teacher_forced(batch[:1], answers[:1], include_rows=[{missing}])
    assert missing in tf.memory_rows[0].tolist() and (tf.memory_rows[0] >= 0).sum() == (ref.memory_rows[0] >= 0).sum()
    with pytest.raises(ValueError, match="answers"):
        model.teacher_forced(batch, answers[:2])


def test_weaver_sft_raises_the_target_likelihood_and_trains_only_the_weaver(bank):  # noqa: F811
    """Supervised steps on gold targets move only the weaver's parameters (adapter, queries, maps;
    not the trigger, not the reasoner) and raise the targets' log-likelihood."""
    from elasticmem.warmup.reading import option_target, supervised_loss

    bank, examples = bank
    model = make_memgen(bank, trigger="learned")
    batch = examples[:6]
    targets = [option_target(model.tokenizer, model.eos_ids, ex, 6) for ex in batch]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(20):
        model.eval()
        traj = model.teacher_forced(batch, targets)
        model.train()
        loss = supervised_loss(model.score(traj).logp_answer, traj.answer_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    # the random reasoner is nearly uniform over its small vocabulary (5.4 nats a target token at
    # the start); 20 steps take ~0.55 nats off it (seed 0)
    assert losses[-1] < losses[0] - 0.3 and sorted(losses[-5:]) < sorted(losses[:5]), losses
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert any("lora_" in n for n in moved) and any(n.startswith("weaver.") for n in moved)
    assert not any(n.startswith("trigger.") or ("lora_" not in n and not n.startswith("weaver.")) for n in moved)
