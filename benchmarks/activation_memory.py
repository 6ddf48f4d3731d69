"""Peak memory of one scoring step (``score`` + backward) with and without activation checkpointing.

    python benchmarks/activation_memory.py                                  # Qwen2.5-0.5B's shape, B 8 x 600 tokens
    python benchmarks/activation_memory.py --layers 2 --seq 192 --batch 2   # a quick check (a few minutes)
    python benchmarks/activation_memory.py --device cuda --out /tmp/act.json

What it measures (``train.gradient_checkpointing``, issue 39 item 4), each setting in a fresh
Python process: a random model of Qwen2.5-0.5B's decoder shape (hidden 896, 24 layers, 14
heads, 2 KV heads, MLP 4864; ``--layers`` shrinks it) with a real-size vocabulary (``--vocab``,
Qwen2.5's 151936: the tied embedding and LM head are [V, 896]), built from its config with the
tiny tokenizer (token ids past the tokenizer's are random rows, unused by the text), no download;
a bank over a few synthetic histories, encoded by that model; ElasticMem with its default
policy and projector (LoRA r 16 on q/k/v/o), with or without
``enable_activation_checkpointing()``. ``--batch`` trajectories (``teacher_forced``: control
token, 4 retrieved memories with the policy's budgets, a random ``--answer``-token target) have
their prompts lengthened with random tokens so that each scoring sequence is ``--seq`` tokens.
With the model and trajectories ready, in train mode, the peak mark is reset (CPU: the kernel's
peak RSS, ``/proc/self/clear_refs`` 5; CUDA: ``torch.cuda.reset_peak_memory_stats``) and one
``score`` and backward of ``-(sum of its log-probs)`` run. Printed per setting: the peak's growth
over what was resident before the step (activations, the trainable parameters' gradients,
transient buffers) and the peak itself (weights included), then the ratio on/off of each. The
issue's acceptance: growth with checkpointing at most 0.5x growth without. ``score`` computes
logits at the answer tokens only ([B, answer, V]: 78 MB at 8 x 16 x 152k in float32), so at
600 tokens the decoder's activations, not the vocabulary, dominate the step.

Results: benchmarks/README.md, section ``activation_memory.py``; docs/cluster.md reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench.py, also when loaded by path
from _bench import REPO, status_kb, write_json  # noqa: E402

QWEN25_05B = {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2, "intermediate_size": 4864}


def _trajectories(model, batch, args):
    """``teacher_forced`` trajectories whose scoring sequences are ``args.seq`` tokens each."""
    import dataclasses

    import torch

    g = torch.Generator().manual_seed(0)
    vocab = len(model.tokenizer)
    answers = [torch.randint(vocab, (args.answer,), generator=g).tolist() for _ in batch]
    traj = model.teacher_forced(batch, answers)
    prompts = []
    for i, prompt in enumerate(traj.prompt_ids):
        n_mem = int((traj.soft_counts[i] > 0).sum())
        rest = (int(traj.control[i] >= 0) + int(traj.soft_counts[i].sum()) + n_mem * len(model.sep_ids)
                + len(traj.suffix_ids[i]) + args.answer)
        filler = args.seq - rest - len(prompt)
        if filler < 0:
            raise SystemExit(f"--seq {args.seq} is shorter than a trajectory's own tokens ({rest + len(prompt)})")
        prompts.append(torch.randint(vocab, (filler,), generator=g).tolist() + prompt)
    return dataclasses.replace(traj, prompt_ids=prompts)


def child(args: argparse.Namespace) -> dict:
    """One measurement in this process."""
    import gc

    import torch

    from elasticmem.backbone import Backbone, load_backbone
    from elasticmem.bank import Bank, build_bank
    from elasticmem.config import BankConfig, ChunkingConfig, MemoryConfig, BackboneConfig, TinyModelConfig
    from elasticmem.data.synthetic import SyntheticConfig, generate
    from elasticmem.model.elasticmem import ElasticMem

    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    shape = TinyModelConfig(**{**QWEN25_05B, "num_layers": args.layers}, max_position_embeddings=32768)
    bb = load_backbone(BackboneConfig(name_or_path="tiny", tiny=shape, device=args.device))
    bb.model.resize_token_embeddings(args.vocab, mean_resizing=False)
    bb = Backbone(bb.model, bb.tokenizer, "tiny")
    data = generate(SyntheticConfig(variant="tiny", num_histories=2, num_facts=4, num_options=4), seed=0)
    examples = [ex for split in data.values() for ex in split]
    batch = [examples[i % len(examples)] for i in range(args.batch)]
    with tempfile.TemporaryDirectory() as tmp:
        build_bank({"x": examples}, bb, ChunkingConfig(max_tokens=32), BankConfig(dir=tmp, n_cache=20),
                   torch.float32, show_progress=False)
        torch.manual_seed(0)
        model = ElasticMem(bb, MemoryConfig(top_z=4, max_new_tokens=args.answer), Bank.open(tmp)).eval()
        if args.checkpointing:
            model.enable_activation_checkpointing()
        traj = _trajectories(model, batch, args)
        model.train()
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            before = status_kb("VmRSS") * 1024
        out = model.score(traj)
        loss = -(out.logp_answer.sum() + out.logp_budget.sum() + out.logp_control.sum())
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
        else:
            peak = status_kb("VmHWM") * 1024
    lengths = [len(p) + len(s) for p, s in zip(traj.prompt_ids, traj.suffix_ids)]
    return {"checkpointing": args.checkpointing, "growth_mb": (peak - before) / 2**20, "peak_mb": peak / 2**20,
            "before_mb": before / 2**20, "text_tokens_max": max(lengths), "dtype": str(next(model.parameters()).dtype),
            "memory_tokens": traj.memory_tokens.tolist()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=QWEN25_05B["num_layers"], help="decoder layers (Qwen2.5-0.5B: 24)")
    p.add_argument("--seq", type=int, default=600, help="tokens of each scoring sequence")
    p.add_argument("--batch", type=int, default=8, help="trajectories per scoring micro-batch")
    p.add_argument("--answer", type=int, default=16, help="answer tokens scored per trajectory")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (Qwen2.5-0.5B: 151936)")
    p.add_argument("--device", default="cpu", help="cpu (peak RSS) or cuda[:N] (peak allocated)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--out", help="also write the results as JSON here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0

    print(f"Qwen2.5-0.5B's shape with {args.layers} layers, V={args.vocab}; batch {args.batch} x {args.seq} tokens "
          f"(answer {args.answer}); {args.device}")
    common = ["--layers", str(args.layers), "--seq", str(args.seq), "--batch", str(args.batch), "--answer",
              str(args.answer), "--vocab", str(args.vocab), "--device", args.device, "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    results = {}
    print(f"{'checkpointing':14} {'peak growth':>12} {'peak':>10}")
    for on in (False, True):
        cmd = [sys.executable, __file__, "--child", *common] + (["--checkpointing"] if on else [])
        run = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
        if run.returncode:
            sys.exit(f"the measurement with checkpointing {'on' if on else 'off'} failed:\n{run.stderr[-3000:]}")
        r = json.loads(run.stdout.splitlines()[-1])
        results["on" if on else "off"] = r
        print(f"{'on' if on else 'off':14} {r['growth_mb']:>9.0f} MB {r['peak_mb']:>7.0f} MB")
    off, on = results["off"], results["on"]
    growth, total = on["growth_mb"] / off["growth_mb"], on["peak_mb"] / off["peak_mb"]
    print(f"{'ratio on/off':14} {growth:>11.2f}x {total:>9.2f}x   (acceptance: growth <= 0.5x: "
          f"{'met' if growth <= 0.5 else 'not met'})")
    if args.out:
        write_json(args.out, {"args": vars(args), **results, "growth_ratio": growth, "peak_ratio": total},
                   __file__, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
