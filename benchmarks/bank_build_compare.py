"""Bank build time of this checkout against an older commit's, on the same data and preset (issue 55).

    OMP_NUM_THREADS=1 python benchmarks/bank_build_compare.py --data runs/data/quickstart \\
        --rev 1917326~1 --repeats 3 --out runs/bench/bank_build_compare.json
    python benchmarks/bank_build_compare.py --config configs/tiny.yaml --data D --rev HEAD --repeats 1   # seconds

Each repeat runs ``build_bank.py`` end to end (a fresh process: model load, encoding, writing the
shards and the manifest) once with this checkout's code and once with ``--rev``'s (a detached git
worktree, put on ``PYTHONPATH``), in an order that alternates with the repeat (the machine is
noisy), both into empty folders under ``--work``, one torch thread each (``OMP_NUM_THREADS``).
Prints and writes the median wall seconds of each, their ratio (this / rev: the goal of issue 55
is within 1.1), and each bank's bytes. ``--splits`` limits the histories encoded
(``bank.splits``), so a quick check need not encode the whole data set.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench.py, also when loaded by path
from _bench import REPO, write_json  # noqa: E402


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def build_once(code: Path, config: str, data: str, bank: Path, splits: str, extra: list[str]) -> float:
    """Wall seconds of one ``build_bank.py`` run with ``code``'s package, into an empty ``bank``."""
    shutil.rmtree(bank, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, str(code / "build_bank.py"), "--config", config, f"data.dir={data}",
           f"bank.dir={bank}", f"bank.splits=[{splits}]", *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=code, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "quickstart.yaml"))
    p.add_argument("--data", required=True, help="a prepared data folder (python -m elasticmem.data.prepare ...)")
    p.add_argument("--rev", required=True, help="the older commit to compare with (e.g. 1917326~1)")
    p.add_argument("--splits", default="test", help="bank.splits to encode, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default=None, help="where the worktree and the banks go (default: a temp dir)")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    p.add_argument("overrides", nargs="*", help="key=value for both builds (e.g. bank.batch_size=16)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    work = Path(args.work or tempfile.mkdtemp(prefix="bank_build_compare_"))
    work.mkdir(parents=True, exist_ok=True)
    old = work / "rev_tree"
    if old.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=False)
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(old), args.rev], check=True,
                   stdout=subprocess.DEVNULL)
    rev = subprocess.run(["git", "-C", str(old), "rev-parse", "HEAD"], check=True, capture_output=True,
                         text=True).stdout.strip()
    config, data = str(Path(args.config).resolve()), str(Path(args.data).resolve())
    codes = {"this": REPO, "rev": old}
    seconds: dict[str, list[float]] = {"this": [], "rev": []}
    sizes: dict[str, int] = {}
    try:
        for r in range(args.repeats):
            for name in (("this", "rev") if r % 2 == 0 else ("rev", "this")):
                bank = work / f"bank_{name}"
                s = build_once(codes[name], config, data, bank, args.splits, args.overrides)
                seconds[name].append(s)
                sizes[name] = tree_bytes(bank)
                print(f"repeat {r}: {name:4s} {s:7.1f} s, {sizes[name] / 1e6:8.1f} MB", flush=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(old)], check=False)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    ratio = med["this"] / med["rev"]
    print(f"median: this {med['this']:.1f} s, rev {med['rev']:.1f} s; this / rev {ratio:.3f} "
          f"(bytes {sizes['this'] / sizes['rev']:.3f}x)")
    if args.out:
        write_json(args.out, {"rev": rev, "config": args.config, "data": data, "splits": args.splits,
                              "overrides": args.overrides, "seconds": seconds, "median_seconds": med,
                              "ratio_this_over_rev": ratio, "bank_bytes": sizes,
                              "threads": os.environ.get("OMP_NUM_THREADS")}, __file__, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
