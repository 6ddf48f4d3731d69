"""Rollout benchmark: batched GRPO sampling vs the reference code's one-trajectory-at-a-time loop.

    python benchmarks/rollout.py                                  # tiny + smollm2 on CPU, B=4 x G=4, 3 repeats
    python benchmarks/rollout.py --models tiny --tiny-repeats 5   # quick (seconds)
    python benchmarks/rollout.py --batch 2 --group 8 --out /tmp/rollout.json
    python benchmarks/rollout.py --models qwen2.5-3b-random --device cuda --goal 10 --out /tmp/rollout.json  # GPU

Prints, per model, trajectories/s of the batched path (``ElasticMem.sample(batch, group_size=G)``)
and of the baseline, a re-implementation in this file of the reference code's loop with the SAME
model parts, so only the batching differs; their ratio batched / baseline (``--goal``), the
per-phase split, and the batched rollout's seconds over a compute floor (one bare batched forward
over exactly the positions it processed; goal <= 1.2). A greedy equivalence check of the two
paths runs first. ``--out`` writes it all as JSON.

Method and results: benchmarks/README.md, section ``rollout.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench.py, also when loaded by path
from _bench import REPO, cpu_name, log, med, write_json  # noqa: E402

import torch  # noqa: E402

from elasticmem.backbone import RANDOM_MODELS, load_backbone, named_model_config, resolve_device  # noqa: E402
from elasticmem.bank import Bank, build_bank, resolve_cache_dtype  # noqa: E402
from elasticmem.config import LoraConfig, MemoryConfig, load_config  # noqa: E402
from elasticmem.data.synthetic import generate  # noqa: E402
from elasticmem.model.budget_policy import BudgetPolicyConfig  # noqa: E402
from elasticmem.model.elasticmem import ElasticMem  # noqa: E402
from elasticmem.model.injection import Layout, assemble  # noqa: E402
from elasticmem.model.projector import ProjectorConfig  # noqa: E402

PHASES = ("retrieval", "policy", "generation")


def sync(device: torch.device) -> None:
    """Wait for the GPU's queued kernels (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tick(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished the work queued so far."""
    sync(device)
    return time.perf_counter()


@contextlib.contextmanager
def float32_weights(module: torch.nn.Module) -> Iterator[None]:
    """Inside the block every floating parameter and buffer of ``module`` is float32; after it each
    gets its own dtype back (bfloat16/float16 -> float32 -> back is exact). Ties are kept: a tensor
    is changed in place (``.data``), and shared ones are visited once."""
    low = [t for t in itertools.chain(module.parameters(), module.buffers())
           if t.is_floating_point() and t.dtype != torch.float32]
    dtypes = [t.dtype for t in low]
    for t in low:
        t.data = t.data.float()
    try:
        yield
    finally:
        for t, dt in zip(low, dtypes):
            t.data = t.data.to(dt)
        if low and any(t.is_cuda for t in low):
            torch.cuda.empty_cache()


# =========================================================================== setup


def pick_examples(examples_by_split: dict[str, list], B: int) -> tuple[list, list]:
    """The first example of each of the first B histories, and every example of those histories."""
    first: dict[str, Any] = {}
    for split in examples_by_split.values():
        for ex in split:
            first.setdefault(ex.group, ex)
    groups = list(first)[:B]
    if len(groups) < B:
        raise SystemExit(f"the preset generates only {len(groups)} histories, fewer than --batch {B}")
    keep = set(groups)
    members = [ex for split in examples_by_split.values() for ex in split if ex.group in keep]
    return [first[g] for g in groups], members


def memory_config(args) -> MemoryConfig:
    """MemoryConfig() defaults (the paper's settings) with the overrides given on the command line."""
    d = MemoryConfig()
    policy = dataclasses.replace(
        d.policy, **{k: v for k, v in (("d_model", args.policy_d), ("max_budget", args.max_budget)) if v is not None}
    )
    projector = (d.projector if args.projector_d is None
                 else dataclasses.replace(d.projector, hidden_size=args.projector_d))
    lora = d.lora if args.lora_r is None else dataclasses.replace(d.lora, r=args.lora_r, alpha=2 * args.lora_r)
    top_z = d.top_z if args.top_z is None else args.top_z
    assert isinstance(policy, BudgetPolicyConfig) and isinstance(projector, ProjectorConfig)
    assert isinstance(lora, LoraConfig)
    return dataclasses.replace(d, top_z=top_z, max_new_tokens=args.max_new_tokens, policy=policy,
                               projector=projector, lora=lora)


