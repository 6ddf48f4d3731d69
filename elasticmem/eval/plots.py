"""Pictures of saved evaluation and training outputs (matplotlib, Agg backend, PNG).

Every function reads saved outputs (a path or already-loaded records) and returns the path
of the PNG it wrote:

- from ``predictions.jsonl``: :func:`budget_by_rank` (heat map of budget value by retrieval
  rank), :func:`budget_vs_score` (budget against cosine score), :func:`budget_histogram`;
- from a training run's ``metrics.jsonl``: :func:`learning_curves` (reward, accuracy, mean
  ``B_mem``, loss by step, and greedy evaluation accuracy when logged);
- from several ``results.json``: :func:`accuracy_vs_tokens` (accuracy against ``#Tok``).

Command line::

    python -m elasticmem.eval.plots learning-curves RUN_DIR [--out PNG]
    python -m elasticmem.eval.plots compare RESULTS_JSON... [--names A B ...] [--out PNG]
    python -m elasticmem.eval.plots budgets PREDICTIONS_JSONL [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display; must precede pyplot
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from elasticmem.eval.metrics import load_records, load_results

Records = Sequence[Mapping[str, Any]]


def _records(src: str | Path | Records) -> Records:
    return load_records(src) if isinstance(src, (str, Path)) else src


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def rank_budget_score(records: Records) -> np.ndarray:
    """``[n, 3]`` array of (rank, budget, score), one row per retrieved memory with a budget.

    Budgets come from ``retrieved[].budget``; records whose retrieved entries carry none but
    that have ``budgets`` take those in rank order (score then NaN if unknown).
    """
    rows: list[tuple[float, float, float]] = []
    for r in records:
        with_b = [m for m in r.get("retrieved", []) if m.get("budget") is not None]
        if with_b:
            rows += [(m["rank"], m["budget"], m.get("score", np.nan)) for m in with_b]
        else:
            scores = {m["rank"]: m.get("score", np.nan) for m in r.get("retrieved", [])}
            rows += [(j, b, scores.get(j, np.nan)) for j, b in enumerate(r.get("budgets", []))]
    if not rows:
        raise ValueError("no budgets in these records (a system without elastic budgets?)")
    return np.asarray(rows, dtype=float)


def budget_by_rank(records: str | Path | Records, path: str | Path) -> Path:
    """Heat map: retrieval rank on x, budget value on y, colour = number of memories; the mean
    budget of each rank drawn over it."""
    a = rank_budget_score(_records(records))
    ranks, budgets = a[:, 0].astype(int), a[:, 1].astype(int)
    counts = np.zeros((budgets.max() + 1, ranks.max() + 1), dtype=int)
    np.add.at(counts, (budgets, ranks), 1)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.35 * counts.shape[1] + 2), 4.5))
    im = ax.imshow(counts, origin="lower", aspect="auto", cmap="viridis", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="memories")
    means = [budgets[ranks == k].mean() if (ranks == k).any() else np.nan for k in range(counts.shape[1])]
    ax.plot(range(counts.shape[1]), means, color="white", marker="o", ms=3, lw=1.5, label="mean budget")
    ax.set_xlabel("retrieval rank (0 = best)")
    ax.set_ylabel("budget (latent tokens)")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_title("Budget by retrieval rank")
    ax.legend(loc="upper right", fontsize=8)
    return _save(fig, path)


def budget_vs_score(records: str | Path | Records, path: str | Path) -> Path:
    """Scatter of each memory's budget against its cosine retrieval score, coloured by rank."""
    a = rank_budget_score(_records(records))
    a = a[np.isfinite(a[:, 2])]
    if not len(a):
        raise ValueError("no retrieval scores in these records")
    rng = np.random.default_rng(0)  # vertical jitter so equal integer budgets stay visible
    fig, ax = plt.subplots(figsize=(6, 4.5))
    sc = ax.scatter(a[:, 2], a[:, 1] + rng.uniform(-0.15, 0.15, len(a)), c=a[:, 0], cmap="plasma", s=8, alpha=0.6)
    fig.colorbar(sc, ax=ax, label="retrieval rank")
    if len(a) > 1 and np.ptp(a[:, 2]) > 0 and np.ptp(a[:, 1]) > 0:  # r is undefined for a constant
        r = np.corrcoef(a[:, 2], a[:, 1])[0, 1]
        ax.set_title(f"Budget vs cosine score (Pearson r = {r:.2f})")
    else:
        ax.set_title("Budget vs cosine score")
    ax.set_xlabel("cosine score")
    ax.set_ylabel("budget (latent tokens)")
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    return _save(fig, path)


