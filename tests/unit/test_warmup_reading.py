"""The supervised reading warm-up's pieces: teacher-forced trajectories, reconstruction, init_from.

    pytest tests/unit/test_warmup_reading.py
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_elasticmem import make_model, tiny_backbone

from elasticmem.bank import Bank, build_bank
from elasticmem.config import BankConfig, ChunkingConfig, ConfigError, WarmupConfig
from elasticmem.data.synthetic import SyntheticConfig, generate
from elasticmem.eval.retrieval import evidence_rows
from elasticmem.warmup.reading import curriculum_z, lr_lambda, option_target, supervised_loss


@pytest.fixture(scope="module")
def bank(tmp_path_factory):
    """(bank, examples) of the tiny synthetic task: 8 histories of 6 one-turn memories."""
    data = generate(SyntheticConfig(variant="tiny", num_histories=8, num_facts=6, num_options=4), seed=0)
    examples = [ex for split in data.values() for ex in split]
    out = tmp_path_factory.mktemp("bank")
    build_bank({"all": examples}, tiny_backbone(), ChunkingConfig(max_tokens=32),
               BankConfig(dir=str(out), n_cache=6, shard_rows=16), torch.float32, show_progress=False)
    return Bank.open(out), examples


def _targets(model, batch):
    return [option_target(model.tokenizer, model.eos_ids, ex, 4) for ex in batch]


def test_teacher_forced_log_probs_equal_one_plain_forward_over_the_tokens(bank):
    """Text injection makes every input a token: the scored target log-probs must equal a plain
    forward of the reasoner over prompt + a + (chunk + separator)* + suffix + target."""
    bank, examples = bank
    model = make_model(bank, injection="text", retrieval="control")
    batch = examples[:4]
    traj = model.teacher_forced(batch, _targets(model, batch))
    out = model.score(traj)
    for i, ex in enumerate(batch):
        ids = list(traj.prompt_ids[i]) + [int(traj.control[i])]
        for r in traj.rows[i][traj.mask[i]].tolist():
            ids += model.tokenizer(bank.chunk(r)["text"], add_special_tokens=False)["input_ids"] + model.sep_ids
        ids += list(traj.suffix_ids[i])
        target = _targets(model, [ex])[0]
        logits = model.lm(input_ids=torch.tensor([ids + target])).logits[0].float()
        ref = torch.log_softmax(logits[len(ids) - 1 : len(ids) - 1 + len(target)], -1)
        ref = ref.gather(1, torch.tensor(target)[:, None]).squeeze(1)
        n = len(target)
        assert traj.answer_mask[i].sum() == n
        torch.testing.assert_close(out.logp_answer[i, :n], ref, atol=1e-5, rtol=1e-5)
        assert (out.logp_answer[i, n:] == 0).all()
    loss = supervised_loss(out.logp_answer, traj.answer_mask)
    torch.testing.assert_close(loss, -out.logp_answer.sum() / traj.answer_mask.sum())


def test_option_target_parses_back_to_the_gold_letter(bank):
    from elasticmem.data.rewards import mc_letter_reward

    bank, examples = bank
    model = make_model(bank)
    for ex in examples[:6]:
        for limit in (1, 2, 3, 8):
            ids = option_target(model.tokenizer, model.eos_ids, ex, limit)
            assert 1 <= len(ids) <= limit
            assert (ids[-1] in model.eos_ids) == (limit > 1)
            assert mc_letter_reward(model.tokenizer.decode(ids), ex) == 1.0
        ids = option_target(model.tokenizer, model.eos_ids, ex, 32, "value_letter")
        text = model.tokenizer.decode(ids[:-1])
        assert ids[-1] in model.eos_ids and mc_letter_reward(text, ex) == 1.0
        assert text.replace(" ", "").startswith(ex.choices[ex.answer_index].replace(" ", ""))
        with pytest.raises(ValueError, match="max_new_tokens"):
            option_target(model.tokenizer, model.eos_ids, ex, 2, "value_letter")


def test_answer_target_is_the_answer_text_then_the_end_of_turn(bank):
    """warmup.target=answer (behaviour cloning of an expert's action): the answer text's tokens,
    then the end of turn; refused when it does not fit or there is none."""
    import dataclasses

    from elasticmem.data.rewards import get_reward

    bank, examples = bank
    model = make_model(bank)
    ex = dataclasses.replace(examples[0], choices=[], answer_index=-1, answer_text="take apple 1 from countertop 2",
                             extra={"admissible_commands": ["go to fridge 1", "take apple 1 from countertop 2"]})
    ids = option_target(model.tokenizer, model.eos_ids, ex, 32, "answer")
    assert ids[:-1] == model.tokenizer(ex.answer_text, add_special_tokens=False)["input_ids"]
    assert ids[-1] in model.eos_ids
    assert get_reward("snapped_action")(model.tokenizer.decode(ids[:-1]), ex) == 1.0
    with pytest.raises(ValueError, match="max_new_tokens"):
        option_target(model.tokenizer, model.eos_ids, ex, len(ids) - 1, "answer")
    with pytest.raises(ValueError, match="no answer_text"):
        option_target(model.tokenizer, model.eos_ids, dataclasses.replace(ex, answer_text=None), 32, "answer")


def test_evidence_rows_are_put_among_the_retrieved_ones_in_score_order(bank):
    bank, examples = bank
    model = make_model(bank, retrieval="control", top_z=2)
    batch = [ex for ex in examples if evidence_rows(ex, bank)][:8]
    plain = model.teacher_forced(batch, _targets(model, batch))
    include = [evidence_rows(ex, bank) for ex in batch]
    forced = model.teacher_forced(batch, _targets(model, batch), include_rows=include)
    h = torch.nn.functional.normalize(forced.query_state.float(), dim=-1)
    missing = 0
    for i in range(len(batch)):
        rows = forced.rows[i][forced.mask[i]].tolist()
        assert include[i] <= set(rows), (include[i], rows)
        assert len(rows) == int(plain.mask[i].sum()) == len(set(rows))
        keys = torch.nn.functional.normalize(bank.gather_keys(torch.tensor(rows)).float(), dim=-1)
        torch.testing.assert_close(forced.scores[i][forced.mask[i]], keys @ h[i], atol=1e-5, rtol=0)
        assert forced.scores[i][forced.mask[i]].diff().le(1e-6).all(), "ordered by score"
        kept = set(rows) - include[i]  # the others are the best-ranked of the plain retrieval
        assert kept == set(plain.rows[i].tolist()[: len(kept)]) or kept <= set(plain.rows[i].tolist())
        missing += not include[i] <= set(plain.rows[i].tolist())
    assert missing > 0, "the test needs questions whose retrieval missed the evidence"


def test_budget_modes(bank):
    bank, examples = bank
    model = make_model(bank, policy={"max_budget": 5})
    batch = examples[:6]
    top = model.teacher_forced(batch, _targets(model, batch), budgets="max")
    assert (top.budgets[top.mask] == 5).all() and (top.budgets[~top.mask] == 0).all()
    uni = model.teacher_forced(batch, _targets(model, batch), budgets="uniform",
                               generator=torch.Generator().manual_seed(0))
    b = uni.budgets[uni.mask]
    assert b.min() >= 1 and b.max() <= 5 and b.unique().numel() > 1
    assert torch.equal(uni.soft_counts, torch.minimum(uni.budgets, uni.soft_counts.clamp(min=0)))
    pol = model.teacher_forced(batch, _targets(model, batch), budgets="policy")
    torch.testing.assert_close(model.score(pol).logp_budget, pol.logp_budget, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="budgets"):
        model.teacher_forced(batch, _targets(model, batch), budgets="all")
    with pytest.raises(ValueError, match="answers"):
        model.teacher_forced(batch, _targets(model, batch)[:2])


def test_reconstruction_reads_with_the_adapter_off_and_trains_only_the_projector(bank):
    bank, _ = bank
    model = make_model(bank)
    rows, budgets = torch.tensor([0, 3, 5, 7]), torch.tensor([1, 4, 8, 2])
    prompt = model.tokenizer("Background:", add_special_tokens=False)["input_ids"]
    suffix = model.tokenizer(" means", add_special_tokens=False)["input_ids"]
    logp, mask = model.reconstruction_logps(rows, budgets, prompt, suffix)
    for i, r in enumerate(rows.tolist()):  # batched equals one at a time
        one, m1 = model.reconstruction_logps(rows[i : i + 1], budgets[i : i + 1], prompt, suffix)
        n = int(m1.sum())
        assert n == int(mask[i].sum()) == len(model.tokenizer(bank.chunk(r)["text"], add_special_tokens=False)
                                               ["input_ids"]) + 1
        torch.testing.assert_close(one[0, :n], logp[i, :n], atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the adapter is off: changing it changes nothing
        for n_, p in model.lm.named_parameters():
            if "lora_" in n_:
                p.add_(1.0)
    again, _ = model.reconstruction_logps(rows, budgets, prompt, suffix)
    torch.testing.assert_close(again, logp, atol=1e-5, rtol=1e-5)
    model.zero_grad()
    supervised_loss(again, mask).backward()
    grads = {n_.split(".")[0] for n_, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads == {"projector"}


def test_curriculum_on_z_grows_linearly_from_start_to_top_z():
    assert [curriculum_z(2, 8, s, 7) for s in range(1, 8)] == [2, 3, 4, 5, 6, 7, 8]
    assert [curriculum_z(None, 8, s, 5) for s in range(1, 6)] == [8] * 5
    assert curriculum_z(10, 4, 1, 5) == 4 and curriculum_z(3, 0, 1, 5) == 0
    assert curriculum_z(2, 8, 1, 1) == 2
    zs = [curriculum_z(1, 20, s, 100) for s in range(1, 101)]
    assert zs[0] == 1 and zs[-1] == 20 and all(a <= b for a, b in zip(zs, zs[1:]))


def test_lr_schedule_and_config_checks():
    f = lr_lambda(2, 10, 0.1)
    assert [round(f(s), 6) for s in (0, 1)] == [0.5, 1.0]
    assert f(2) == pytest.approx(1.0) and f(10) == pytest.approx(0.1) and f(6) == pytest.approx(0.55)
    assert all(0.1 - 1e-9 <= f(s) <= 1 for s in range(12))
    with pytest.raises(ValueError, match="budgets"):
        WarmupConfig(budgets="all")
    with pytest.raises(ValueError, match="must be >= 1"):
        WarmupConfig(steps=0, reconstruct_steps=0)
    assert math.isclose(WarmupConfig(steps=0, reconstruct_steps=3).reconstruct_lr, 1e-3)
    with pytest.raises(ValueError, match="top_z_start"):
        WarmupConfig(top_z_start=0)


def test_init_from_refuses_another_shape(bank, tmp_path):
    from elasticmem.training.runtime import check_init

    bank, _ = bank
    model = make_model(bank)
    model.save_pretrained(tmp_path / "m")
    check_init(tmp_path / "m", model)  # the same: accepted
    other = make_model(bank, policy={"max_budget": 5})
    with pytest.raises(ConfigError, match="memory.policy"):
        check_init(tmp_path / "m", other)
    meta = json.loads((tmp_path / "m/elasticmem_config.json").read_text())
    meta["backbone"]["fingerprint"] = "sha256:other"
    (tmp_path / "m/elasticmem_config.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="trained on"):
        check_init(tmp_path / "m", model)
    with pytest.raises(FileNotFoundError):
        check_init(tmp_path / "nothing", model)


def test_cached_token_ids_are_the_tokens_at_the_cached_positions(bank):
    """The ids must be those whose final-layer states the bank cached: recomputed from a plain
    forward of the frozen base over the chunk as tokenized for the bank."""
    from elasticmem.warmup.reading import cached_token_ids

    bank, _ = bank
    model = make_model(bank)
    rows = [0, 2, 5, 9]
    ids = cached_token_ids(bank, model.tokenizer, rows)
    cache, cache_len = bank.gather(torch.tensor(rows))
    for i, r in enumerate(rows):
        full = model.tokenizer(bank.chunk(r)["text"], add_special_tokens=True, truncation=True,
                               max_length=32)["input_ids"]
        c = int(cache_len[i])
        assert ids[i] == full[len(full) - c:] and len(ids[i]) == c
        with torch.no_grad(), model.lm.disable_adapter():
            h = model.lm(input_ids=torch.tensor([full]), output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(cache[i, cache.shape[1] - c:].float(), h[-c:].float(), atol=1e-4, rtol=1e-4)


def test_token_alignment_moves_soft_tokens_to_their_token_embeddings_and_trains_only_the_projector(bank, tmp_path):
    from elasticmem.model.projector import ProjectorConfig, select_last_valid
    from elasticmem.warmup.reading import _align, alignment_loss, cached_token_ids

    bank, _ = bank
    model = make_model(bank)
    rows = list(range(len(bank)))
    embed = model.base.get_input_embeddings().weight.detach()
    targets = embed[torch.tensor([t for x in cached_token_ids(bank, model.tokenizer, rows) for t in x])]
    cache, cache_len = bank.gather(torch.tensor(rows))
    states, _ = select_last_valid(cache, cache_len, cache_len.long())

    def dist() -> float:
        model.eval()
        with torch.no_grad():
            return float(alignment_loss(model.projector(states.float()), targets))

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    fresh = dist()
    assert model.projector.match_embedding_scale(embed) and not model.projector.match_embedding_scale(embed)
    start = dist()
    assert start < fresh
    w = WarmupConfig(align_steps=40, align_batch_size=8, align_lr=3e-3, warmup_steps=2)
    last = _align(model, w, rows, torch.Generator().manual_seed(0), tmp_path / "m.jsonl", 1.0)
    assert dist() < 0.5 * start
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 41)) and {x["stage"] for x in lines} == {"align"}
    assert last == lines[-1] and lines[-1]["loss/align"] < lines[0]["loss/align"]
    changed = {n.split(".")[0] for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {"projector"}
    with pytest.raises(ValueError, match="align_steps"):
        WarmupConfig(align_steps=-1)
    identity = make_model(bank, projector=ProjectorConfig(variant="identity"))
    with pytest.raises(ConfigError, match="no parameters"):
        _align(identity, w, rows, torch.Generator(), tmp_path / "i", 1.0)


def _tiny_warmups(tmp_path, base):
    """Data and bank of the tiny mechanism preset with overrides ``base``; returns
    ``run(name, *extra)``: the warm-up into ``tmp_path / name`` with ``extra`` overrides."""
    from conftest import ROOT

    from elasticmem.backbone import load_backbone
    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split
    from elasticmem.data.synthetic import write_synthetic
    from elasticmem.warmup.reading import warmup

    cfg = load_config(ROOT / "configs/tiny_mechanism.yaml", base)
    write_synthetic(cfg.data.synthetic, cfg.seed, cfg.data.dir)
    build_bank({s: load_split(cfg.data.dir, s) for s in ("train", "val", "test")}, load_backbone(cfg.backbone),
               cfg.chunking, cfg.bank, torch.float32, show_progress=False)

    def run(name, *extra):
        return warmup(load_config(ROOT / "configs/tiny_mechanism.yaml", [*base, f"warmup.output_dir={tmp_path / name}",
                                                                          *extra]))

    return run


def test_interrupted_warmup_resumes_to_the_uninterrupted_result(tmp_path):
    """Stopped after 3 answer steps (with a checkpoint) and run again, the warm-up ends with the
    same weights and the same logged losses as one uninterrupted run (LoRA dropout, uniform
    budgets and the data order all draw random numbers); other settings are refused."""
    from safetensors.torch import load_file

    from elasticmem.utils.checkpointing import list_checkpoints

    base = [f"data.dir={tmp_path}/data", f"bank.dir={tmp_path}/bank", "data.synthetic.num_histories=12",
            "memory.lora.dropout=0.1", "warmup.steps=7", "warmup.align_steps=3", "warmup.align_batch_size=4",
            "warmup.batch_size=4", "warmup.budgets=uniform", "warmup.save_every=2", "warmup.eval_split="]
    run = _tiny_warmups(tmp_path, base)

    run("whole")
    assert run("split", "warmup.stop_after_steps=3") ["stopped_at"] == 3 + 3
    split = tmp_path / "split"
    assert [p.name for p in list_checkpoints(split / "checkpoints")] == ["step_000006"]  # only the newest kept
    assert not (split / "final").exists()
    with pytest.raises(ConfigError, match="warmup.lr"):
        run("split", "warmup.lr=0.1")
    run("split", "warmup.eval_limit=5")  # a key a resumed run may change
    assert not (split / "checkpoints").exists()
    for f in ("projector.safetensors", "budget_policy.safetensors", "adapter/adapter_model.safetensors"):
        a, b = load_file(str(tmp_path / "whole/final" / f)), load_file(str(split / "final" / f))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f

    def logged(name):
        return [{k: v for k, v in json.loads(x).items() if k != "time/step"}
                for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    assert logged("split") == logged("whole") and len(logged("whole")) == 3 + 7


def test_activation_checkpointing_changes_memory_not_the_warmup(tmp_path, monkeypatch):
    """train.gradient_checkpointing=true (decoder layers and logit chunks recomputed in backward)
    ends the warm-up (reconstruction steps with the adapter off, answer steps, LoRA dropout on) with
    the weights and logged losses of the run without it; a resumed run may switch it."""
    from safetensors.torch import load_file

    from elasticmem.model.elasticmem import ElasticMem

    enabled = []
    enable = ElasticMem.enable_activation_checkpointing
    monkeypatch.setattr(ElasticMem, "enable_activation_checkpointing",
                        lambda self, *a, **kw: (enabled.append(a), enable(self, *a, **kw))[1])
    base = [f"data.dir={tmp_path}/data", f"bank.dir={tmp_path}/bank", "data.synthetic.num_histories=12",
            "memory.lora.dropout=0.1", "warmup.steps=3", "warmup.reconstruct_steps=2", "warmup.reconstruct_batch_size=4",
            "warmup.batch_size=4", "warmup.save_every=0", "warmup.eval_split="]
    run = _tiny_warmups(tmp_path, base)

    on = "train.gradient_checkpointing=true"
    run("plain")
    assert not enabled
    run("ckpt", on)
    assert len(enabled) == 1  # the warm-up's model was switched to checkpointing
    assert run("split", "warmup.stop_after_steps=1")["stopped_at"] == 2 + 1
    run("split", on)  # resumed with checkpointing switched on
    for name in ("ckpt", "split"):
        for f in ("projector.safetensors", "adapter/adapter_model.safetensors"):
            a, b = load_file(str(tmp_path / "plain/final" / f)), load_file(str(tmp_path / name / "final" / f))
            assert a.keys() == b.keys(), f
            for k in a:
                torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-5, msg=f"{name} {f} {k}")

    def losses(name):
        return [json.loads(x)["loss"] for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    assert len(losses("plain")) == 2 + 3
    for name in ("ckpt", "split"):
        assert losses(name) == pytest.approx(losses("plain"), rel=1e-5, abs=1e-6)


def test_memgen_weaver_sft_warmup_starts_its_grpo(tmp_path, capsys):
    """train.system=memgen: the warm-up's answer steps train MemGen's weaver on the targets (the
    target loss falls), its final/ is a MemGen model, and GRPO starts from exactly it (lr 0: the
    weights after one step are the warm-up's). Projector stages are refused for MemGen."""
    from conftest import ROOT, run_cli_here
    from safetensors.torch import load_file

    from elasticmem.backbone import load_backbone
    from elasticmem.baselines.memgen import saved_memgen_config
    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split
    from elasticmem.data.synthetic import write_synthetic
    from elasticmem.warmup.reading import warmup

    base = [f"data.dir={tmp_path}/data", f"bank.dir={tmp_path}/bank", "data.synthetic.num_histories=12",
            "train.system=memgen", "memory.retrieval=frozen", "memgen.prompt_latents=4", "memgen.trigger_hidden=16",
            "train.loss.retrieval_weight=0", "warmup.retrieval_weight=0", "warmup.steps=12", "warmup.batch_size=8",
            "warmup.lr=1e-2", "warmup.eval_split="]
    cfg = load_config(ROOT / "configs/tiny_mechanism.yaml", base)
    write_synthetic(cfg.data.synthetic, cfg.seed, cfg.data.dir)
    build_bank({s: load_split(cfg.data.dir, s) for s in ("train", "val", "test")}, load_backbone(cfg.backbone),
               cfg.chunking, cfg.bank, torch.float32, show_progress=False)
    with pytest.raises(ConfigError, match="warmup.align_steps"):
        warmup(load_config(ROOT / "configs/tiny_mechanism.yaml", [*base, "warmup.align_steps=3",
                                                                   f"warmup.output_dir={tmp_path / 'no'}"]))
    warmup(load_config(ROOT / "configs/tiny_mechanism.yaml", [*base, f"warmup.output_dir={tmp_path / 'w'}"]))
    final = tmp_path / "w" / "final"
    assert saved_memgen_config(final).prompt_latents == 4
    steps = [json.loads(x) for x in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    assert [m["stage"] for m in steps] == ["answer"] * 12 and all(m["memory_tokens"] == 4 for m in steps)
    loss = [m["loss/answer"] for m in steps]
    assert sum(loss[-3:]) < sum(loss[:3]), loss
    code, _, err = run_cli_here("train.py", ["--config", str(ROOT / "configs/tiny_mechanism.yaml"), *base,
                                             f"train.init_from={final}", f"train.output_dir={tmp_path / 'g'}",
                                             "train.max_steps=1", "train.lr=0", "train.batch_size=2",
                                             "train.group_size=2", "train.eval_split=", "train.save_every=0"], capsys)
    assert code == 0, err[-3000:]
    a, b = load_file(str(final / "memgen.safetensors")), load_file(str(tmp_path / "g/final/memgen.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a = load_file(str(final / "adapter/adapter_model.safetensors"))
    b = load_file(str(tmp_path / "g/final/adapter/adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_oracle_budgets_give_the_evidence_max_budget_and_the_others_none(bank):
    bank, examples = bank
    model = make_model(bank, policy={"max_budget": 5})
    batch = examples[:6]
    ev = [evidence_rows(ex, bank) for ex in batch]
    traj = model.teacher_forced(batch, _targets(model, batch), include_rows=ev, budgets="oracle")
    for i in range(len(batch)):
        rows = traj.rows[i][traj.mask[i]].tolist()
        assert ev[i] <= set(rows)
        assert traj.budgets[i][traj.mask[i]].tolist() == [5 if r in ev[i] else 0 for r in rows]
    with pytest.raises(ValueError, match="oracle"):
        model.teacher_forced(batch, _targets(model, batch), budgets="oracle")


@pytest.mark.parametrize("seed", [0, 1])
def test_budget_supervision_teaches_the_policy_where_the_evidence_is(tmp_path, seed):
    """warmup.budget_weight: after 40 answer steps the policy's greedy budgets on held-out
    questions go to the evidence (>= 3x the others' mean), where the untrained policy's do not."""
    from conftest import ROOT

    from elasticmem.backbone import load_backbone
    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split
    from elasticmem.data.synthetic import write_synthetic
    from elasticmem.systems import build_system
    from elasticmem.warmup.reading import warmup

    base = [f"data.dir={tmp_path}/data", f"bank.dir={tmp_path}/bank", "data.synthetic.num_histories=30",
            f"seed={seed}", "warmup.steps=40", "warmup.budgets=policy", "warmup.eval_split="]
    cfg = load_config(ROOT / "configs/tiny_mechanism.yaml", base)
    write_synthetic(cfg.data.synthetic, cfg.seed, cfg.data.dir)
    build_bank({s: load_split(cfg.data.dir, s) for s in ("train", "val", "test")}, load_backbone(cfg.backbone),
               cfg.chunking, cfg.bank, torch.float32, show_progress=False)
    warmup(load_config(ROOT / "configs/tiny_mechanism.yaml",
                       [*base, f"warmup.output_dir={tmp_path / 'on'}", "warmup.budget_weight=1.0"]))
    steps = [json.loads(x) for x in (tmp_path / "on/metrics.jsonl").read_text().splitlines()]
    assert "loss/budget" in steps[-1] and steps[-1]["loss/budget"] < steps[0]["loss/budget"] / 4
    val = load_split(cfg.data.dir, "val")

    def split(checkpoint):
        model = build_system(load_config(ROOT / "configs/tiny_mechanism.yaml",
                                         [*base, *([f"eval.checkpoint={checkpoint}"] if checkpoint else [])])).model
        traj = model.greedy(val)
        ev = torch.tensor([[int(r) in evidence_rows(ex, model.bank) for r in row.tolist()]
                           for ex, row in zip(val, traj.rows)])
        b = traj.budgets.float()
        return float(b[traj.mask & ev].mean()), float(b[traj.mask & ~ev].mean())

    ev_b, other_b = split(tmp_path / "on/final")
    assert ev_b >= 3 * other_b and ev_b >= 3.0
    ev0, other0 = split(None)  # the untrained policy
    assert not ev0 >= 3 * other0