def setup(model_name: str, args, workdir: Path):
    """Backbone -> bank (built before peft wraps the backbone) -> ElasticMem in eval mode.

    Returns the model, the B examples, the bank's BuildResult and the build times, or None
    when the model is not available offline."""
    cfg = load_config(args.config)
    mcfg = named_model_config(model_name, args.device)
    t = time.perf_counter()
    try:
        backbone = load_backbone(mcfg)
    except FileNotFoundError as e:
        log(f"[{model_name}] skipped: {e}")
        return None
    sync(backbone.device)
    load_s = time.perf_counter() - t
    log(f"[{model_name}] backbone built/loaded in {load_s:.1f} s "
        f"(d={backbone.hidden_size}, {backbone.model.config.num_hidden_layers} layers, "
        f"{sum(p.numel() for p in backbone.model.parameters()) / 1e6:.1f}M params, vocabulary "
        f"{backbone.model.config.vocab_size}, {next(backbone.model.parameters()).dtype} on {backbone.device})")
    examples = generate(cfg.data.synthetic, cfg.seed)
    batch, members = pick_examples(examples, args.batch)
    bank_dir = workdir / f"bank-{model_name}"
    # The paper's bank (last-state keys, no per-layer KV), which MemoryConfig() reads: the preset's
    # layer-mean keys name layers a 2-layer test model lacks, and its KV cache is not what is timed.
    bank_cfg = dataclasses.replace(cfg.bank, dir=str(bank_dir), overwrite=True, verify=False,
                                   key="last", kv_cache=False)
    cache_dtype = resolve_cache_dtype("auto", backbone.device)  # float32 on CPU, float16 on CUDA
    t = time.perf_counter()
    res = build_bank({"bench": members}, backbone, cfg.chunking, bank_cfg, cache_dtype, show_progress=False)
    bank_s = time.perf_counter() - t
    log(f"[{model_name}] bank: {res.num_chunks} chunks in {res.num_groups} histories, n_cache={bank_cfg.n_cache}, "
        f"cache {str(cache_dtype).removeprefix('torch.')}, built in {bank_s:.1f} s "
        f"(incl. the encoder's fingerprint, a hash of its weights)")
    bank = Bank.open(bank_dir)
    mem = memory_config(args)
    torch.manual_seed(args.seed)
    model = ElasticMem(backbone, mem, bank)  # wraps backbone.model with peft in place
    if args.lora_std > 0:
        with torch.no_grad():
            for n, p in model.lm.named_parameters():
                if "lora_" in n:
                    p.normal_(0, args.lora_std)
    model.eval()
    log(f"[{model_name}] ElasticMem: top_z={mem.top_z}, B_max={mem.policy.max_budget} "
        f"(min {mem.policy.min_budget}), policy d_b={mem.policy.d_model} ({mem.policy.variant}), "
        f"projector d_p={mem.projector.hidden_size}, LoRA r={mem.lora.r}, max_new_tokens={mem.max_new_tokens}, "
        f"retrieval={mem.retrieval}")
    return model, batch, res, {"load_seconds": load_s, "bank_seconds": bank_s,
                               "bank_cache_dtype": str(cache_dtype).removeprefix("torch.")}


# =========================================================================== baseline


class PhaseClock:
    def __init__(self) -> None:
        self.t = dict.fromkeys(PHASES, 0.0)

    def add(self, phase: str, seconds: float) -> None:
        self.t[phase] += seconds


