"""Bank benchmark: builder throughput vs a bare-forward ceiling, bytes on disk, key search.

    python benchmarks/bank_build.py                                   # full: tiny + smollm2, 100k and 1M keys
    python benchmarks/bank_build.py --max-chunks 200 --sizes 10000    # quick check (a minute or two)
    python benchmarks/bank_build.py --skip-search --models smollm2    # builder only
    python benchmarks/bank_build.py --skip-build --sizes 100000 --out /tmp/bank_bench.json
    python benchmarks/bank_build.py --skip-search --models qwen2.5-3b-random --device cuda --max-chunks 400
    # keys with the structure of real ones: a real bank's keys grown to 1M, its data's questions as queries
    python -m elasticmem.data.prepare locomo-mc10 --input PATH/locomo10.json --out /tmp/big/data
    python build_bank.py --config configs/locomo_mc10.yaml data.dir=/tmp/big/data bank.dir=/tmp/big/bank
    python benchmarks/bank_build.py --skip-build --keys real --real-bank /tmp/big/bank --real-data /tmp/big/data \\
        --sizes 1000000 --nprobe 8 16 32 64 128 --ef-search 32 64 128 256 --out runs/bench/search_1m_real.json

Everything is measured in this process and reported as ratios against a
baseline measured in the same process (machines are noisy), next to the
absolute numbers. Nothing is hard-coded.

The baselines: for the builder (``build_bank`` end to end), bare batched
forwards over the same batches (goal >= 0.9); for the bank's bytes, the ideal
cache bytes (goal <= 1.02); for FAISS ``flat``, ``ivf`` and ``hnsw`` search,
exact ``torch`` search (latency ratio, recall@k against it).

A summary table is printed at the end; ``--out PATH`` also writes it as JSON
(rewritten after each section, so a partial run leaves its results).

Why one file (about 1,000 lines): one command, one JSON that one README section reads; its three
parts share the contention guard (``wait_quiet``, ``ShareMeter``), the corpus and the summary table.
What every benchmark shares is in ``_bench.py``.

Method and results: benchmarks/README.md, section ``bank_build.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench.py, also when loaded by path
from _bench import REPO, cpu_name, log, med, write_json  # noqa: E402

import torch  # noqa: E402

from elasticmem.bank import builder as B  # noqa: E402
from elasticmem.bank.index import build_index  # noqa: E402
from elasticmem.bank.store import CHUNKS, MANIFEST, Bank  # noqa: E402
from elasticmem.config import BackboneConfig, IndexConfig, MemoryConfig, load_config  # noqa: E402
from elasticmem.data.chunking import chunk_history  # noqa: E402
from elasticmem.data.synthetic import generate  # noqa: E402


def cpu_seconds() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _cpu_busy_idle() -> tuple[int, int]:
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = f[3] + f[4]
    return sum(f[:8]) - idle, idle


QUIET = {"max_wait_s": 0.0, "threshold": 0.25, "waited_s": 0.0, "gave_up": 0}


def wait_quiet() -> float:
    """Before a timed run: wait (up to --quiet-wait s) until the machine's CPUs are mostly idle
    (this process is idle here, so busy time is someone else's). Returns seconds waited."""
    if QUIET["max_wait_s"] <= 0:
        return 0.0
    t0 = time.perf_counter()
    while True:
        b0, i0 = _cpu_busy_idle()
        c0 = cpu_seconds()
        time.sleep(0.5)
        b1, i1 = _cpu_busy_idle()
        own = (cpu_seconds() - c0) * os.sysconf("SC_CLK_TCK")  # our own leftover spinning threads
        busy = max(0.0, (b1 - b0) - own) / max(1, (b1 - b0) + (i1 - i0))
        waited = time.perf_counter() - t0
        if busy <= QUIET["threshold"]:
            break
        if waited >= QUIET["max_wait_s"]:
            QUIET["gave_up"] += 1
            log(f"  (machine still {100 * busy:.0f}% busy after {waited:.0f} s of waiting; measuring anyway)")
            break
        time.sleep(2.0)
    QUIET["waited_s"] += waited
    return waited


class Contended(RuntimeError):
    """A timed run lost its CPUs to other processes; it is thrown away and run again."""


GUARD = {"min_share": 0.8, "max_retries": 4, "min_check_s": 1.0, "aborted": 0, "kept_contended": 0}


class ShareMeter:
    """CPU share (process CPU s / (wall s * torch threads)) over the parts of a run it is told about.

    With ``abort`` on, ``add`` raises ``Contended`` once at least ``min_check_s`` of wall time has been
    seen and the share is below ``min_share``: the 2 compute threads are not getting 2 CPUs."""

    def __init__(self, abort: bool):
        self.abort, self.wall, self.cpu = abort, 0.0, 0.0

    @property
    def share(self) -> float:
        return self.cpu / (self.wall * torch.get_num_threads()) if self.wall > 0 else float("nan")

    def final_check(self) -> None:
        """For runs too short for ``add`` to judge: the share over the whole run."""
        if self.abort and self.wall > 0 and self.share < GUARD["min_share"]:
            raise Contended(f"cpu share {100 * self.share:.0f}% over the run ({self.wall:.2f} s)")

    def add(self, wall: float, cpu: float) -> None:
        self.wall += wall
        self.cpu += cpu
        if self.abort and self.wall >= GUARD["min_check_s"] and self.share < GUARD["min_share"]:
            raise Contended(f"cpu share {100 * self.share:.0f}% after {self.wall:.1f} s")


def guarded(label: str, fn):
    """Run ``fn(abort)`` after waiting for idle CPUs; rerun it when it reports contention
    (up to --max-retries times; the last try runs to the end whatever happens)."""
    for attempt in range(GUARD["max_retries"] + 1):
        wait_quiet()
        last = attempt == GUARD["max_retries"]
        try:
            return fn(not last)
        except Contended as e:
            GUARD["aborted"] += 1
            log(f"  ({label}: {e}: other load on the machine, run thrown away, retry {attempt + 1}/"
                f"{GUARD['max_retries']})")
    raise AssertionError("unreachable")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# =========================================================================== corpus


def load_corpus(config_path: str, max_chunks: int):
    cfg = load_config(config_path)
    examples = generate(cfg.data.synthetic, cfg.seed)
    examples = {s: examples[s] for s in cfg.bank.splits if s in examples}
    groups = B.collect_groups(examples)
    counts = {g: len(chunk_history(ex.history, g)) for g, ex in groups.items()}
    if max_chunks and max_chunks > 0:
        keep, total = set(), 0
        for g, n in counts.items():
            if total >= max_chunks:
                break
            keep.add(g)
            total += n
        examples = {s: [ex for ex in exs if ex.group in keep] for s, exs in examples.items()}
        examples = {s: exs for s, exs in examples.items() if exs}
        counts = {g: n for g, n in counts.items() if g in keep}
    return cfg, examples, sum(counts.values()), len(counts)


# =========================================================================== phase timers


class PhaseTimer:
    """Accumulates seconds per phase: builder functions (monkeypatched in the module namespace
    for the duration of a run; the files are untouched) and decoder forwards (hooks)."""

    FUNCS = ("make_plan", "_prepare_dir", "_write_chunks", "encode_shard", "_write_shard")

    def __init__(self, decoder: torch.nn.Module, device: torch.device):
        self.decoder, self.device = decoder, device
        self.t: dict[str, float] = {}
        self._t0 = self._c0 = 0.0
        self.meter = ShareMeter(False)
        self._hooks: list[Any] = []
        self._saved: dict[str, Any] = {}

    def _wrap(self, name, fn):
        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0
        return wrapped

    def _pre(self, *_):
        sync(self.device)
        self._c0, self._t0 = cpu_seconds(), time.perf_counter()

    def _post(self, *_):
        sync(self.device)
        dt = time.perf_counter() - self._t0
        self.t["forward"] = self.t.get("forward", 0.0) + dt
        self.meter.add(dt, cpu_seconds() - self._c0)

    @contextmanager
    def active(self, patch_builder: bool, abort: bool = False):
        self.t = {}
        self.meter = ShareMeter(abort)
        self._hooks = [self.decoder.register_forward_pre_hook(self._pre),
                       self.decoder.register_forward_hook(self._post)]
        if patch_builder:
            for name in self.FUNCS:
                fn = getattr(B, name, None)
                if fn is not None:
                    self._saved[name] = fn
                    setattr(B, name, self._wrap(name, fn))
        try:
            yield self
        finally:
            for h in self._hooks:
                h.remove()
            for name, fn in self._saved.items():
                setattr(B, name, fn)
            self._saved = {}


# =========================================================================== builder


def dir_bytes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def bytes_breakdown(root: Path, n: int, n_cache: int, d: int, dtype: torch.dtype) -> dict[str, Any]:
    files = dir_bytes(root)
    total = sum(files.values())
    bpv = torch.empty((), dtype=dtype).element_size()
    cache = n * n_cache * d * bpv
    keys = n * d * 4
    cache_len = n * 4
    shards = sum(v for k, v in files.items() if k.startswith("shard-"))
    chunks = files.get(CHUNKS, 0)
    manifest = files.get(MANIFEST, 0)
    return {
        "cache_dtype": str(dtype).removeprefix("torch."),
        "total_bytes": total,
        "ideal_cache_bytes": cache,
        "ratio": total / cache,
        "cache_bytes": cache,
        "keys_bytes": keys,
        "cache_len_bytes": cache_len,
        "chunks_jsonl_bytes": chunks,
        "manifest_bytes": manifest,
        "safetensors_header_bytes": shards - cache - keys - cache_len,
        "other_files_bytes": total - shards - chunks - manifest,
        "num_shards": sum(1 for k in files if k.startswith("shard-")),
        "files": sorted(files),
    }


def ceiling_batches(plan, pad_id: int, batch_size: int, device: torch.device):
    """The builder's batches (per-shard length sort, right padding) as ready tensors."""
    out = []
    for a, b in plan.shard_bounds:
        ids_list = plan.token_ids[a:b]
        order = sorted(range(len(ids_list)), key=lambda i: -len(ids_list[i]))  # as encode_shard
        for s in range(0, len(order), batch_size):
            batch = [ids_list[i] for i in order[s : s + batch_size]]
            lengths = torch.tensor([len(t) for t in batch])
            L = int(lengths.max())
            ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
            for i, t in enumerate(batch):
                ids[i, : len(t)] = torch.as_tensor(t, dtype=torch.long)
            mask = (torch.arange(L)[None, :] < lengths[:, None]).long()
            out.append((ids.to(device), mask.to(device)))
    return out


def run_ceiling(decoder, batches, device, abort: bool = False) -> tuple[float, float]:
    """Seconds, and the CPU share of the run (process CPU s / (wall s * torch threads)).

    Besides the forwards, the loop only reads the clock and getrusage between batches (microseconds)
    to notice other load on the machine (``abort``: raise ``Contended``)."""
    meter = ShareMeter(abort)
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for ids, mask in batches:
            c1, t1 = cpu_seconds(), time.perf_counter()
            decoder(input_ids=ids, attention_mask=mask, use_cache=False)
            sync(device)
            meter.add(time.perf_counter() - t1, cpu_seconds() - c1)
    sync(device)
    wall = time.perf_counter() - t0
    meter.final_check()
    return wall, meter.share


def run_builder(examples, backbone, cfg, cache_dtype, workdir: Path, keep: bool = False):
    tmp = Path(tempfile.mkdtemp(prefix="bankbench-", dir=workdir))
    bank_cfg = dataclasses.replace(cfg.bank, dir=str(tmp / "bank"), overwrite=False)
    device = backbone.device
    sync(device)
    c0, t0 = cpu_seconds(), time.perf_counter()
    try:
        res = B.build_bank(examples, backbone, cfg.chunking, bank_cfg, cache_dtype, show_progress=False)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    sync(device)
    wall = time.perf_counter() - t0
    res.cpu_share = (cpu_seconds() - c0) / (wall * torch.get_num_threads())
    if res.status != "built":
        raise RuntimeError(f"expected a fresh build, got {res.status!r}")
    if not keep:
        shutil.rmtree(tmp, ignore_errors=True)
        return wall, res, None
    return wall, res, tmp


def bench_builder(model_name: str, args, cfg, examples, n_chunks: int, workdir: Path) -> dict[str, Any] | None:
    from elasticmem.backbone import load_backbone, named_model_config, resolve_model_path

    mcfg = named_model_config(model_name, args.device)
    if mcfg.name_or_path != "tiny":
        try:
            resolve_model_path(mcfg)
        except FileNotFoundError as e:
            log(f"[build] skipping {model_name}: {e}")
            return {"model": model_name, "skipped": str(e)}
    t0 = time.perf_counter()
    backbone = load_backbone(mcfg)
    load_s = time.perf_counter() - t0
    device = backbone.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    decoder = backbone.model.get_decoder()
    timed_dtype = B.resolve_cache_dtype("auto", device)
    bs = args.batch_size or cfg.bank.batch_size
    # The paper's bank (last-state keys, hidden-state content only), the figures on record: the
    # preset's layer-mean keys name layers a 2-layer test model lacks, and the bytes check below
    # counts hidden states only.
    cfg = dataclasses.replace(cfg, bank=dataclasses.replace(cfg.bank, batch_size=bs, key="last", kv_cache=False))
    log(f"[build] {model_name}: loaded in {load_s:.1f} s on {device}, d={backbone.hidden_size}, "
        f"{n_chunks} chunks, batch {bs}, timed cache dtype {timed_dtype}")

    plan = B.make_plan(examples, backbone.tokenizer, cfg.chunking, cfg.bank,
                       {"name_or_path": model_name, "fingerprint": "-"}, backbone.hidden_size, "float32")
    n_tokens = sum(len(t) for t in plan.token_ids)
    batches = ceiling_batches(plan, backbone.tokenizer.pad_token_id, bs, device)
    padded_tokens = sum(int(ids.numel()) for ids, _ in batches)
    timer = PhaseTimer(decoder, device)

    # warm-up (untimed for the medians; the first build also hashes the weights for the fingerprint)
    wait_quiet()
    with timer.active(patch_builder=True):
        warm_build, _, _ = run_builder(examples, backbone, cfg, timed_dtype, workdir)
    wait_quiet()
    warm_ceiling, _ = run_ceiling(decoder, batches, device)
    log(f"[build] {model_name}: warm-up builder {warm_build:.2f} s (incl. fingerprint), ceiling {warm_ceiling:.2f} s")

    builder_s, ceiling_s, phases, internal_s, cpu_b, cpu_c, fwd_share = [], [], [], [], [], [], []
    kept_bank: Path | None = None
    for r in range(args.repeats):
        keep = r == args.repeats - 1
        def one_build(abort):
            with timer.active(patch_builder=True, abort=abort):
                out = run_builder(examples, backbone, cfg, timed_dtype, workdir, keep=keep)
            try:
                timer.meter.final_check()
            except Contended:
                if out[2] is not None:
                    shutil.rmtree(out[2], ignore_errors=True)
                raise
            return out

        wall, res, kept = guarded(f"{model_name} builder", one_build)
        fwd_share.append(timer.meter.share)
        phases.append(dict(timer.t))
        builder_s.append(wall)
        internal_s.append(res.seconds)
        cpu_b.append(res.cpu_share)
        if kept is not None:
            kept_bank = kept
        c, cs = guarded(f"{model_name} ceiling", lambda abort: run_ceiling(decoder, batches, device, abort))
        ceiling_s.append(c)
        cpu_c.append(cs)
        log(f"[build] {model_name}: repeat {r + 1}/{args.repeats}: builder {wall:.2f} s "
            f"({n_chunks / wall:.1f} chunks/s, cpu {100 * res.cpu_share:.0f}%, in forwards "
            f"{100 * fwd_share[-1]:.0f}%), ceiling {c:.2f} s "
            f"({n_chunks / c:.1f} chunks/s, cpu {100 * cs:.0f}%)  load {os.getloadavg()[0]:.1f}")

    d, n_cache = backbone.hidden_size, cfg.bank.n_cache
    bytes_timed = bytes_breakdown(kept_bank / "bank", n_chunks, n_cache, d, timed_dtype)
    # sanity: the bank opens and has the expected shape
    bank = Bank.open(kept_bank / "bank", verify=True)
    assert bank.num_chunks == n_chunks and bank.hidden_size == d
    del bank
    shutil.rmtree(kept_bank, ignore_errors=True)

    other = {torch.float32: torch.float16, torch.float16: torch.float32}.get(timed_dtype, torch.float16)
    wait_quiet()
    wall_other, _, kept = run_builder(examples, backbone, cfg, other, workdir, keep=True)
    bytes_other = bytes_breakdown(kept / "bank", n_chunks, n_cache, d, other)
    shutil.rmtree(kept, ignore_errors=True)
    log(f"[build] {model_name}: {str(other).removeprefix('torch.')} build (1 run) {wall_other:.2f} s")

    bm, cm = med(builder_s), med(ceiling_s)
    phase_med = {k: med([p.get(k, 0.0) for p in phases]) for k in ["forward", *PhaseTimer.FUNCS]}
    # time inside encode_shard that is not the decoder forward (batch assembly, gather, cast, copies)
    phase_med["encode_shard_minus_forward"] = med(
        [p.get("encode_shard", 0.0) - p.get("forward", 0.0) for p in phases])
    phase_med["unaccounted"] = med(
        [w - sum(p.get(k, 0.0) for k in PhaseTimer.FUNCS) for w, p in zip(builder_s, phases)])
    by_dtype = {bytes_timed["cache_dtype"]: bytes_timed, bytes_other["cache_dtype"]: bytes_other}
    result = {
        "model": model_name,
        "device": str(device),
        "model_dtype": str(next(backbone.model.parameters()).dtype).removeprefix("torch."),
        "hidden_size": d,
        "n_cache": n_cache,
        "batch_size": bs,
        "num_chunks": n_chunks,
        "num_tokens": n_tokens,
        "padded_tokens": padded_tokens,
        "num_batches": len(batches),
        "load_s": load_s,
        "warmup_builder_s": warm_build,
        "warmup_ceiling_s": warm_ceiling,
        "timed_cache_dtype": str(timed_dtype).removeprefix("torch."),
        "builder_s": builder_s,
        "builder_internal_s": internal_s,
        "ceiling_s": ceiling_s,
        "builder_cpu_share": cpu_b,
        "builder_forward_cpu_share": fwd_share,
        "ceiling_cpu_share": cpu_c,
        "builder_median_s": bm,
        "ceiling_median_s": cm,
        "builder_chunks_per_s": n_chunks / bm,
        "ceiling_chunks_per_s": n_chunks / cm,
        "ratio_builder_over_ceiling": cm / bm,
        "builder_best_s": min(builder_s),
        "ceiling_best_s": min(ceiling_s),
        "ratio_best_over_best": min(ceiling_s) / min(builder_s),
        # share of each builder run's wall time spent in decoder forwards (same run, so host noise
        # that slows everything cancels): an upper bound on builder/ceiling if forwards ran at ceiling speed
        "forward_share_median": med([p.get("forward", 0.0) / w for p, w in zip(phases, builder_s)]),
        "phases_median_s": phase_med,
        "other_dtype_build_s": wall_other,
        "other_dtype": str(other).removeprefix("torch."),
        "bytes": by_dtype,
        "peak_gpu_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }
    del backbone, decoder, batches
    gc.collect()
    return result


# =========================================================================== search


def write_key_bank(root: Path, n: int, d: int, shard_rows: int, seed: int,
                   rows_fn: Callable[[int, int], torch.Tensor] | None = None, label: str = "random") -> float:
    """A real bank folder of n normalised keys (dummy 1-slot float16 cache): ``rows_fn(start, rows)``
    gives rows [start, start + rows) [rows, d]; default independent Gaussians (seeded)."""
    t0 = time.perf_counter()
    (root / B.BUILD_DIR).mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    plan_id = f"bench-{label}-keys-{n}-{d}-{seed}"
    shards = []
    for i, a in enumerate(range(0, n, shard_rows)):
        rows = min(shard_rows, n - a)
        raw = rows_fn(a, rows) if rows_fn is not None else torch.randn(rows, d, generator=gen)
        keys = torch.nn.functional.normalize(raw.float(), dim=-1)
        tensors = {"keys": keys, "cache": torch.zeros(rows, 1, d, dtype=torch.float16),
                   "cache_len": torch.ones(rows, dtype=torch.int32)}
        shards.append(B._write_shard(root, i, tensors, plan_id))
    manifest = {"format_version": 1, "encoder": {"name_or_path": label, "fingerprint": "none"},
                "hidden_size": d, "n_cache": 1, "cache_dtype": "float16", "num_chunks": n,
                "tokenization": {}, "shards": shards, "groups": {"all": [0, n]},
                "build": {"plan_id": plan_id}}
    (root / MANIFEST).write_text(json.dumps(manifest))
    shutil.rmtree(root / B.BUILD_DIR)
    return time.perf_counter() - t0


class RealKeys:
    """Keys with the structure of real ones, grown from a built bank's keys (``--keys real``).

    Rows [0, m) are the m real keys of ``--real-bank`` (the frozen encoder's final-layer state of
    each chunk's last token, L2-normalised); every further row is
    ``normalise((1 - lam) k_a + lam k_b + sigma * e)`` for real keys a, b drawn uniformly,
    lam ~ U(0, 0.5) and e ~ N(0, Sigma), Sigma the real keys' covariance (through their SVD), so
    the grown keys share the real ones' mean direction, spectrum and neighbourhoods: they fill
    the segments between real chunks rather than a sphere. Queries (``real``): the same model's
    query states (``memory.retrieval=frozen``: last prompt token, adapter off) of the questions
    in ``--real-data``, drawn without replacement."""

    def __init__(self, keys: torch.Tensor, sigma: float, seed: int):
        self.real = torch.nn.functional.normalize(keys.float(), dim=-1)
        self.sigma, self.seed = sigma, seed
        centred = self.real - self.real.mean(0)
        _, S, Vh = torch.linalg.svd(centred, full_matrices=False)
        self.basis = (S[:, None] / max(1, self.real.shape[0] - 1) ** 0.5) * Vh  # [r, d]: e = z @ basis

    def rows(self, start: int, rows: int) -> torch.Tensor:
        """Rows [start, start + rows) of the grown bank [rows, d] (the same rows for the same seed)."""
        m = self.real.shape[0]
        out = torch.empty(rows, self.real.shape[1])
        n_real = max(0, min(rows, m - start))
        if n_real:
            out[:n_real] = self.real[start : start + n_real]
        k = rows - n_real
        if k:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + start)
            a = torch.randint(0, m, (k,), generator=gen)
            b = torch.randint(0, m, (k,), generator=gen)
            lam = 0.5 * torch.rand(k, 1, generator=gen)
            e = torch.randn(k, self.basis.shape[0], generator=gen) @ self.basis
            out[n_real:] = (1 - lam) * self.real[a] + lam * self.real[b] + self.sigma * e
        return torch.nn.functional.normalize(out, dim=-1)


def key_structure(keys: torch.Tensor, seed: int, sample: int = 4000) -> dict[str, float]:
    """How anisotropic and clustered normalised keys [n, d] are (on at most ``sample`` rows):
    cosine to the mean direction, mean cosine of random pairs, nearest-neighbour cosine (within
    the sample) and the participation ratio of the covariance spectrum (effective dimensions)."""
    gen = torch.Generator().manual_seed(seed)
    x = keys[torch.randperm(keys.shape[0], generator=gen)[:sample]].float()
    mu = torch.nn.functional.normalize(x.mean(0), dim=0)
    sims = x @ x.T
    n = x.shape[0]
    off = sims[~torch.eye(n, dtype=torch.bool)]
    nn_sim = sims.fill_diagonal_(-2.0).max(1).values
    ev = torch.linalg.eigvalsh(torch.cov(x.T)).clamp_min(0)
    return {"rows": n, "cos_to_mean_dir": float((x @ mu).mean()), "pair_cos_mean": float(off.mean()),
            "pair_cos_std": float(off.std()), "nn_cos_mean": float(nn_sim.mean()),
            "participation_ratio": float(ev.sum() ** 2 / (ev**2).sum())}


def real_queries(bank_dir: str, data_dir: str, nq: int, seed: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """Frozen query states [nq, d] of questions in ``data_dir`` (every split), from the model that
    built ``bank_dir`` (its manifest's encoder, loaded on the CPU in float32)."""
    from elasticmem.backbone import load_backbone
    from elasticmem.data.schema import load_split
    from elasticmem.model.elasticmem import ElasticMem

    bank = Bank.open(bank_dir)
    name = bank.manifest["encoder"]["name_or_path"]
    backbone = load_backbone(BackboneConfig(name_or_path=name, device="cpu"))
    bank = Bank.open(bank_dir, expect_fingerprint=backbone.fingerprint)
    examples = [ex for split in ("train", "val", "test") if (Path(data_dir) / f"{split}.jsonl").is_file()
                for ex in load_split(data_dir, split)]
    if not examples:
        raise SystemExit(f"--real-data {data_dir}: no train/val/test.jsonl with questions")
    gen = torch.Generator().manual_seed(seed + 2)
    pick = [examples[int(i)] for i in torch.randperm(len(examples), generator=gen)[:nq]]
    model = ElasticMem(backbone, MemoryConfig(retrieval="frozen"), bank).eval()
    t0 = time.perf_counter()
    h = torch.cat([model.query_states(pick[i : i + 16]).float().cpu() for i in range(0, len(pick), 16)])
    log(f"[search] {len(pick)} real query states ({name}, frozen) of {len(examples)} questions in "
        f"{time.perf_counter() - t0:.1f} s")
    return h, {"encoder": name, "questions": len(examples), "queries": len(pick)}


def make_queries(bank: Bank, nq: int, d: int, noise: float, seed: int, first: dict[str, torch.Tensor] | None = None):
    """Query sets: ``first`` (e.g. real query states) or independent Gaussians (``gauss``), then
    ``noisy``: a stored key plus noise of norm ~``noise``."""
    gen = torch.Generator().manual_seed(seed + 1)
    gauss = torch.nn.functional.normalize(torch.randn(nq, d, generator=gen), dim=-1)
    src = torch.randint(0, bank.num_chunks, (nq,), generator=gen)
    base = torch.stack([bank.keys(int(r), int(r) + 1)[0] for r in src])
    noisy = torch.nn.functional.normalize(base + noise * torch.randn(nq, d, generator=gen) / d ** 0.5, dim=-1)
    return {**(first or {"gauss": gauss}), "noisy": noisy}, src


def recall(approx: torch.Tensor, exact: torch.Tensor) -> float:
    k = exact.shape[1]
    hits = 0
    for a, e in zip(approx.tolist(), exact.tolist()):
        hits += len(set(a) & set(e))
    return hits / (k * exact.shape[0])


def self_hit(rows: torch.Tensor, src: torch.Tensor) -> float:
    return float((rows == src[:, None]).any(dim=1).float().mean())


class RamTorch:
    """Reference only (not project code): TorchIndex's matmul+topk on keys concatenated once."""

    def __init__(self, bank: Bank):
        keys = bank.keys()  # one shard: a memory-mapped view (copied here); several: already a fresh copy
        self.keys = keys.clone() if len(bank.shards) == 1 else keys.contiguous()

    def search(self, q, k):
        q = torch.nn.functional.normalize(q.float(), dim=-1)
        s, r = torch.topk(q @ self.keys.T, k, dim=-1)
        return s, r


def time_search(index, queries: torch.Tensor, k: int, repeats: int):
    """One warm-up call (timed apart as ``first``), then ``repeats`` timed calls; a timed call
    whose CPU share shows other load is thrown away and run again (see ``guarded``)."""
    wait_quiet()
    t0 = time.perf_counter()
    out = index.search(queries, k)
    first = time.perf_counter() - t0
    times, shares = [], []

    def one(abort):
        c0, t0 = cpu_seconds(), time.perf_counter()
        res = index.search(queries, k)
        dt = time.perf_counter() - t0
        share = (cpu_seconds() - c0) / (dt * torch.get_num_threads())
        if abort and share < GUARD["min_share"]:
            raise Contended(f"cpu share {100 * share:.0f}% in a {dt * 1000:.0f} ms search call")
        return res, dt, share

    for _ in range(repeats):
        out, dt, share = guarded("search", one)
        times.append(dt)
        shares.append(share)
    rows = out.rows if hasattr(out, "rows") else out[1]
    return rows, first, times, med(shares)


def bench_search(n: int, args, workdir: Path, real: tuple[RealKeys, torch.Tensor] | None = None
                 ) -> list[dict[str, Any]]:
    """Every index at bank size ``n``: Gaussian keys, or (``real``) grown real keys and real queries."""
    d, k, nq = args.dim, args.k, args.num_queries
    tmp = Path(tempfile.mkdtemp(prefix=f"bankbench-keys{n}-", dir=workdir))
    root = tmp / "bank"
    rows_out: list[dict[str, Any]] = []
    try:
        if real is not None:
            if n < real[0].real.shape[0]:
                raise SystemExit(f"--sizes {n} is smaller than the {real[0].real.shape[0]} real keys")
            write_s = write_key_bank(root, n, d, args.shard_rows, args.seed, real[0].rows, label="real-grown")
        else:
            write_s = write_key_bank(root, n, d, args.shard_rows, args.seed)
        disk = sum(dir_bytes(root).values())
        log(f"[search] n={n}: wrote bank ({disk / 1e9:.2f} GB on disk, {-(-n // args.shard_rows)} shards "
            f"of {args.shard_rows} rows, keys {n * d * 4 / 1e9:.2f} GB) in {write_s:.1f} s")
        t0 = time.perf_counter()
        bank = Bank.open(root)
        open_s = time.perf_counter() - t0
        queries, src = make_queries(bank, nq, d, args.noise, args.seed,
                                    None if real is None else {"real": real[1]})
        lead = next(iter(queries))  # the query set the log line's CPU share is from
        exact: dict[str, torch.Tensor] = {}
        base_ms: dict[str, float] = {}

        def record(name, params, build_s, index, note="", build_share=None):
            row = {"size": n, "index": name, "params": params, "build_s": build_s, "note": note,
                   "build_cpu_share": build_share}
            for qs, q in queries.items():
                rows, first, times, share = time_search(index, q, k, args.search_repeats)
                row[f"{qs}_cpu_share"] = share
                ms = med(times) * 1000 * 1000 / nq  # ms per 1000 queries
                if name == "torch":
                    exact[qs], base_ms[qs] = rows.clone(), ms
                row[f"{qs}_ms_per_1000q"] = ms
                row[f"{qs}_first_call_ms"] = first * 1000
                row[f"{qs}_runs_ms"] = [t * 1000 for t in times]
                row[f"{qs}_ratio_to_torch"] = ms / base_ms[qs]
                row[f"{qs}_recall@{k}"] = recall(rows, exact[qs])
                if qs == "noisy":
                    row[f"noisy_self@{k}"] = self_hit(rows, src)
            rows_out.append(row)
            log(f"[search] n={n} {name:9s} {json.dumps(params):24s} build {build_s:7.2f} s | "
                + " | ".join(f"{qs} {row[f'{qs}_ms_per_1000q']:9.1f} ms/1000q x{row[f'{qs}_ratio_to_torch']:.3f} "
                             f"R@{k} {row[f'{qs}_recall@{k}']:.3f}" for qs in queries)
                + f" | self@{k} {row[f'noisy_self@{k}']:.3f} | cpu {100 * row[f'{lead}_cpu_share']:.0f}% "
                f"load {os.getloadavg()[0]:.1f}")

        # torch exact: the baseline (keys memory-mapped; gathered from the shards at every call)
        t0 = time.perf_counter()
        idx = build_index(bank, IndexConfig(type="torch", save=False), args.seed)
        record("torch", {}, time.perf_counter() - t0, idx, note=f"bank open {open_s * 1000:.0f} ms")
        del idx
        gc.collect()

        if not args.skip_ram_reference:
            t0 = time.perf_counter()
            idx = RamTorch(bank)
            record("torch-ram", {}, time.perf_counter() - t0, idx, note="reference, not project code")
            del idx
            gc.collect()

        for typ, pname, values, cap in (("flat", None, [None], 0),
                                        ("ivf", "nprobe", args.nprobe, args.ivf_max_size),
                                        ("hnsw", "ef_search", args.ef_search, args.hnsw_max_size)):
            if typ in args.skip_index:
                continue
            if cap and n > cap:
                log(f"[search] n={n}: skipping {typ} (n > --{typ}-max-size {cap})")
                rows_out.append({"size": n, "index": typ, "skipped": f"n > --{typ}-max-size {cap}"})
                continue
            cfg = IndexConfig(type=typ, save=False, nlist=args.nlist, hnsw_m=args.hnsw_m,
                              ef_construction=args.ef_construction)
            wait_quiet()
            c0, t0 = cpu_seconds(), time.perf_counter()
            idx = build_index(bank, cfg, args.seed)
            build_s = time.perf_counter() - t0
            build_share = (cpu_seconds() - c0) / (build_s * torch.get_num_threads())
            log(f"[search] n={n}: {typ} index built in {build_s:.1f} s (cpu share {100 * build_share:.0f}%, "
                f"one measurement)")
            build_params = {}
            if typ == "ivf":
                build_params = {"nlist": idx.index.nlist, "train_size": min(n, cfg.train_size)}
            elif typ == "hnsw":
                build_params = {"m": cfg.hnsw_m, "ef_construction": cfg.ef_construction}
            for v in values:
                if pname is not None:
                    idx.cfg = dataclasses.replace(cfg, **{pname: v})  # query-time knob, same built index
                record(typ, {**build_params, **({pname: v} if pname else {})}, build_s, idx,
                       note="build time is one build shared by the rows of this index", build_share=build_share)
            del idx
            gc.collect()
        del bank
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows_out


# =========================================================================== report


def fmt_bytes(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(b) < 1000 or unit == "GB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{int(b)} B"
        b /= 1000
    return str(b)


def summary_text(report: dict[str, Any], k: int) -> str:
    lines = []
    env = report["env"]
    lines.append("=" * 100)
    lines.append(f"bank benchmark  torch {env['torch']}  threads {env['torch_threads']}  faiss {env.get('faiss')}  "
                 f"{env['cpu']}  ({env['time']})")
    builds = [b for b in report.get("builder", []) if not b.get("skipped")]
    for b in report.get("builder", []):
        if b.get("skipped"):
            lines.append(f"builder: {b['model']} skipped: {b['skipped']}")
    if builds:
        lines.append("")
        lines.append("BUILDER vs CEILING (median of interleaved repeats; goal ratio >= 0.9)")
        hdr = (f"{'model':8s} {'device':6s} {'chunks':>6s} {'tokens':>7s} {'batch':>5s} {'builder s':>9s} "
               f"{'chunks/s':>9s} {'ceiling s':>9s} {'chunks/s':>9s} {'ratio':>6s} {'best':>6s} {'fwd%':>6s}  "
               f"runs builder / ceiling (s)")
        lines.append(hdr)
        for b in builds:
            lines.append(
                f"{b['model']:8s} {b['device']:6s} {b['num_chunks']:6d} {b['num_tokens']:7d} {b['batch_size']:5d} "
                f"{b['builder_median_s']:9.3f} {b['builder_chunks_per_s']:9.1f} {b['ceiling_median_s']:9.3f} "
                f"{b['ceiling_chunks_per_s']:9.1f} {b['ratio_builder_over_ceiling']:6.3f} "
                f"{b['ratio_best_over_best']:6.3f} {100 * b['forward_share_median']:5.1f}%  "
                f"{' '.join(f'{x:.2f}' for x in b['builder_s'])} / {' '.join(f'{x:.2f}' for x in b['ceiling_s'])}")
            lines.append(f"{'':8s} cpu share per run (process CPU s / (wall s * {report['env']['torch_threads']} threads); "
                         f"well below 100% = other load on the machine): builder "
                         f"{' '.join(f'{100 * x:.0f}%' for x in b['builder_cpu_share'])} (in its forwards "
                         f"{' '.join(f'{100 * x:.0f}%' for x in b['builder_forward_cpu_share'])}) / ceiling "
                         f"{' '.join(f'{100 * x:.0f}%' for x in b['ceiling_cpu_share'])}")
        lines.append(f"{'':8s} (ratio = builder chunks/s / ceiling chunks/s from medians; best = from the fastest run "
                     f"of each; fwd% = share of a builder run spent in decoder forwards, median)")
        lines.append("")
        lines.append("builder phases (median s per build; forward = decoder forwards inside the builder)")
        keys = ["make_plan", "_prepare_dir", "_write_chunks", "forward", "encode_shard_minus_forward",
                "_write_shard", "unaccounted"]
        lines.append(f"{'model':8s} " + " ".join(f"{k:>14s}" for k in
                     ["plan+tokenize", "prepare_dir", "chunks.jsonl", "forward", "encode-other", "write_shard",
                      "rest"]))
        for b in builds:
            p = b["phases_median_s"]
            lines.append(f"{b['model']:8s} " + " ".join(f"{p.get(k, 0.0):14.3f}" for k in keys))
        lines.append(f"{'':8s} (warm-up builder incl. fingerprint: "
                     + ", ".join(f"{b['model']} {b['warmup_builder_s']:.2f} s" for b in builds)
                     + "; other-dtype single build: "
                     + ", ".join(f"{b['model']} {b['other_dtype']} {b['other_dtype_build_s']:.2f} s" for b in builds)
                     + ")")
        lines.append("")
        lines.append("BANK BYTES: total on disk / (num_chunks * n_cache * d * bytes per cache value); goal <= 1.02")
        lines.append(f"{'model':8s} {'dtype':8s} {'total':>10s} {'ideal cache':>11s} {'ratio':>6s} | "
                     f"{'cache':>10s} {'keys':>10s} {'cache_len':>9s} {'chunks.jsonl':>12s} {'manifest':>9s} "
                     f"{'st headers':>10s} {'other':>6s} {'shards':>6s}")
        for b in builds:
            for dt in ("float32", "float16"):
                x = b["bytes"].get(dt)
                if not x:
                    continue
                lines.append(
                    f"{b['model']:8s} {dt:8s} {fmt_bytes(x['total_bytes']):>10s} {fmt_bytes(x['ideal_cache_bytes']):>11s} "
                    f"{x['ratio']:6.3f} | {fmt_bytes(x['cache_bytes']):>10s} {fmt_bytes(x['keys_bytes']):>10s} "
                    f"{fmt_bytes(x['cache_len_bytes']):>9s} {fmt_bytes(x['chunks_jsonl_bytes']):>12s} "
                    f"{fmt_bytes(x['manifest_bytes']):>9s} {fmt_bytes(x['safetensors_header_bytes']):>10s} "
                    f"{fmt_bytes(x['other_files_bytes']):>6s} {x['num_shards']:6d}")
        lines.append(f"{'':8s} (keys alone are 1/n_cache of the float32 cache and 2/n_cache of a float16 one)")
    search = report.get("search", [])
    if search:
        s0 = report["search_settings"]
        qs = s0.get("first_query_set", "gauss")
        if s0.get("keys") == "real":
            rk = report["real_keys"]
            keys_text = (f"keys grown from {rk['real_rows']} real keys of {rk['bank']} (sigma {rk['sigma']}; "
                         f"see RealKeys), real = {rk['queries']['queries']} frozen query states of "
                         f"{rk['queries']['encoder']}")
        else:
            keys_text = f"keys L2-normalised Gaussian (seed {s0['seed']}), gauss = random queries"
        lines.append(f"SEARCH: {s0['num_queries']} queries per call, top-{k}, d={s0['dim']}, {keys_text}, "
                     f"bank shards of {s0['shard_rows']} rows, dummy 1-slot fp16 cache; "
                     f"ms per 1000 queries = median of {s0['search_repeats']} calls after 1 warm-up; "
                     f"ratio = ms / torch ms; R@{k} vs torch exact; "
                     f"noisy = stored key + noise of norm {s0['noise']}; self@{k} = source key found")
        lines.append(f"{'size':>8s} {'index':9s} {'params':42s} {'build s':>8s} | {qs + ' ms':>9s} {'ratio':>6s} "
                     f"{'R@k':>6s} | {'noisy ms':>9s} {'ratio':>6s} {'R@k':>6s} {'self@k':>6s} | {'cpu':>4s}")
        for r in search:
            if r.get("skipped"):
                lines.append(f"{r['size']:8d} {r['index']:9s} skipped: {r['skipped']}")
                continue
            params = ",".join(f"{a}={v}" for a, v in r["params"].items()) or "-"
            lines.append(
                f"{r['size']:8d} {r['index']:9s} {params:42s} {r['build_s']:8.2f} | "
                f"{r[f'{qs}_ms_per_1000q']:9.1f} {r[f'{qs}_ratio_to_torch']:6.3f} {r[f'{qs}_recall@{k}']:6.3f} | "
                f"{r['noisy_ms_per_1000q']:9.1f} {r['noisy_ratio_to_torch']:6.3f} {r[f'noisy_recall@{k}']:6.3f} "
                f"{r[f'noisy_self@{k}']:6.3f} | {100 * r[f'{qs}_cpu_share']:3.0f}%")
        lines.append(f"{'':8s} (cpu = process CPU share during the timed {qs} calls; "
                     f"well below 100% = other load on the machine)")
        if s0.get("keys") == "real":
            st = report["real_keys"]["structure"]
            lines.append(f"{'':8s} key structure (cos to mean direction / pair cos mean / nearest-neighbour cos in "
                         f"{st['real']['rows']} rows / participation ratio): "
                         + "; ".join(f"{name} {x['cos_to_mean_dir']:.3f} / {x['pair_cos_mean']:.3f} / "
                                     f"{x['nn_cos_mean']:.3f} / {x['participation_ratio']:.1f}"
                                     for name, x in st.items()))
        lines.append(f"{'':8s} (torch-ram: reference only, TorchIndex's matmul+topk on keys held contiguous in RAM; "
                     f"build s = the one-time concatenation)")
    q = report.get("quiet_wait")
    if q:
        lines.append(f"waited {q['total_waited_s']:.0f} s in total for idle CPUs before timed runs "
                     f"(up to {q['max_wait_s_per_run']:.0f} s each); {q['runs_measured_while_busy']} run(s) "
                     f"started while the machine was busy anyway; {q['runs_thrown_away']} timed run(s) thrown "
                     f"away and rerun because their CPU share fell below {100 * q['min_cpu_share']:.0f}%")
    lines.append("=" * 100)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["tiny", "smollm2"],
                   help="backbones to build with (backbone.name_or_path values, or e.g. qwen2.5-3b-random)")
    p.add_argument("--device", default="auto", help="backbone.device of the builder section (auto: CUDA if present)")
    p.add_argument("--config", default=str(REPO / "configs" / "quickstart.yaml"),
                   help="preset giving data.synthetic, chunking and bank settings")
    p.add_argument("--max-chunks", type=int, default=0, help="cap the corpus (whole histories; 0 = all)")
    p.add_argument("--batch-size", type=int, default=0, help="override bank.batch_size (0 = from the config)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved builder/ceiling repeats after a warm-up")
    p.add_argument("--skip-build", action="store_true")
    p.add_argument("--skip-search", action="store_true")
    p.add_argument("--sizes", nargs="+", type=int, default=[100_000, 1_000_000], help="numbers of keys")
    p.add_argument("--dim", type=int, default=576, help="key width (SmolLM2-135M hidden size)")
    p.add_argument("--num-queries", type=int, default=1000)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--noise", type=float, default=0.5, help="noise norm of the 'noisy' query set")
    p.add_argument("--keys", choices=["gauss", "real"], default="gauss",
                   help="search keys: Gaussian, or grown from --real-bank's keys with --real-data's questions")
    p.add_argument("--real-bank", default=None, help="a bank built by build_bank.py (--keys real)")
    p.add_argument("--real-data", default=None, help="its prepared data folder: the real queries (--keys real)")
    p.add_argument("--real-sigma", type=float, default=0.5,
                   help="scale of the covariance-shaped noise added to grown keys (--keys real)")
    p.add_argument("--nprobe", nargs="+", type=int, default=[16, 64], help="IVF nprobe values (16 = config default)")
    p.add_argument("--ef-search", nargs="+", type=int, default=[128, 512],
                   help="HNSW ef_search values (128 = config default)")
    p.add_argument("--nlist", type=int, default=IndexConfig.nlist, help="IVF cells (0 = 4*sqrt(n), the default)")
    p.add_argument("--hnsw-m", type=int, default=IndexConfig.hnsw_m, help="HNSW graph degree")
    p.add_argument("--ef-construction", type=int, default=IndexConfig.ef_construction, help="HNSW build beam")
    p.add_argument("--hnsw-max-size", type=int, default=0, help="skip HNSW above this many keys (0 = no cap)")
    p.add_argument("--ivf-max-size", type=int, default=0, help="skip IVF above this many keys (0 = no cap)")
    p.add_argument("--skip-index", nargs="*", default=[], choices=["flat", "ivf", "hnsw"])
    p.add_argument("--skip-ram-reference", action="store_true", help="do not run the torch-ram reference row")
    p.add_argument("--search-repeats", type=int, default=3)
    p.add_argument("--shard-rows", type=int, default=0, help="rows per shard of the key banks (0 = bank.shard_rows)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet-wait", type=float, default=120.0,
                   help="before each timed run wait up to this many seconds for the CPUs to be idle "
                        "(others' load distorts timings on shared machines); 0 = do not wait")
    p.add_argument("--min-cpu-share", type=float, default=0.8,
                   help="a timed run whose compute threads get less than this share of their CPUs "
                        "(other load) is thrown away and rerun; 0 = keep every run")
    p.add_argument("--max-retries", type=int, default=4, help="reruns of a contended timed run")
    p.add_argument("--quiet-threshold", type=float, default=0.25,
                   help="'idle' = at most this share of all CPU time busy over 0.5 s")
    p.add_argument("--workdir", default=None, help="where temp banks go (default: the system temp dir)")
    p.add_argument("--out", default=None, help="also write the summary as JSON here")
    args = p.parse_args(argv)

    QUIET["max_wait_s"], QUIET["threshold"] = args.quiet_wait, args.quiet_threshold
    GUARD["min_share"], GUARD["max_retries"] = args.min_cpu_share, args.max_retries
    from elasticmem.backbone import resolve_device

    if not args.skip_build and resolve_device(args.device).type == "cuda":
        GUARD["min_share"], QUIET["max_wait_s"] = 0.0, 0.0
        log("[build] CUDA: the CPU-share guard and the idle wait are off (GPU-bound runs have a low CPU share)")
    workdir = Path(args.workdir or tempfile.gettempdir())
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        import faiss
        faiss_version = faiss.__version__
    except ImportError:
        faiss_version = None
    cpu = cpu_name()
    report: dict[str, Any] = {"env": {
        "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "faiss": faiss_version,
        "cpu": f"{cpu} x{os.cpu_count()}", "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:] if argv is None else argv,
    }}
    t_start = time.perf_counter()

    def save_partial():
        if args.out:
            write_json(args.out, {**report, "partial": True}, __file__, argv)

    if not args.skip_build:
        cfg, examples, n_chunks, n_groups = load_corpus(args.config, args.max_chunks)
        log(f"[build] corpus: {args.config} synthetic {cfg.data.synthetic.variant}, splits {list(examples)}, "
            f"{n_groups} histories, {n_chunks} chunks")
        report["corpus"] = {"config": args.config, "num_groups": n_groups, "num_chunks": n_chunks,
                            "max_chunks": args.max_chunks}
        report["builder"] = []
        for m in args.models:
            r = bench_builder(m, args, cfg, examples, n_chunks, workdir)
            report["builder"].append(r)
            save_partial()

    if not args.skip_search:
        from elasticmem.config import BankConfig

        args.shard_rows = args.shard_rows or BankConfig().shard_rows
        if faiss_version is None:
            args.skip_index = ["flat", "ivf", "hnsw"]
            log("[search] faiss is not installed: only the torch index is measured")
        real = None
        if args.keys == "real":
            if not (args.real_bank and args.real_data):
                raise SystemExit("--keys real needs --real-bank DIR and --real-data DIR")
            grown = RealKeys(Bank.open(args.real_bank).keys(), args.real_sigma, args.seed)
            args.dim = grown.real.shape[1]
            queries, qinfo = real_queries(args.real_bank, args.real_data, args.num_queries, args.seed)
            args.num_queries = queries.shape[0]
            real = (grown, queries)
            sample = grown.rows(grown.real.shape[0], 4000)
            report["real_keys"] = {
                "bank": args.real_bank, "data": args.real_data, "real_rows": grown.real.shape[0],
                "sigma": args.real_sigma, "queries": qinfo,
                "structure": {"real": key_structure(grown.real, args.seed), "grown": key_structure(sample, args.seed),
                              "queries": key_structure(torch.nn.functional.normalize(queries, dim=-1), args.seed)},
            }
            for name, x in report["real_keys"]["structure"].items():
                log(f"[search] {name} keys: " + ", ".join(f"{a} {v:.3f}" for a, v in x.items()))
        report["search_settings"] = {k: getattr(args, k) for k in
                                     ("keys", "dim", "num_queries", "k", "noise", "nlist", "nprobe", "ef_search",
                                      "hnsw_m", "ef_construction", "hnsw_max_size", "ivf_max_size",
                                      "search_repeats", "shard_rows", "seed")}
        report["search_settings"]["first_query_set"] = "real" if real else "gauss"
        report["search"] = []
        for n in args.sizes:
            report["search"].extend(bench_search(n, args, workdir, real))
            save_partial()

    report["total_s"] = time.perf_counter() - t_start
    report["quiet_wait"] = {"max_wait_s_per_run": QUIET["max_wait_s"], "threshold": QUIET["threshold"],
                            "total_waited_s": QUIET["waited_s"], "runs_measured_while_busy": QUIET["gave_up"],
                            "min_cpu_share": GUARD["min_share"], "runs_thrown_away": GUARD["aborted"]}
    text = summary_text(report, args.k)
    report["summary_text"] = text
    print(text)
    print(f"total {report['total_s']:.0f} s")
    if args.out:
        write_json(args.out, report, __file__, argv)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
