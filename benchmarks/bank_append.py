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
acceptance: at most 2). Every append fsyncs, so the times include the disk's.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elasticmem.backbone import load_backbone  # noqa: E402
from elasticmem.bank import append as append_mod  # noqa: E402
from elasticmem.bank.append import SessionAdd, append_sessions, create_bank  # noqa: E402
from elasticmem.config import BankConfig, ChunkingConfig, ModelConfig  # noqa: E402
from elasticmem.data.schema import Turn  # noqa: E402

WORDS = "cat dog sun box cup hat key map pen bed car egg fox owl".split()


def _session(i: int) -> list[Turn]:
    """One user + assistant pair (one chunk), distinct for every i."""
    return [Turn("user", " ".join(WORDS[(i * 7 + j) % 14] for j in range(5)) + f" {i}"),
            Turn("assistant", f"the {WORDS[i % 14]} {i}")]


class Counter:
    """Bytes written through the append module's file writes, split by whether compaction wrote them."""

    def __init__(self):
        self.append = self.compaction = 0
        self._in_compaction = False
        write, compact = append_mod._atomic_write_bytes, append_mod._compact

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", type=int, default=1000, help="rows of the small bank")
    p.add_argument("--large", type=int, default=10000, help="rows of the large bank")
    p.add_argument("--groups", type=int, default=32, help="memory groups the rows are spread over")
    p.add_argument("--repeats", type=int, default=40, help="timed one-chunk appends at each size")
    p.add_argument("--fill-batch", type=int, default=2000, help="rows per append while filling")
    p.add_argument("--dir", default=None, help="bank folder (default: a temporary one)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    bb = load_backbone(ModelConfig(name_or_path="tiny", device="cpu"))
    decoder, tok, fp = bb.model.get_decoder(), bb.tokenizer, bb.fingerprint
    counter = Counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.dir or tmp) / "bank"
        cfg = BankConfig(dir=str(root), n_cache=8)
        bank = create_bank(root, bb, ChunkingConfig(max_tokens=48), cfg, torch.float32)
        made = 0

        def fill(to: int):
            nonlocal bank, made
            while bank.num_chunks < to:
                n = min(args.fill_batch, to - bank.num_chunks)
                items = [SessionAdd(f"g{(made + k) % args.groups}", _session(made + k)) for k in range(n)]
                made += n
                bank = append_sessions(bank, items, decoder, tok, fp, batch_size=64).bank

        def timed() -> list[float]:
            nonlocal bank, made
            times = []
            for r in range(args.repeats + 1):
                item = SessionAdd(f"g{rng.randrange(args.groups)}", _session(made))
                made += 1
                t0 = time.perf_counter()
                bank = append_sessions(bank, [item], decoder, tok, fp).bank
                if r:  # the first reads what the fill left (the per-group state) once
                    times.append(time.perf_counter() - t0)
            return times

        results = {}
        for size in (args.small, args.large):
            fill(size)
            results[size] = timed()
            t = sorted(results[size])
            print(f"{bank.num_chunks:>8} rows: one append median {statistics.median(t) * 1e3:7.1f} ms, "
                  f"p90 {t[int(0.9 * (len(t) - 1))] * 1e3:7.1f} ms ({len(t)} appends, {len(bank.shards)} shards)",
                  flush=True)
        small, large = (statistics.median(results[s]) for s in (args.small, args.large))
        kept = sum(f.stat().st_size for f in root.iterdir()
                   if f.name.startswith(("shard-", "chunks-")) and f.name in
                   {s.file for s in bank.shards} | {c["file"] for c in bank.manifest.get("chunk_files", [])})
        print(f"ratio large/small (median): {large / small:.2f}")
        print(f"bytes written: appends {counter.append}, compaction {counter.compaction}; the bank's shard and chunk "
              f"files hold {kept}: compaction wrote {counter.compaction / kept:.2f} bytes per byte kept")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