def baseline_trajectory(model: ElasticMem, prompt: list[int], suffix: list[int], group: str, greedy: bool,
                        temperature: float, full_logits: bool, clock: PhaseClock) -> dict[str, Any]:
    """One trajectory, batch size 1, no padding (the reference code's loop, with our model parts)."""
    dev = model.device
    t0 = tick(dev)
    # 1. prompt -> control-token logits, sample a, forward a on the KV cache -> h
    H, cache = model._forward_hidden(input_ids=torch.tensor([prompt], device=dev), use_cache=True)
    logits = model._logits(H[:, -1])  # [1, V]
    if greedy:
        a = logits.argmax(-1, keepdim=True)
    else:
        a = torch.multinomial(torch.softmax(logits / model.cfg.control_temperature, -1), 1)  # [1, 1]
    H_a, _ = model._forward_hidden(input_ids=a, cache=cache, use_cache=True)
    h = H_a[:, -1].float()  # [1, d]
    # 2. top-Z for this one query
    rows, scores, mask = model._retrieve(h, [group])
    t1 = tick(dev)
    # 3. budgets for this one trajectory
    bs = model.policy.sample(h, model._policy_inputs(h, rows), scores.to(dev), mask.to(dev), greedy=greedy)
    budgets = bs.budgets.cpu()
    t2 = tick(dev)
    # 4-5. project, assemble the single sequence, decode by hand on the KV cache
    soft, counts = model._soft_tokens(rows, budgets)
    x = assemble(model.base.get_input_embeddings(), [Layout(prompt, int(a), soft[0], suffix, [])], model.sep_ids)
    out = model.base(inputs_embeds=x.embeds, use_cache=True, logits_to_keep=0 if full_logits else 1)
    cache = out.cache
    eos = set(model.eos_ids)
    tokens: list[int] = []
    for step in range(model.cfg.max_new_tokens):
        logits = out.logits[:, -1].float()  # [1, V]
        if greedy:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1)  # [1, 1]
        tok = int(nxt)
        tokens.append(tok)
        if tok in eos or step == model.cfg.max_new_tokens - 1:
            break
        out = model.base(input_ids=nxt, cache=cache, use_cache=True)
        cache = out.cache
    t3 = tick(dev)
    clock.add("retrieval", t1 - t0)
    clock.add("policy", t2 - t1)
    clock.add("generation", t3 - t2)
    return {"control": int(a), "rows": rows[0], "budgets": budgets[0], "answer": tokens,
            "memory_tokens": int(counts.sum())}


def run_baseline(model: ElasticMem, batch: Sequence, G: int, temperature: float, full_logits: bool,
                 greedy: bool = False) -> tuple[float, dict[str, float], list[dict[str, Any]]]:
    dev = model.device
    clock = PhaseClock()
    t = tick(dev)
    out = []
    for ex in batch:
        t0 = tick(dev)
        prompt, suffix = model.encode_texts(ex)
        clock.add("retrieval", tick(dev) - t0)
        for _ in range(G):
            out.append(baseline_trajectory(model, prompt, suffix, ex.group, greedy, temperature, full_logits, clock))
    return tick(dev) - t, clock.t, out


def run_batched(model: ElasticMem, batch: Sequence, G: int, temperature: float):
    dev = model.device
    t = tick(dev)
    traj = model.sample(batch, group_size=G, temperature=temperature)
    return tick(dev) - t, dict(traj.timings), traj


def floor_inputs(model: ElasticMem, traj):
    """The assembled inputs of the compute floor and the (row, position) pairs needing logits."""
    fed = [traj.answer_ids[i][traj.answer_mask[i]].tolist()[:-1] for i in range(len(traj))]
    batch_in = assemble(model.base.get_input_embeddings(), model.trajectory_layouts(traj, fed), model.sep_ids)
    L = batch_in.embeds.shape[1]
    rows, pos = [], []
    for i, start in enumerate(batch_in.answer_start.tolist()):
        for p in range(start - 1, L):  # the last suffix token, then each fed answer token
            rows.append(i)
            pos.append(p)
    dev = model.device
    return batch_in, torch.tensor(rows, device=dev), torch.tensor(pos, device=dev)


def check_floor(model: ElasticMem, batch: Sequence) -> int:
    """The floor's inputs are the rollout's: on a greedy rollout, the argmax of the floor's logits
    at its logit positions is each trajectory's answer, token for token. Returns positions checked."""
    traj = model.greedy(list(batch))
    batch_in, rows, pos = floor_inputs(model, traj)
    h = model.base.get_decoder()(inputs_embeds=batch_in.embeds, attention_mask=batch_in.attention_mask,
                                 position_ids=batch_in.position_ids, use_cache=False).last_hidden_state
    pred = model.base.get_output_embeddings()(h[rows, pos]).argmax(-1)
    want = torch.cat([traj.answer_ids[i][traj.answer_mask[i]] for i in range(len(traj))])
    assert torch.equal(pred.cpu(), want), "the compute floor does not process the rollout's positions"
    return len(want)


