"""Peak memory of one ElasticMem rollout at a Qwen2.5-sized vocabulary (Linux).

    python benchmarks/rollout_memory.py                     # N = 16 queries x G 4 = 64, T = 16, V = 152064
    python benchmarks/rollout_memory.py --compare HEAD~1    # also with elasticmem.py of an older commit
    python benchmarks/rollout_memory.py --batch 4 --vocab 32000 --max-new-tokens 8

What it measures, per rollout kind (``sample``: ``model.sample(batch, group_size=G)``;
``greedy``: ``model.greedy`` over the same N = B*G trajectories, each query repeated G
times), each in a fresh Python process: the tiny random Qwen2 model
(``backbone.name_or_path=tiny``) with its vocabulary resized to ``--vocab`` (rows past the
tokenizer's are random, unused by the text), a bank over the histories of the B synthetic
queries, ElasticMem with ``max_new_tokens=T`` (untrained LoRA, policy, projector). With the
model, bank and inputs ready, the kernel's peak-RSS mark is reset (``/proc/self/clear_refs``
5) and one rollout runs under ``torch.no_grad``; it reports the peak RSS growth (VmHWM after
the rollout - VmRSS before it) in MB and in [N, V] float32 buffers, next to the size of
[N, T, V] float32 logits. Answers rarely end early at this vocabulary (EOS has probability
~1/V under the random model): the generated T is printed.

``--compare REV`` runs the same measurements a second time with
``elasticmem/model/elasticmem.py`` taken from git revision REV (the rest of the package from
this checkout), for a before/after table.

Results: benchmarks/README.md, section ``rollout_memory.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench.py, also when loaded by path
from _bench import REPO, status_kb  # noqa: E402


def child(args: argparse.Namespace) -> dict:
    """One measurement in this process; elasticmem is imported from ``args.code``."""
    sys.path.insert(0, args.code)
    import gc

    import torch

    from elasticmem.backbone import Backbone, load_backbone
    from elasticmem.bank import Bank, build_bank
    from elasticmem.config import BankConfig, ChunkingConfig, LoraConfig, MemoryConfig, BackboneConfig
    from elasticmem.data.synthetic import SyntheticConfig, generate
    from elasticmem.model.elasticmem import ElasticMem

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bb = load_backbone(BackboneConfig(name_or_path="tiny", device="cpu"))
    bb.model.resize_token_embeddings(args.vocab, mean_resizing=False)
    bb = Backbone(bb.model, bb.tokenizer, "tiny")
    data = generate(SyntheticConfig(variant="tiny", num_histories=args.batch, num_facts=4, num_options=4), seed=0)
    batch = [ex for split in data.values() for ex in split][: args.batch]
    with tempfile.TemporaryDirectory() as tmp:
        build_bank({"x": batch}, bb, ChunkingConfig(max_tokens=32), BankConfig(dir=tmp, n_cache=20),
                   torch.float32, show_progress=False)
        cfg = MemoryConfig(top_z=4, max_new_tokens=args.max_new_tokens, lora=LoraConfig(r=4, alpha=8))
        model = ElasticMem(bb, cfg, Bank.open(tmp)).eval()
        repeated = [ex for ex in batch for _ in range(args.group)]
        gc.collect()
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        before = status_kb("VmRSS")
        with torch.no_grad():
            traj = model.sample(batch, group_size=args.group) if args.kind == "sample" else model.greedy(repeated)
        peak = status_kb("VmHWM")
    N, T = traj.answer_ids.shape
    return {"kind": args.kind, "N": N, "T": T, "V": args.vocab, "peak_growth_mb": (peak - before) / 1024}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16, help="B queries")
    p.add_argument("--group", type=int, default=4, help="G trajectories per query")
    p.add_argument("--max-new-tokens", type=int, default=16, help="T")
    p.add_argument("--vocab", type=int, default=152064, help="V (Qwen2.5: 152064)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compare", metavar="REV", help="also measure elasticmem.py as of this git revision")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", choices=["sample", "greedy"], help=argparse.SUPPRESS)
    p.add_argument("--code", default=str(REPO), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0

    codes = [("after", str(REPO))]
    tmp = None
    if args.compare:
        tmp = tempfile.mkdtemp()
        shutil.copytree(REPO / "elasticmem", Path(tmp) / "elasticmem",
                        ignore=shutil.ignore_patterns("__pycache__"))
        old = subprocess.run(["git", "-C", str(REPO), "show", f"{args.compare}:elasticmem/model/elasticmem.py"],
                             check=True, capture_output=True, text=True).stdout
        (Path(tmp) / "elasticmem/model/elasticmem.py").write_text(old)
        codes.insert(0, ("before", tmp))
    common = ["--batch", str(args.batch), "--group", str(args.group), "--max-new-tokens", str(args.max_new_tokens),
              "--vocab", str(args.vocab), "--threads", str(args.threads)]
    step_mb = args.batch * args.group * args.vocab * 4 / 2**20
    print(f"N={args.batch * args.group} V={args.vocab}: one [N, V] float32 buffer = {step_mb:.0f} MB, "
          f"[N, T, V] = {step_mb * args.max_new_tokens:.0f} MB at T={args.max_new_tokens}")
    print(f"{'kind':8} {'code':8} {'T':>3} {'peak RSS growth':>16} {'[N, V] buffers':>15}")
    try:
        for kind in ("sample", "greedy"):
            for name, code in codes:
                env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONWARNINGS": "ignore"}
                out = subprocess.run([sys.executable, __file__, "--child", "--kind", kind, "--code", code, *common],
                                     check=True, capture_output=True, text=True, env=env).stdout
                r = json.loads(out.strip().splitlines()[-1])
                print(f"{kind:8} {name:8} {r['T']:>3} {r['peak_growth_mb']:>13.0f} MB "
                      f"{r['peak_growth_mb'] / step_mb:>15.1f}")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
