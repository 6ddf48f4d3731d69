"""Checks that need a GPU (marker ``gpu``): bf16 against fp32, 4-bit base weights, faiss-gpu, GPU bank
builds, group-restricted search on the model's device.

    pytest -m gpu tests/gpu                                   # on a CUDA machine (scripts/gpu_check.sh runs it)
    ELASTICMEM_GPU_TEST_DEVICE=cpu pytest -m gpu tests/gpu    # the dry run (scripts/gpu_check.sh --dry-run)

Without CUDA these tests skip, unless ``ELASTICMEM_GPU_TEST_DEVICE`` names the device to run them
on: the dry run runs them on the CPU (bf16 and the bank build compare the CPU with itself there;
4-bit and faiss-gpu need CUDA and skip), so that the code a GPU machine runs cannot rot.

Tolerances (bf16 on the CPU, in the dry run, stays far inside them: log-prob error 0.007, gradient
norm 0.06 %; a GPU's bf16 kernels accumulate differently, hence the room):

* bf16 (weights in bfloat16 and bf16 autocast, the CUDA default) against fp32 on the same
  trajectories: answer, budget and control log-probs within ``LOGP_ATOL`` (max over tokens),
  query states at cosine >= ``COS_MIN``; the gradient of the first GRPO iteration (advantage-
  weighted log-probs) at cosine >= ``GRAD_COS_MIN`` and norm within ``REL_TOL``; GRPO steps
  replaying the same rollouts: gradient norm and budget entropy within ``REL_TOL`` relative.
* a bank built on the GPU (fp32 weights, float16 cache, the GPU default) against one built on
  the CPU (fp32, float32 cache): keys within 1e-4, caches within float16 rounding (rtol 1e-3).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, make_examples

from elasticmem.config import BankConfig, ChunkingConfig, IndexConfig, BackboneConfig, load_config

DEVICE = os.environ.get("ELASTICMEM_GPU_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else None)
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE is None, reason="needs CUDA (scripts/gpu_check.sh --dry-run runs these on the CPU)"),
]
needs_cuda = pytest.mark.skipif(DEVICE is None or not DEVICE.startswith("cuda"), reason="needs a CUDA device")

LOGP_ATOL = 0.03
COS_MIN = 0.999
GRAD_COS_MIN = 0.99
REL_TOL = 0.02


@pytest.fixture(scope="module")
def tiny_task(tmp_path_factory):
    """The tiny preset's data (48 histories: 3 banks are built from it) and an fp32 bank built on
    the CPU (the reference for every test)."""
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import build_bank
    from elasticmem.data.schema import load_split
    from elasticmem.data.synthetic import write_synthetic

    root = tmp_path_factory.mktemp("gpu")
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"data.dir={root}/data", f"bank.dir={root}/bank_cpu",
                                                   "data.synthetic.num_histories=48"])
    write_synthetic(cfg.data.synthetic, cfg.seed, cfg.data.dir)
    examples = {s: load_split(cfg.data.dir, s) for s in ("train", "val", "test")}
    build_bank(examples, load_backbone(dataclasses.replace(cfg.backbone, device="cpu", dtype="float32")),
               cfg.chunking, cfg.bank, torch.float32, show_progress=False)
    return root, cfg, examples


def _bank_on(root: Path, cfg, examples, device: str, dtype: str, name: str):
    """The tiny bank built by the backbone on ``device`` in ``dtype`` (cache: that device's default)."""
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import Bank, build_bank, resolve_cache_dtype

    backbone = load_backbone(dataclasses.replace(cfg.backbone, device=device, dtype=dtype))
    bank_cfg = dataclasses.replace(cfg.bank, dir=str(root / name))
    build_bank(examples, backbone, cfg.chunking, bank_cfg, resolve_cache_dtype("auto", backbone.device),
               show_progress=False)
    return Bank.open(bank_cfg.dir, expect_fingerprint=backbone.fingerprint)


def _train(overrides: list[str]) -> None:
    """train.py on the tiny preset in a fresh process (its own accelerate state)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if DEVICE == "cpu":
        env["ACCELERATE_USE_CPU"] = "1"
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs/tiny.yaml"),
                        *overrides], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]


# ---------------------------------------------------------------------------- bf16 against fp32


@pytest.fixture(scope="module")
def bf16_bank(tiny_task):
    """The tiny bank built by the bf16 backbone on ``DEVICE`` (a bf16 model is another encoder)."""
    root, cfg, examples = tiny_task
    return _bank_on(root, cfg, examples, DEVICE, "bfloat16", "bank_bf16")


@pytest.fixture(scope="module")
def fp32_and_bf16(tiny_task, bf16_bank, tmp_path_factory):
    """The same trained parts (a non-zero adapter) on an fp32 and a bf16 backbone, and trajectories
    the fp32 model sampled on 8 validation questions."""
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import Bank
    from elasticmem.model.elasticmem import ElasticMem

    root, cfg, examples = tiny_task
    bank = Bank.open(cfg.bank.dir)
    mem = dataclasses.replace(cfg.memory, lora=dataclasses.replace(cfg.memory.lora, dropout=0.0))
    torch.manual_seed(0)
    fp32 = ElasticMem(load_backbone(dataclasses.replace(cfg.backbone, device=DEVICE, dtype="float32")), mem, bank).eval()
    with torch.no_grad():  # a non-zero adapter, so that the adapter's path is compared too
        for n, p in fp32.lm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    parts = tmp_path_factory.mktemp("parts")
    fp32.save_pretrained(parts)
    bf16 = ElasticMem(load_backbone(dataclasses.replace(cfg.backbone, device=DEVICE, dtype="bfloat16")), mem, bf16_bank)
    bf16.load_weights(parts)
    bf16.eval()
    batch = examples["val"][:8]
    torch.manual_seed(1)
    traj = fp32.sample(batch, group_size=4)
    assert int(traj.answer_mask.sum()) > 0 and int(traj.memory_tokens.sum()) > 0
    return fp32, bf16, traj, batch


def test_bf16_scores_the_same_trajectories_as_fp32(fp32_and_bf16):
    """fp32 samples trajectories; bf16 (weights, bank and autocast, with the same trained parts) scores them."""
    fp32, bf16, traj, batch = fp32_and_bf16
    with torch.no_grad():
        ref = fp32.score(traj)
        with torch.autocast(device_type=bf16.device.type, dtype=torch.bfloat16):
            got = bf16.score(traj)
    m = traj.answer_mask.to(ref.logp_answer.device)
    answer_err = float((got.logp_answer.float() - ref.logp_answer)[m].abs().max())
    budget_err = float((got.logp_budget.float() - ref.logp_budget).abs().max())
    control_err = float((got.logp_control.float() - ref.logp_control).abs().max())
    assert max(answer_err, budget_err, control_err) <= LOGP_ATOL, (answer_err, budget_err, control_err)
    # the rollout's recorded log-probs are the fp32 model's own (sampling and scoring agree)
    torch.testing.assert_close(traj.logp_control.to(ref.logp_control.device), ref.logp_control, atol=1e-4, rtol=0)
    # bf16's own query states and retrieval
    h32, h16 = fp32.query_states(batch).float(), bf16.query_states(batch).float()
    cos = torch.nn.functional.cosine_similarity(h32, h16, dim=-1)
    assert float(cos.min()) >= COS_MIN, cos
    rows32, rows16 = fp32.retrieve(batch)[0], bf16.retrieve(batch)[0]
    overlap = np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(rows32.tolist(), rows16.tolist())])
    assert overlap >= 0.75, (overlap, rows32, rows16)


def _policy_gradient(model, traj, bf16: bool) -> torch.Tensor:
    """The trainable parts' gradient, flattened in parameter order, of the first GRPO iteration's
    objective on ``traj``: at ratio 1 the clipped objective's gradient is that of the
    advantage-weighted log-probs of every present unit (fixed +-1 advantages here)."""
    from elasticmem.grpo.loss import PartMasks

    model.zero_grad(set_to_none=True)
    with torch.autocast(device_type=model.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model.score(traj)
    masks = PartMasks.of(traj)
    adv = torch.tensor([1.0, -1.0]).repeat((len(traj) + 1) // 2)[: len(traj)].to(out.logp_answer.device)
    parts = [(out.logp_control, masks.control), (out.logp_budget, masks.budget), (out.logp_answer, masks.answer)]
    objective = sum((torch.where(m.to(lp.device), lp.float(), 0.0) * adv.view(-1, *[1] * (lp.dim() - 1))).sum()
                    for lp, m in parts)
    objective.backward()
    grads = [p.grad.float().flatten() if p.grad is not None else torch.zeros(p.numel(), device=p.device)
             for _, p in sorted((n, p) for n, p in model.named_parameters() if p.requires_grad)]
    model.zero_grad(set_to_none=True)
    return torch.cat([g.cpu() for g in grads])


def test_bf16_policy_gradient_agrees_with_fp32(fp32_and_bf16):
    """The gradient a GRPO step takes, from bf16 log-probs against fp32 ones on the same trajectories
    and trained parts: what the bf16 training test's replayed steps cannot show through their
    loss (at one iteration the PPO ratio is 1, so the loss value does not depend on the log-probs)."""
    fp32, bf16, traj, _ = fp32_and_bf16
    g32, g16 = _policy_gradient(fp32, traj, bf16=False), _policy_gradient(bf16, traj, bf16=True)
    assert g32.shape == g16.shape and float(g32.norm()) > 0
    cos = float(torch.nn.functional.cosine_similarity(g32, g16, dim=0))
    rel = float(g16.norm() / g32.norm() - 1)
    assert cos >= GRAD_COS_MIN and abs(rel) <= REL_TOL, (cos, rel)


@pytest.mark.timeout(900)
def test_bf16_training_replays_fp32_rollouts_within_tolerance(tiny_task, bf16_bank, tmp_path):
    """Three GRPO steps in fp32 record their rollouts; bf16 (a bf16-built bank, bf16 weights,
    bf16 mixed precision) replays them: per-step rewards, gradient norm and budget entropy agree."""
    root, cfg, examples = tiny_task
    common = [f"data.dir={root}/data", "train.max_steps=3", "train.eval_limit=8", "train.save_every=0",
              f"backbone.device={DEVICE}", "memory.lora.dropout=0.0", "train.batch_size=8", "train.group_size=4"]
    # separate processes: accelerate's mixed precision is fixed once per process
    _train([*common, f"bank.dir={root}/bank_cpu", "backbone.dtype=float32", "train.mixed_precision=no",
            f"train.output_dir={tmp_path}/fp32", f"train.record_rollouts={tmp_path}/rec"])
    _train([*common, f"bank.dir={bf16_bank.root}", "backbone.dtype=bfloat16", "train.mixed_precision=bf16",
            f"train.output_dir={tmp_path}/bf16", f"train.replay_rollouts={tmp_path}/rec"])
    a, b = ([json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
            for run in ("fp32", "bf16"))
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        assert ra["reward/mean"] == rb["reward/mean"], "replayed rollouts carry the same rewards"
        # not the loss: with one iteration the PPO ratio is 1 and the loss is a function of the
        # advantages alone; the gradient (its norm here; test_bf16_policy_gradient_agrees_with_fp32
        # compares the whole of it) is where bf16 log-probs show
        for k in ("grad_norm", "entropy/budget"):
            assert rb[k] == pytest.approx(ra[k], rel=REL_TOL), (ra["step"], k, ra[k], rb[k])


# ---------------------------------------------------------------------------- 4-bit base weights


@needs_cuda
@pytest.mark.timeout(900)
def test_4bit_base_loads_samples_and_trains_a_step(tiny_task, tmp_path):
    """A saved random Qwen2 folder loaded as NF4 (bitsandbytes): a bank, greedy rollouts, one GRPO step."""
    pytest.importorskip("bitsandbytes", reason="backbone.load_in_4bit needs bitsandbytes (pip install 'elasticmem[gpu]')")
    from elasticmem.backbone import build_tiny_model, build_tiny_tokenizer, load_backbone
    from elasticmem.bank import Bank, build_bank
    from elasticmem.config import TinyModelConfig
    from elasticmem.model.elasticmem import ElasticMem

    root, cfg, examples = tiny_task
    shape = TinyModelConfig(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512)
    tok = build_tiny_tokenizer()
    folder = tmp_path / "qwen2-random"
    build_tiny_model(shape, tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    mcfg = BackboneConfig(name_or_path=str(folder), device=DEVICE, load_in_4bit=True)
    backbone = load_backbone(mcfg)
    n4 = sum(type(m).__name__ == "Linear4bit" for m in backbone.model.modules())
    assert n4 >= 2 * 7, f"expected the decoder's linear layers in NF4, found {n4} Linear4bit modules"
    bank_cfg = BankConfig(dir=str(tmp_path / "bank4"), n_cache=cfg.bank.n_cache)
    build_bank(examples, backbone, cfg.chunking, bank_cfg, torch.float16, show_progress=False)
    bank = Bank.open(bank_cfg.dir, expect_fingerprint=backbone.fingerprint)
    keys = bank.keys()
    assert torch.isfinite(keys).all() and keys.norm(dim=-1).sub(1).abs().max() < 1e-3
    model = ElasticMem(backbone, cfg.memory, bank).eval()
    traj = model.greedy(examples["val"][:4])
    assert len(traj) == 4 and int(traj.answer_mask.sum()) > 0
    over = [f"data.dir={root}/data", f"bank.dir={bank_cfg.dir}", f"backbone.name_or_path={folder}",
            "backbone.load_in_4bit=true", f"backbone.device={DEVICE}", "train.max_steps=1", "train.eval_limit=4",
            f"train.output_dir={tmp_path}/run4", "train.save_every=0"]
    _train(over)
    m = json.loads((tmp_path / "run4" / "metrics.jsonl").read_text().splitlines()[0])
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0


# ---------------------------------------------------------------------------- faiss-gpu


@needs_cuda
@pytest.mark.parametrize("index_type", ["flat", "ivf"])
def test_faiss_gpu_search_equals_cpu_flat_search(tmp_path, index_type):
    faiss = pytest.importorskip("faiss")
    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        pytest.skip("faiss has no GPU support here (pip uninstall -y faiss-cpu && pip install 'elasticmem[gpu]')")
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import Bank, build_bank, build_index

    backbone = load_backbone(BackboneConfig(name_or_path="tiny", device="cpu"))
    cfg = BankConfig(dir=str(tmp_path / "bank"), n_cache=4, shard_rows=16)
    build_bank({"train": make_examples(8)}, backbone, ChunkingConfig(max_tokens=64), cfg, torch.float32,
               show_progress=False)
    bank = Bank.open(cfg.dir)
    q = torch.from_numpy(np.random.default_rng(0).normal(size=(32, bank.hidden_size)).astype(np.float32))
    cpu = build_index(bank, IndexConfig(type="flat"))
    gpu = build_index(bank, IndexConfig(type=index_type, gpu=True, nlist=4, nprobe=4, save=False))  # all cells
    want, got = cpu.search(q, 10), gpu.search(q, 10)
    assert torch.equal(want.rows, got.rows)
    torch.testing.assert_close(got.scores, want.scores, atol=1e-4, rtol=0)
    groups = [f"g{i % 8}" for i in range(32)]  # restricted: exact on the index's device, not faiss
    want, got = cpu.search(q, 6, groups), gpu.search(q, 6, groups)
    assert torch.equal(want.rows, got.rows)


# ---------------------------------------------------------------------------- bank on the GPU


def test_bank_built_on_the_device_equals_the_cpu_bank(tiny_task):
    """fp32 weights on ``DEVICE`` with that device's default cache dtype (float16 on CUDA)."""
    from elasticmem.bank import Bank

    root, cfg, examples = tiny_task
    cpu = Bank.open(cfg.bank.dir)
    dev = _bank_on(root, cfg, examples, DEVICE, "float32", "bank_dev_fp32")
    assert dev.num_chunks == cpu.num_chunks and dev.fingerprint != "" and len(dev.shards) == len(cpu.shards)
    assert [c["text"] for c in dev.chunks()] == [c["text"] for c in cpu.chunks()]
    torch.testing.assert_close(dev.keys(), cpu.keys(), atol=1e-4, rtol=0)
    rows = torch.arange(cpu.num_chunks)
    a, b = dev.gather(rows), cpu.gather(rows)
    torch.testing.assert_close(a[0].float(), b[0].to(a[0].dtype).float(), atol=1e-3, rtol=1e-3)
    assert torch.equal(a[1], b[1]), "the cached lengths are the same"


# ---------------------------------------------------------------------------- search on the model's device


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


def test_training_warmup_and_evaluation_search_on_the_models_device(tiny_task, tmp_path, monkeypatch):
    """Every group-restricted search of a GRPO step, a warm-up step and an evaluation's retrieval
    multiplies on the device the model is on (the callers pass ``build_index(..., device=
    backbone.device)``), not on the CPU while the model sits on a GPU. In the CPU dry run the model's
    device is the CPU: there it checks that the three paths run and search where the model is."""
    from elasticmem.bank import index as index_mod
    from elasticmem.systems import build_system
    from elasticmem.grpo.trainer import train
    from elasticmem.warmup.reading import warmup

    real, seen = index_mod.exact_search, []

    def recording(q, k, segs, keys_of, device="cpu"):
        seen.append(torch.device(device))
        return real(q, k, segs, keys_of, device)

    monkeypatch.setattr(index_mod, "exact_search", recording)
    root, cfg, examples = tiny_task
    want = torch.device(DEVICE)
    common = [f"data.dir={root}/data", f"bank.dir={cfg.bank.dir}", f"backbone.device={DEVICE}"]
    runs = {
        "train": lambda: train(load_config(ROOT / "configs/tiny.yaml", [
            *common, "train.max_steps=1", "train.batch_size=4", "train.group_size=2", "train.eval_split=",
            "train.save_every=0", f"train.output_dir={tmp_path}/train"])),
        "warmup": lambda: warmup(load_config(ROOT / "configs/tiny.yaml", [
            *common, "warmup.steps=1", "warmup.batch_size=4", "warmup.eval_split=",
            f"warmup.output_dir={tmp_path}/warmup"])),
        "eval": lambda: build_system(load_config(ROOT / "configs/tiny.yaml", common)).model.retrieve(
            examples["val"][:4]),
    }
    for name, run in runs.items():
        seen.clear()
        run()
        assert seen, f"{name}: no group-restricted search ran"
        assert all(_same_device(d, want) for d in seen), (name, DEVICE, sorted(set(map(str, seen))))