def run_floor(model: ElasticMem, inputs) -> float:
    batch_in, rows, pos = inputs
    decoder, head = model.base.get_decoder(), model.base.get_output_embeddings()
    dev = model.device
    t = tick(dev)
    h = decoder(inputs_embeds=batch_in.embeds, attention_mask=batch_in.attention_mask,
                position_ids=batch_in.position_ids, use_cache=False).last_hidden_state
    head(h[rows, pos])
    return tick(dev) - t


# =========================================================================== check


def check_equivalence(model: ElasticMem, batch: Sequence, n: int, full_logits: bool) -> int:
    """Greedy baseline == model.greedy([ex]): control token, rows, budgets, answer tokens."""
    checked = 0
    for ex in batch[:n]:
        ref = model.greedy([ex])
        _, _, (mine,) = run_baseline(model, [ex], 1, 1.0, full_logits, greedy=True)
        m = ref.answer_mask[0]
        ref_answer = ref.answer_ids[0][m].tolist()
        assert mine["control"] == int(ref.control[0]), (ex.id, "control token", mine["control"], int(ref.control[0]))
        assert torch.equal(mine["rows"], ref.rows[0]), (ex.id, "retrieved rows")
        assert torch.equal(mine["budgets"], ref.budgets[0]), (ex.id, "budgets")
        assert mine["answer"] == ref_answer, (ex.id, "answer tokens", mine["answer"], ref_answer)
        assert mine["memory_tokens"] == int(ref.memory_tokens[0]), (ex.id, "soft tokens")
        checked += 1
    return checked


# =========================================================================== benchmark