def budget_histogram(records: str | Path | Records, path: str | Path) -> Path:
    """Bar chart of how often each budget value was chosen (0 = memory dropped)."""
    b = rank_budget_score(_records(records))[:, 1].astype(int)
    counts = np.bincount(b)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(np.arange(len(counts)), counts, color="tab:blue")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("budget (latent tokens)")
    ax.set_ylabel("memories")
    ax.set_title(f"Budget histogram (n = {len(b)}, mean = {b.mean():.2f}, dropped = {(b == 0).mean():.1%})")
    return _save(fig, path)


def read_metrics(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A run's ``metrics.jsonl`` split into training-step rows and ``{"step", "eval"}`` rows."""
    train, evals = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                (evals if "eval" in row else train).append(row)
    return train, evals


def _first_key(rows: list[dict[str, Any]], *keys: str) -> str | None:
    return next((k for k in keys if any(k in r for r in rows)), None)


def _series(rows: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return (np.array([p[0] for p in pts]), np.array([p[1] for p in pts], dtype=float)) if pts else (np.array([]),) * 2


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    """Trailing moving average (GRPO rewards are noisy step to step)."""
    if window <= 1 or len(y) < window:
        return y
    c = np.cumsum(np.insert(y, 0, 0.0))
    head = c[1:window] / np.arange(1, window)
    return np.concatenate([head, (c[window:] - c[:-window]) / window])


def _by_stage(rows: list[dict[str, Any]]) -> list[tuple[str | None, list[dict[str, Any]]]]:
    """Consecutive rows grouped by their ``stage`` (the warm-up logs 'align', 'reconstruct',
    'answer'; GRPO rows have none): each stage's loss means something else, so each is its own line."""
    groups: list[tuple[str | None, list[dict[str, Any]]]] = []
    for r in rows:
        if not groups or groups[-1][0] != r.get("stage"):
            groups.append((r.get("stage"), []))
        groups[-1][1].append(r)
    return groups


def learning_curves(run: str | Path, path: str | Path | None = None, smooth: int | None = None) -> Path:
    """Reward (mean ± std), accuracy, mean ``B_mem`` and loss by step from ``metrics.jsonl``.

    ``run``: a training output directory or its ``metrics.jsonl``. Keys as logged by
    ``elasticmem.grpo.metrics.step_metrics``: ``reward/mean``, ``reward/std``, ``accuracy``
    (``reward/accuracy`` accepted), ``budget/mean_B_mem``, ``loss``; greedy evaluation rows
    (``{"step", "eval": {"accuracy", ...}}``) are drawn on the accuracy panel. Faint lines are
    raw values, solid ones a moving average over ``smooth`` steps (default ~1/20 of the run).
    A warm-up's stages (rows with ``stage``) are drawn as separate lines, averaged within their
    stage, and its ``memory_tokens`` stand in for ``B_mem``.
    Default output: ``learning_curves.png`` beside ``metrics.jsonl``.
    """
    run = Path(run)
    metrics = run / "metrics.jsonl" if run.is_dir() else run
    train, evals = read_metrics(metrics)
    if not train:
        raise ValueError(f"no training steps in {metrics}")
    stages = _by_stage(train)
    panels = [("reward", _first_key(train, "reward/mean")),
              ("accuracy (sampled; warm-up: teacher-forced tokens)",
               _first_key(train, "accuracy", "reward/accuracy", "token_accuracy")),
              ("mean B_mem", _first_key(train, "budget/mean_B_mem", "budget/mean", "B_mem", "memory_tokens")),
              ("loss", _first_key(train, "loss"))]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for ax, (title, key) in zip(axes.flat, panels):
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if key is None:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
            continue
        for i, (stage, rows) in enumerate(stages):
            x, y = _series(rows, key)
            if not len(x):
                continue
            window = smooth if smooth is not None else max(1, len(rows) // 20)
            color = f"C{i}"
            ax.plot(x, y, color=color, alpha=0.3, lw=0.8)
            ax.plot(x, _smooth(y, window), color=color, lw=1.6, label=key if stage is None else f"{key} ({stage})")
            if key == "reward/mean" and _first_key(rows, "reward/std"):
                xs, s = _series(rows, "reward/std")
                if len(xs) == len(x):
                    ys, ss = _smooth(y, window), _smooth(s, window)
                    ax.fill_between(x, ys - ss, ys + ss, color=color, alpha=0.12, label="± std")
        if title.startswith("accuracy") and evals:
            ex = [r["step"] for r in evals if "accuracy" in r["eval"]]
            ey = [r["eval"]["accuracy"] for r in evals if "accuracy" in r["eval"]]
            ax.plot(ex, ey, color="tab:red", marker="o", ms=4, lw=1.2, label="greedy eval")
        ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(f"Training: {metrics.parent.name}")
    fig.tight_layout()
    return _save(fig, path if path is not None else metrics.with_name("learning_curves.png"))


def accuracy_vs_tokens(results: Mapping[str, Mapping[str, Any]], path: str | Path,
                       accuracy_key: str = "accuracy") -> Path:
    """Accuracy against ``#Tok`` (``avg_tokens``), one labelled point per system.

    ``results``: ``{system name: results.json dict}``. The x axis is logarithmic when token
    counts span more than 10x (latent memory vs. text memory differ by orders of magnitude).
    """
    if not results:
        raise ValueError("no systems to compare")
    names = list(results)
    x = np.array([float(results[n]["avg_tokens"]) for n in names])
    y = np.array([float(results[n].get(accuracy_key, results[n].get("success_rate", np.nan))) for n in names])
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for i, n in enumerate(names):
        ax.scatter(x[i], y[i], s=40, color=f"C{i % 10}", zorder=3)
        ax.annotate(n, (x[i], y[i]), textcoords="offset points", xytext=(5, 5), fontsize=8)
    if x.min() > 0 and x.max() / x.min() > 10:
        ax.set_xscale("log")
        # plain numbers at 1-2-5 steps; matplotlib's minor labels (2x10^2 ...) collide
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("#Tok per example (input + memory + generated)")
    ax.set_ylabel(accuracy_key)
    ax.set_title("Accuracy vs tokens")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _system_name(results_path: Path, results: Mapping[str, Any]) -> str:
    return str(results.get("system") or results_path.parent.name or results_path.stem)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line of the module docstring."""
    p = argparse.ArgumentParser(prog="python -m elasticmem.eval.plots", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    lc = sub.add_parser("learning-curves", help="reward/accuracy/B_mem/loss by step of a training run")
    lc.add_argument("run_dir")
    lc.add_argument("--out", default=None, help="PNG path (default RUN_DIR/learning_curves.png)")
    lc.add_argument("--smooth", type=int, default=None, help="moving-average window in steps")
    cp = sub.add_parser("compare", help="accuracy vs #Tok of several evaluations")
    cp.add_argument("results", nargs="+", help="results.json files")
    cp.add_argument("--names", nargs="*", default=None, help="one label per file (default: 'system' or folder name)")
    cp.add_argument("--out", default="accuracy_vs_tokens.png")
    bp = sub.add_parser("budgets", help="budget heat map, scatter and histogram of one evaluation")
    bp.add_argument("predictions", help="predictions.jsonl")
    bp.add_argument("--out-dir", default=None, help="default: the folder of predictions.jsonl")
    a = p.parse_args(argv)
    if a.cmd == "learning-curves":
        print(learning_curves(a.run_dir, a.out, a.smooth))
    elif a.cmd == "compare":
        paths = [Path(r) for r in a.results]
        if a.names and len(a.names) != len(paths):
            p.error("--names needs one name per results file")
        loaded = [load_results(q) for q in paths]
        names = a.names or [_system_name(q, r) for q, r in zip(paths, loaded)]
        if len(set(names)) != len(names):
            p.error(f"system names collide ({names}); pass --names")
        print(accuracy_vs_tokens(dict(zip(names, loaded)), a.out))
    else:
        recs = load_records(a.predictions)
        out = Path(a.out_dir) if a.out_dir else Path(a.predictions).parent
        for fn, name in ((budget_by_rank, "budget_by_rank.png"), (budget_vs_score, "budget_vs_score.png"),
                         (budget_histogram, "budget_histogram.png")):
            print(fn(recs, out / name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
