"""Start-up benchmark: the backbone fingerprint hashed from every weight vs taken from the cache.

    OMP_NUM_THREADS=1 python benchmarks/startup_fingerprint.py                  # 0.5B and 7B shapes (~5 min)
    OMP_NUM_THREADS=1 python benchmarks/startup_fingerprint.py --shapes 0.5b    # real load path only (~2 min)
    OMP_NUM_THREADS=1 python benchmarks/startup_fingerprint.py --shapes 7b --repeats 1 --out /tmp/fp.json

Every process of a launch reads ``Backbone.fingerprint`` at start (bank check,
checkpoints). Computed, it is ``model_fingerprint``: sha256 over the config,
every base weight as float32 and the tokenizer (a 7B model: ~30 GB of float32
bytes per rank). Cached (``elasticmem.backbone.weights_identity`` +
``read_cached_fingerprint``), it is a stat of each file of the model folder,
the safetensors headers and one small JSON file. This script measures both,
in this process, and prints the ratio cached / computed next to the seconds.

Method and results: benchmarks/README.md, section ``startup_fingerprint.py``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench.py, also when loaded by path
from _bench import cpu_name, log, med, write_json  # noqa: E402

import torch  # noqa: E402

import elasticmem.backbone as bbmod  # noqa: E402
from elasticmem.backbone import fingerprint as fpmod, load as loadmod  # noqa: E402  (their private helpers)
from elasticmem.config import BackboneConfig  # noqa: E402

SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, intermediate_size=4864, vocab_size=151936,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944, vocab_size=152064,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
}
SHARD_BYTES = 4 << 30
READ_BYTES = 32 << 20


def timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """(result, wall s, CPU share = process CPU s / wall s)."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t0
    return out, wall, (time.process_time() - c0) / max(wall, 1e-9)


# =========================================================================== model folders


def qwen2_config(shape: str):
    from transformers import Qwen2Config

    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      bos_token_id=151643, eos_token_id=151643)
    cfg.architectures = ["Qwen2ForCausalLM"]  # as in the released config.json (save_pretrained sets it too)
    return cfg


def parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    """The parameters save_pretrained writes (tied lm_head left out), from a meta-device model."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def tokenizer_source():
    """SmolLM2's tokenizer (a real BPE) when cached, else the tiny one: (tokenizer, name)."""
    d = bbmod.models_home() / bbmod.ALIASES["smollm2"]["dirname"]
    if (d / "tokenizer.json").is_file():
        return loadmod._tokenizer_class(str(d)).from_pretrained(str(d)), "smollm2 BPE"
    return bbmod.build_tiny_tokenizer(), "tiny word-piece"