def bench_model(model_name: str, args, workdir: Path) -> dict[str, Any] | None:
    made = setup(model_name, args, workdir)
    if made is None:
        return None
    model, batch, bank_res, build = made
    B, G, temp = args.batch, args.group, args.temperature
    N = B * G
    dev = model.device
    dtype = next(model.base.parameters()).dtype
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "top_z larger than a group" is reported below instead
        with float32_weights(model.lm):  # the checks are of positions, not rounding (benchmarks/README.md)
            n_ok = check_equivalence(model, batch, args.check, args.full_logits)
            log(f"[{model_name}] check passed: greedy baseline == model.greedy([ex]) on {n_ok} example(s) "
                f"(control token, rows, budgets, answer tokens){'' if dtype == torch.float32 else ', in float32'}")
            n_pos = check_floor(model, batch)
            log(f"[{model_name}] check passed: the compute floor's logits give a greedy rollout's {n_pos} answer "
                f"tokens{'' if dtype == torch.float32 else ', in float32'}")
        assert next(model.base.parameters()).dtype == dtype
        gpu_resident_mb = None
        if dev.type == "cuda":  # from here on: the rollouts' peak on top of what is resident
            sync(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            gpu_resident_mb = torch.cuda.memory_allocated(dev) / 2**20
        torch.manual_seed(args.seed)
        t_w1, _, traj = run_batched(model, batch, G, temp)
        t_w2, _, _ = run_baseline(model, batch, G, temp, args.full_logits)
        missing = int((~traj.mask).sum())
        log(f"[{model_name}] warm-up: batched {t_w1:.2f} s, baseline {t_w2:.2f} s"
            + (f"; {missing} of {traj.mask.numel()} retrieval slots empty (groups smaller than top_z)"
               if missing else ""))
        repeats = args.tiny_repeats if model_name == "tiny" else args.repeats
        rb: list[dict[str, Any]] = []
        rl: list[dict[str, Any]] = []
        for r in range(repeats):
            order = ("batched", "baseline") if r % 2 == 0 else ("baseline", "batched")
            for which in order:
                torch.manual_seed(args.seed + 1000 + r)
                if which == "batched":
                    s, ph, tr = run_batched(model, batch, G, temp)
                    fin = floor_inputs(model, tr)
                    rb.append({"seconds": s, "phases": ph, "floor": run_floor(model, fin),
                               "positions": int(fin[0].attention_mask.sum()), "logit_positions": len(fin[1]),
                               "memory_tokens": float(tr.memory_tokens.float().mean()),
                               "answer_tokens": float(tr.answer_mask.sum(-1).float().mean()),
                               "gen_steps": int(tr.answer_ids.shape[1])})
                else:
                    s, ph, outs = run_baseline(model, batch, G, temp, args.full_logits)
                    rl.append({"seconds": s, "phases": ph,
                               "memory_tokens": statistics.mean(o["memory_tokens"] for o in outs),
                               "answer_tokens": statistics.mean(len(o["answer"]) for o in outs)})
            log(f"[{model_name}] round {r + 1}/{repeats}: batched {rb[-1]['seconds']:.3f} s "
                f"({N / rb[-1]['seconds']:.2f} traj/s), compute floor {rb[-1]['floor']:.3f} s "
                f"({rb[-1]['positions']} positions), baseline {rl[-1]['seconds']:.3f} s "
                f"({N / rl[-1]['seconds']:.2f} traj/s)")

    def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
        sec = med([x["seconds"] for x in runs])
        return {
            "seconds": sec,
            "traj_per_s": N / sec,
            "seconds_all": [x["seconds"] for x in runs],
            "phases": {p: med([x["phases"][p] for x in runs]) for p in PHASES},
            "memory_tokens_per_traj": med([x["memory_tokens"] for x in runs]),
            "answer_tokens_per_traj": med([x["answer_tokens"] for x in runs]),
        }

    bat, base = summary(rb), summary(rl)
    floor = med([x["floor"] for x in rb])
    d = model.cfg
    shape = model.base.config
    return {
        "model": model_name,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "shape": {"hidden_size": shape.hidden_size, "num_layers": shape.num_hidden_layers,
                  "num_heads": shape.num_attention_heads, "num_kv_heads": shape.num_key_value_heads,
                  "intermediate_size": shape.intermediate_size, "vocab_size": shape.vocab_size,
                  "params_m": sum(p.numel() for n, p in model.base.named_parameters() if "lora_" not in n) / 1e6},
        **build,
        "B": B, "G": G, "trajectories": N, "repeats": repeats,
        "settings": {"top_z": d.top_z, "max_budget": d.policy.max_budget, "policy_d_model": d.policy.d_model,
                     "projector_d": d.projector.hidden_size, "lora_r": d.lora.r,
                     "max_new_tokens": d.max_new_tokens, "temperature": temp, "full_logits": args.full_logits,
                     "lora_std": args.lora_std},
        "bank_chunks": bank_res.num_chunks,
        "prompt_tokens": [len(model.encode_texts(ex)[0]) for ex in batch],
        "suffix_tokens": [len(model.encode_texts(ex)[1]) for ex in batch],
        "batched": bat,
        "baseline": base,
        "ratio": bat["traj_per_s"] / base["traj_per_s"],
        "floor": {"seconds": floor, "seconds_all": [x["floor"] for x in rb],
                  "positions": med([x["positions"] for x in rb]),
                  "logit_positions": med([x["logit_positions"] for x in rb])},
        "floor_ratio": bat["seconds"] / floor,
        "peak_rss_mb": _peak_rss_mb(),
        "peak_gpu_mb": torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None,
        "gpu_resident_mb": gpu_resident_mb,
    }


def _peak_rss_mb() -> float:
    import resource

    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


def print_table(results: list[dict[str, Any]], goal: float) -> None:
    if not results:
        log("no results")
        return
    w = max(8, *(len(r["model"]) for r in results))
    width = 110 + w
    log("")
    log("=" * width)
    hdr = (f"{'model':<{w}} {'BxG':>5} {'path':<9} {'s/rollout':>10} {'traj/s':>8} "
           f"{'retrieval s':>12} {'policy s':>9} {'generation s':>13} {'soft tok/traj':>14} {'ans tok/traj':>13}"
           f" {'ratio':>7}")
    log(hdr)
    log("-" * width)
    for r in results:
        for path in ("batched", "baseline"):
            x = r[path]
            ph = x["phases"]
            ratio = f"{r['ratio']:.2f}x" if path == "batched" else ""
            log(f"{r['model']:<{w}} {r['B']}x{r['G']:<3} {path:<9} {x['seconds']:>10.3f} {x['traj_per_s']:>8.2f} "
                f"{ph['retrieval']:>12.3f} {ph['policy']:>9.3f} {ph['generation']:>13.3f} "
                f"{x['memory_tokens_per_traj']:>14.1f} {x['answer_tokens_per_traj']:>13.2f} {ratio:>7}")
    log("-" * width)
    for r in results:
        ok = "meets" if r["ratio"] >= goal else "below"
        log(f"{r['model']}: batched/baseline = {r['ratio']:.2f}x at B*G={r['trajectories']} ({ok} the {goal:g}x goal); "
            f"medians of {r['repeats']} rounds on {r['device']} ({r['dtype']})")
        fl = r["floor"]
        ok = "meets" if r["floor_ratio"] <= 1.2 else "above"
        log(f"{r['model']}: batched rollout / compute floor = {r['floor_ratio']:.2f}x ({ok} the 1.2x goal; floor "
            f"{fl['seconds']:.3f} s for {fl['positions']:.0f} positions, LM head on {fl['logit_positions']:.0f}); "
            f"peak RSS {r['peak_rss_mb']:.0f} MB"
            + ("" if r["peak_gpu_mb"] is None else
               f", peak GPU {r['peak_gpu_mb']:.0f} MB ({r['gpu_resident_mb']:.0f} MB resident before the rollouts)"))
    log("phases: retrieval = text encoding + prompt/control forwards + top-Z; policy = budget policy; "
        "generation = soft tokens + assembly + answer decoding (batched: Trajectories.timings)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2", *RANDOM_MODELS])
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda, cuda:1, ... or auto (CUDA if available); dtype: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batch", type=int, default=4, help="B: queries per rollout batch")
    p.add_argument("--group", type=int, default=4, help="G: trajectories per query")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per model (all but tiny)")
    p.add_argument("--tiny-repeats", type=int, default=10, help="timed rounds for the tiny model (fast)")
    p.add_argument("--check", type=int, default=2, help="examples in the greedy equivalence check")
    p.add_argument("--config", default=str(REPO / "configs" / "quickstart.yaml"),
                   help="preset whose data.synthetic, chunking and bank settings are used")
    p.add_argument("--top-z", type=int, default=None, help="override MemoryConfig().top_z (20)")
    p.add_argument("--max-budget", type=int, default=None, help="override B_max (20)")
    p.add_argument("--policy-d", type=int, default=None, help="override the policy width d_b (256)")
    p.add_argument("--projector-d", type=int, default=None, help="override the projector width d_p (2560)")
    p.add_argument("--lora-r", type=int, default=None, help="override the LoRA rank (16; alpha = 2r)")
    p.add_argument("--lora-std", type=float, default=0.0,
                   help="if > 0, draw LoRA weights from N(0, std) instead of peft's init (B = 0)")
    p.add_argument("--max-new-tokens", type=int, default=5)
    p.add_argument("--temperature", type=float, default=1.0, help="answer sampling temperature")
    p.add_argument("--full-logits", action="store_true",
                   help="baseline prefill computes logits at every position, as the reference code does")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads; 0 = torch's choice (one by default: benchmarks/README.md says why)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goal", type=float, default=3.0, help="batched/baseline goal (3 on CPU; the GPU check passes 10)")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    device = resolve_device(args.device)  # raises if CUDA is asked for and not there
    args.device = str(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    gpu = f", {torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda})" if device.type == "cuda" else ""
    log(f"rollout benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, {cpu_name()}{gpu}; device {device}; "
        f"B={args.batch}, G={args.group}")
    workdir = Path(tempfile.mkdtemp(prefix="elasticmem-rollout-bench-"))
    results = []
    try:
        for name in args.models:
            r = bench_model(name, args, workdir)
            gc.collect()  # the model of this round, before the next is built
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if r is not None:
                results.append(r)
                log(f"[{name}] ratio {r['ratio']:.2f}x")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(results, args.goal)
    if args.out:
        meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                "device": str(device), "cuda": torch.version.cuda if device.type == "cuda" else None,
                "argv": sys.argv[1:], "load_avg": os.getloadavg()}
        write_json(args.out, {"meta": meta, "results": results}, __file__, argv)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