def write_folder(folder: Path, shape: str, tokenizer, dense: bool, seed: int = 0) -> dict[str, Any]:
    """A Qwen2 folder of ``shape``: config, tokenizer, bf16 safetensors (random values or sparse zeros)."""
    folder.mkdir(parents=True)
    config = qwen2_config(shape)
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    shapes = parameter_shapes(config)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shp in shapes.items():
        nbytes = 2 * _numel(shp)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    gen = torch.Generator().manual_seed(seed)
    weight_map = {}
    total = 0
    for i, names in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        for n in names:
            nbytes = 2 * _numel(shapes[n])
            header[n] = {"dtype": "BF16", "shape": list(shapes[n]), "data_offsets": [off, off + nbytes]}
            off += nbytes
            weight_map[n] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(folder / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            if dense:
                for n in names:
                    t = (torch.randn(shapes[n], generator=gen) * 0.02).to(torch.bfloat16)
                    f.write(t.view(torch.int16).numpy().tobytes())
                    del t
            else:
                f.truncate(8 + len(raw) + off)  # a hole: reads as zeros, takes no disk
        total += off
    if len(shards) > 1:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return {"parameters": sum(_numel(s) for s in shapes.values()), "weight_bytes": total,
            "shards": len(shards), "dense": dense}


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# =========================================================================== the two ways to the fingerprint


def _safetensors_index(folder: Path) -> dict[str, tuple[Path, int, int, tuple[int, ...], str]]:
    """name -> (file, absolute byte offset, nbytes, shape, dtype) over every shard."""
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for name, v in header.items():
            if name == "__metadata__":
                continue
            b, e = v["data_offsets"]
            out[name] = (path, 8 + n + b, e - b, tuple(v["shape"]), v["dtype"])
    return out


def streamed_fingerprint(folder: Path) -> str:
    """The bytes model_fingerprint hashes, with the weights streamed from the files (bf16 only)."""
    from transformers import AutoConfig

    h = hashlib.sha256()
    fpmod._hash_config(h, AutoConfig.from_pretrained(folder))
    index = _safetensors_index(folder)
    buf = bytearray(READ_BYTES)
    for name in sorted(index):
        path, start, nbytes, shape, dtype = index[name]
        assert dtype == "BF16", dtype
        h.update(f"{name}:{shape};".encode())
        with open(path, "rb", buffering=0) as f:
            f.seek(start)
            left = nbytes
            while left:
                view = memoryview(buf)[: min(left, READ_BYTES)]
                got = f.readinto(view)
                assert got == len(view), (path, got)
                chunk = torch.frombuffer(view, dtype=torch.bfloat16)
                h.update(chunk.to("cpu", torch.float32).numpy().tobytes())
                left -= got
            os.posix_fadvise(f.fileno(), start, nbytes, os.POSIX_FADV_DONTNEED)
    tokenizer = loadmod._tokenizer_class(str(folder)).from_pretrained(str(folder))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # as load_backbone does
    fpmod._hash_tokenizer(h, tokenizer)
    return "sha256:" + h.hexdigest()


def cached_lookup(path: str, cfg: BackboneConfig, dtype: torch.dtype) -> str | None:
    """What a start with a warm cache does: the identity before and after loading, then the entry."""
    key = bbmod.weights_identity(path, cfg, dtype)
    assert bbmod.weights_identity(path, cfg, dtype) == key
    return bbmod.read_cached_fingerprint(key)


# =========================================================================== per shape


def bench_shape(shape: str, args, workdir: Path, tokenizer, tok_name: str) -> dict[str, Any]:
    meta_params = parameter_shapes(qwen2_config(shape))
    weight_gb = 2 * sum(_numel(s) for s in meta_params.values()) / 1e9
    dense = weight_gb <= args.dense_max_gb
    folder = workdir / f"qwen2-{shape}"
    log(f"[{shape}] writing {folder} ({weight_gb:.2f} GB of bf16 weights, "
        f"{'random values' if dense else 'sparse zeros'}; tokenizer: {tok_name})")
    (info, t_write, _) = timed(lambda: write_folder(folder, shape, tokenizer, dense))
    log(f"[{shape}] {info['parameters'] / 1e9:.3f}B parameters in {info['shards']} shard(s), written in {t_write:.1f} s; "
        f"disk used {_du(folder) / 1e9:.2f} GB")
    res: dict[str, Any] = {"shape": shape, **info, "weight_gb": weight_gb}
    path = str(folder)
    cfg = BackboneConfig(name_or_path=path, device="cpu")
    dtype = bbmod.resolve_dtype(cfg.dtype, torch.device("cpu"))

    # 1. computed, streamed from the files
    runs = []
    value = None
    for r in range(args.stream_repeats):
        v, wall, share = timed(lambda: streamed_fingerprint(folder))
        assert value in (None, v)
        value = v
        runs.append((wall, share))
        log(f"[{shape}] computed (streamed) #{r + 1}: {wall:.2f} s, CPU share {share:.2f}")
    res["computed_streamed_s"] = med([w for w, _ in runs])
    res["computed_streamed_cpu_s"] = med([w * s for w, s in runs])
    res["computed_streamed_cpu_share"] = [round(s, 2) for _, s in runs]
    res["fingerprint"] = value

    # 2. cached lookup (entry written once with the streamed value)
    key = bbmod.weights_identity(path, cfg, dtype)
    assert key is not None and key["weights_as"] == "stored", key
    bbmod.write_cached_fingerprint(key, value)
    cached_lookup(path, cfg, dtype)  # warm-up (imports, dentries)
    walls = []
    for _ in range(args.lookup_repeats):
        got, wall, _ = timed(lambda: cached_lookup(path, cfg, dtype))
        assert got == value
        walls.append(wall)
    res["cached_lookup_s"] = med(walls)
    res["lookup_vs_computed"] = res["cached_lookup_s"] / res["computed_streamed_s"]
    log(f"[{shape}] cached lookup: {res['cached_lookup_s'] * 1e3:.2f} ms (median of {len(walls)}); "
        f"ratio cached/computed {res['lookup_vs_computed']:.2e} ({1 / res['lookup_vs_computed']:.0f}x faster)")

    # 3. real start-up path
    if weight_gb * (4 / 2) <= args.real_max_gb:
        res["real"] = real_startup(shape, path, value, args)
    else:
        log(f"[{shape}] real load_backbone skipped: float32 in RAM would be {2 * weight_gb:.1f} GB "
            f"> --real-max-gb {args.real_max_gb:g}")
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    return res


def _du(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.iterdir() if p.is_file())


def real_startup(shape: str, path: str, streamed: str, args) -> dict[str, Any]:
    cfg = BackboneConfig(name_or_path=path, device="cpu")

    def start(mode: str) -> dict[str, Any]:
        os.environ[bbmod.FINGERPRINT_CACHE_ENV] = mode
        try:
            bb, t_load, s_load = timed(lambda: bbmod.load_backbone(cfg))
            fp, t_fp, s_fp = timed(lambda: bb.fingerprint)
            out = {"load_s": t_load, "fingerprint_s": t_fp, "startup_s": t_load + t_fp, "source": bb.fingerprint_source,
                   "fingerprint_cpu_s": t_fp * s_fp,
                   "cpu_share_load": round(s_load, 2), "cpu_share_fingerprint": round(s_fp, 2), "fingerprint": fp}
            if mode == "off" and not checked:
                out["check"] = bbmod.model_fingerprint(bb.model, bb.tokenizer) == streamed == fp
                checked.append(1)
            del bb
            gc.collect()
            return out
        finally:
            os.environ.pop(bbmod.FINGERPRINT_CACHE_ENV, None)

    checked: list[int] = []
    shutil.rmtree(bbmod.fingerprint_cache_dir(), ignore_errors=True)
    # warm-up (imports, page cache) with the cache off; it also checks streamed == model_fingerprint
    first = start("off")
    if not first["check"]:
        sys.exit(f"[{shape}] streamed fingerprint != model_fingerprint of the loaded model: the benchmark is wrong")
    log(f"[{shape}] check: streamed value == model_fingerprint(loaded model) == Backbone.fingerprint")
    cold = start("on")
    assert cold["source"] == "computed", cold["source"]
    log(f"[{shape}] cold cache: load {cold['load_s']:.2f} s + fingerprint {cold['fingerprint_s']:.2f} s (hash + write)")
    before, after = [], []
    for r in range(args.repeats):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            x = start(mode)
            assert x["fingerprint"] == streamed
            (before if mode == "off" else after).append(x)
            log(f"[{shape}] round {r + 1} {'before' if mode == 'off' else 'after '}: load {x['load_s']:.2f} s, "
                f"fingerprint {x['fingerprint_s']:.3f} s ({x['source']}), CPU share load/fp "
                f"{x['cpu_share_load']}/{x['cpu_share_fingerprint']}")
    assert all(x["source"] == "cache" for x in after)

    def summary(xs):
        return {k: med([x[k] for x in xs]) for k in ("load_s", "fingerprint_s", "fingerprint_cpu_s", "startup_s")} | {
            "cpu_share_fingerprint": [x["cpu_share_fingerprint"] for x in xs]}

    out = {"before": summary(before), "cold": {k: cold[k] for k in ("load_s", "fingerprint_s", "startup_s")},
           "after": summary(after), "repeats": args.repeats}
    out["fingerprint_ratio"] = out["after"]["fingerprint_s"] / out["before"]["fingerprint_s"]
    out["startup_ratio"] = out["after"]["startup_s"] / out["before"]["startup_s"]
    return out


# =========================================================================== report


def print_table(results: list[dict[str, Any]], per_param_7b: tuple[float, float] | None) -> None:
    log("")
    log("=" * 100)
    log(f"{'shape':<6} {'params':>8} {'weights':>9} {'computed s':>11} {'(CPU s)':>8} {'cached s':>10}"
        f" {'cached/computed':>16} {'speed-up':>10}")
    log("-" * 100)
    for r in results:
        log(f"{r['shape']:<6} {r['parameters'] / 1e9:>7.3f}B {r['weight_gb']:>7.2f}GB {r['computed_streamed_s']:>11.2f}"
            f" {r['computed_streamed_cpu_s']:>8.1f} {r['cached_lookup_s']:>10.4f} {r['lookup_vs_computed']:>16.2e}"
            f" {1 / r['lookup_vs_computed']:>9.0f}x")
    log("computed = model_fingerprint's bytes streamed from the files (bf16 -> float32, sha256), wall and CPU "
        "seconds (CPU s = what an idle core would take); cached = weights_identity x2 + cache read")
    for r in results:
        if "real" not in r:
            continue
        x = r["real"]
        b, a, c = x["before"], x["after"], x["cold"]
        log("")
        log(f"{r['shape']} real load_backbone + .fingerprint (float32, CPU), medians of {x['repeats']}:")
        log(f"  before (cache off): load {b['load_s']:.2f} s, fingerprint {b['fingerprint_s']:.2f} s "
            f"({b['fingerprint_cpu_s']:.2f} CPU s), start-up {b['startup_s']:.2f} s")
        log(f"  cold cache        : load {c['load_s']:.2f} s, fingerprint {c['fingerprint_s']:.2f} s, "
            f"start-up {c['startup_s']:.2f} s (once per model folder and machine: hash + write)")
        log(f"  after (warm cache): load {a['load_s']:.2f} s, fingerprint {a['fingerprint_s']:.4f} s, "
            f"start-up {a['startup_s']:.2f} s")
        log(f"  fingerprint after/before {x['fingerprint_ratio']:.2e}; start-up after/before {x['startup_ratio']:.2f} "
            f"(start-up = median of per-run load + fingerprint; the load includes weights_identity x2)")
    seven = next((r for r in results if r["shape"] == "7b"), None)
    log("")
    if seven is not None:
        log(f"7B per rank, measured (streamed): {seven['computed_streamed_s']:.1f} s computed "
            f"({seven['computed_streamed_cpu_s']:.1f} CPU s) vs {seven['cached_lookup_s'] * 1e3:.1f} ms cached")
    if per_param_7b is not None:
        n7 = sum(_numel(s) for s in parameter_shapes(qwen2_config("7b")).values())
        wall, cpu = per_param_7b
        log(f"7B per rank, extrapolated from the real 0.5B model_fingerprint: {wall * 1e9:.2f} s per 1B "
            f"parameters x {n7 / 1e9:.2f}B = {wall * n7:.1f} s ({cpu * n7:.1f} CPU s) (float32 CPU model: no bf16 "
            f"cast)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["0.5b", "7b"], choices=sorted(SHAPES))
    p.add_argument("--repeats", type=int, default=3, help="interleaved before/after rounds of the real start-up")
    p.add_argument("--stream-repeats", type=int, default=1, help="streamed computations per shape")
    p.add_argument("--lookup-repeats", type=int, default=20, help="cached lookups per shape (median)")
    p.add_argument("--dense-max-gb", type=float, default=2.0,
                   help="write random values up to this many GB of weights, sparse zeros above")
    p.add_argument("--real-max-gb", type=float, default=4.0,
                   help="run the real load_backbone when the float32 model takes at most this many GB")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads; 0 = torch's choice")
    p.add_argument("--workdir", default=None, help="where to write the model folders (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the model folders")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    log(f"startup fingerprint benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, {os.cpu_count()} CPUs, "
        f"{cpu_name()}; load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    workdir = Path(tempfile.mkdtemp(prefix="elasticmem-fp-bench-", dir=args.workdir))
    old_home = os.environ.get("ELASTICMEM_HOME")
    tokenizer, tok_name = tokenizer_source()  # before $ELASTICMEM_HOME moves
    os.environ["ELASTICMEM_HOME"] = str(workdir / "home")
    results = []
    try:
        for shape in args.shapes:
            results.append(bench_shape(shape, args, workdir, tokenizer, tok_name))
    finally:
        if old_home is None:
            os.environ.pop("ELASTICMEM_HOME", None)
        else:
            os.environ["ELASTICMEM_HOME"] = old_home
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            log(f"kept {workdir}")
    per_param = None
    for r in results:
        if "real" in r:
            before = r["real"]["before"]
            per_param = (before["fingerprint_s"] / r["parameters"], before["fingerprint_cpu_s"] / r["parameters"])
    print_table(results, per_param)
    load1 = os.getloadavg()
    log(f"load average at the end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    if args.out:
        meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                "argv": sys.argv[1:], "load_avg_start": load0, "load_avg_end": load1, "tokenizer": tok_name}
        write_json(args.out, {"meta": meta, "results": results}, __file__, argv)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
