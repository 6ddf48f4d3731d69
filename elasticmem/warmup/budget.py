"""Fit the budget policy alone on every training question's retrieved memories (``warmup.policy_epochs``).

The reading warm-up's supervised start (``warmup.budget_weight``) trains the policy on the few
batches its answer steps see (24 steps of 8 in the quickstart), jointly with reading, while Z
grows. With the evidence ranked first for most questions the cheapest fit is "the top-ranked
memory gets everything", and the policy ends there: the same budgets for every question (issue 53).
This stage fits the policy on all the training questions' retrieval sets, many epochs: the
query states, retrieved rows and scores do not depend on the policy, so they are computed once
(one pass of the reasoner over the questions) and the policy, a few hundred thousand parameters,
then trains in seconds on the cached features towards the same target, B_max for every evidence
memory and min_budget for the others, balanced per set (``budget_supervision_loss``). Questions
that need two memories then weigh as much as their evidence does, not as much as their share of
a few batches. ``augment_z`` also draws, per set and epoch, a random Z' <= Z prefix (the rank
order kept), so that the policy sees sets whose evidence is last or absent. With
``warmup.policy_folds`` >= 2 the sets are cross-fitted: each fold of training histories is
retrieved through a map trained on the other folds (``cross_fitted_sets``), so the policy learns on
retrieval as imperfect as the test's, not on the map's own training questions.

    python -m elasticmem.warmup.budget --config configs/quickstart.yaml eval.checkpoint=RUN/warmup/final \\
        warmup.output_dir=RUN/policy_fit warmup.policy_epochs=200     # writes RUN/policy_fit/final
    python -m pytest -q tests/unit/test_policy_fit.py

The reading warm-up runs it by itself after its answer steps when ``warmup.policy_epochs`` > 0.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from elasticmem.config import Config, ConfigError
from elasticmem.data.schema import Example


@dataclass
class PolicySets:
    """The policy's inputs for N questions, as a rollout computes them: ``h`` [N, d] query
    states, ``keys`` [N, Z, d], ``scores`` [N, Z], ``mask`` [N, Z] bool and ``evidence`` [N, Z]
    bool (the slot holds one of the question's evidence chunks)."""

    h: torch.Tensor
    keys: torch.Tensor
    scores: torch.Tensor
    mask: torch.Tensor
    evidence: torch.Tensor

    def __len__(self) -> int:
        return self.h.shape[0]


@torch.no_grad()
def policy_sets(model, examples: Sequence[Example], evidence: Mapping[str, set[int]],
                batch_size: int = 16) -> PolicySets:
    """Query states, retrieved memories and their features for ``examples`` (greedy control
    token, as at evaluation), with the slots that hold evidence rows marked."""
    parts: list[tuple[torch.Tensor, ...]] = []
    for i in range(0, len(examples), batch_size):
        batch = list(examples[i : i + batch_size])
        *_, h, rows, scores, mask = model._query_and_retrieve(batch, 1, True)
        keys = model._policy_inputs(h, rows)
        ev = torch.tensor([[int(r) in evidence.get(ex.id, ()) for r in row.tolist()]
                           for ex, row in zip(batch, rows)], dtype=torch.bool).reshape(rows.shape)
        parts.append((h.float().cpu(), keys.float().cpu(), scores.float().cpu(), mask.cpu(), ev & mask.cpu()))
    return PolicySets(*(torch.cat(p) for p in zip(*parts)))


def cross_fitted_sets(model, examples: Sequence[Example], evidence: Mapping[str, set[int]], folds: int,
                      map_path: str, seed: int = 0) -> PolicySets:
    """``policy_sets`` whose retrieval never saw the question: the histories are split into
    ``folds`` folds, and each fold's sets are retrieved through a map trained (with the settings
    recorded in ``map_path``, the model's own map) on the other folds' questions only.

    The model's map was trained on these very questions, so through it the evidence of a
    training question is nearly always first with a high score (persona_shift's training R@1
    ~1.0 against 0.56 on test): a policy supervised on those sets learns "the top-ranked memory
    gets everything", and meets the test's weaker, reordered retrieval unprepared."""
    from elasticmem.model.retrieval_map import MappedIndex, load_retrieval_map
    from elasticmem.warmup.retrieval_map import MapTrainConfig, query_states, train_map, training_pairs

    _, meta = load_retrieval_map(map_path)
    settings = {f: v for f, v in (meta.get("train") or {}).get("settings", {}).items()
                if f in MapTrainConfig.__dataclass_fields__}
    kept, positives, ranges, _ = training_pairs(examples, model.bank)
    groups = sorted({ex.group for ex in kept})
    order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed)).tolist()
    fold_of = {groups[g]: i % folds for i, g in enumerate(order)}
    queries = query_states(model, kept)
    keys = model.bank.keys().float().clone()
    own = model.mapped_index
    parts = []
    try:
        for f in range(folds):
            fit = [i for i, ex in enumerate(kept) if fold_of[ex.group] != f]
            held = [ex for ex in kept if fold_of[ex.group] == f]
            if not held or not fit:
                continue
            rmap = train_map(queries[fit], [positives[i] for i in fit], [ranges[i] for i in fit], keys,
                             MapTrainConfig(**{**settings, "seed": seed + f}))
            model.mapped_index = MappedIndex(model.bank, rmap)
            parts.append(policy_sets(model, held, evidence))
    finally:
        model.mapped_index = own
    return PolicySets(*(torch.cat(t) for t in zip(*((p.h, p.keys, p.scores, p.mask, p.evidence) for p in parts))))


def prefix_mask(mask: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``mask`` [N, Z] cut to a random prefix of 1..Z slots per row (rank order kept)."""
    N, Z = mask.shape
    keep = torch.randint(1, Z + 1, (N, 1), generator=generator)
    return mask & (torch.arange(Z)[None, :] < keep)


def budget_targets(evidence: torch.Tensor, mask: torch.Tensor, max_budget: int, min_budget: int = 0,
                   fallback_top1: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The fit's target budgets [N, Z] and the slots it names ``positive`` [N, Z] bool, from the
    ``evidence`` and present (``mask``) slots [N, Z]: max_budget for the present evidence, and
    with ``fallback_top1`` for the first slot of a set with no present evidence (rank order: slot
    0 is the top-ranked memory); min_budget elsewhere."""
    positive = evidence & mask
    if fallback_top1:
        missed = ~positive.any(-1)
        positive = positive.clone()
        positive[:, 0] |= missed & mask[:, 0]
    return torch.where(positive, max_budget, min_budget), positive


def fit_policy(policy, sets: PolicySets, *, epochs: int, lr: float, batch_size: int, max_budget: int,
               min_budget: int = 0, weight_decay: float = 0.01, augment_z: bool = True,
               fallback_top1: bool = False, generator: torch.Generator | None = None) -> list[dict[str, float]]:
    """Train ``policy`` (a ``BudgetPolicy``) on ``sets`` towards ``budget_targets`` (max_budget
    for the evidence, min_budget for the others; with ``fallback_top1`` max_budget for the top
    memory of a set without evidence); returns one metrics dict per epoch (loss, and the argmax
    budgets' mean on evidence and other slots of the full sets)."""
    from elasticmem.model.budget_policy import budget_supervision_loss

    gen = generator or torch.Generator().manual_seed(0)
    dev = next(policy.parameters()).device
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=weight_decay)
    history = []
    for epoch in range(epochs):
        policy.train()
        order = torch.randperm(len(sets), generator=gen)
        total, n = 0.0, 0
        for i in range(0, len(sets), batch_size):
            idx = order[i : i + batch_size]
            mask = prefix_mask(sets.mask[idx], gen) if augment_z else sets.mask[idx]
            target, positive = budget_targets(sets.evidence[idx], mask, max_budget, min_budget, fallback_top1)
            logits = policy.logits(sets.h[idx].to(dev), sets.keys[idx].to(dev), sets.scores[idx].to(dev),
                                   mask.to(dev), target.to(dev))
            loss = budget_supervision_loss(logits, target.to(dev), mask.to(dev), min_budget,
                                           positive=positive.to(dev))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total, n = total + float(loss.detach()) * len(idx), n + len(idx)
        history.append({"epoch": epoch + 1, "loss": total / max(n, 1), **argmax_budgets(policy, sets, min_budget)})
    policy.eval()
    return history


@torch.no_grad()
def argmax_budgets(policy, sets: PolicySets, min_budget: int = 0) -> dict[str, float]:
    """Mean argmax budget of the evidence slots and of the other slots (eval mode), and the share
    of sets whose every evidence slot gets tokens."""
    was = policy.training
    policy.eval()
    dev = next(policy.parameters()).device
    logits = policy.logits(sets.h.to(dev), sets.keys.to(dev), sets.scores.to(dev), sets.mask.to(dev),
                           torch.zeros(sets.mask.shape, dtype=torch.long, device=dev))
    b = (logits.argmax(-1) + min_budget).cpu()
    policy.train(was)
    ev, other = sets.evidence & sets.mask, ~sets.evidence & sets.mask
    has_ev = ev.any(-1)
    all_read = ((b > 0) | ~ev).all(-1)
    return {"budget/evidence": float(b[ev].float().mean()) if ev.any() else float("nan"),
            "budget/other": float(b[other].float().mean()) if other.any() else float("nan"),
            "evidence_all_read": float(all_read[has_ev].float().mean()) if has_ev.any() else float("nan")}


def run(cfg: Config) -> dict[str, Any]:
    """Load ``eval.checkpoint``, fit its policy on the ``warmup.split`` questions, save
    ``warmup.output_dir``/final; returns the last epoch's metrics and the validation's."""
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import Bank, build_index
    from elasticmem.data.schema import load_split
    from elasticmem.eval.retrieval import evidence_rows
    from elasticmem.model.elasticmem import ElasticMem
    from elasticmem.training.runtime import check_init
    from elasticmem.utils.configuration import save as save_config

    w = cfg.warmup
    if w.policy_epochs < 1:
        raise ConfigError("warmup.policy_epochs must be >= 1 to fit the policy")
    if not cfg.eval.checkpoint:
        raise ConfigError("eval.checkpoint: the checkpoint whose policy to fit (e.g. the warm-up's final/)")
    out = Path(w.output_dir)
    if (out / "final").is_dir():
        print(f"[policy-fit] {out}/final exists: nothing to do", file=sys.stderr)
        return json.loads((out / "policy_fit.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    torch.manual_seed(cfg.seed)
    backbone = load_backbone(cfg.backbone)  # the model as the warm-up builds it (systems sits above this layer)
    bank = Bank.open(cfg.bank.dir, expect_fingerprint=backbone.fingerprint, expect_kv=cfg.kv_scheme_read)
    model = ElasticMem(backbone, cfg.memory, bank, build_index(bank, cfg.bank.index, cfg.seed, device=backbone.device))
    check_init(cfg.eval.checkpoint, model)
    model.load_weights(cfg.eval.checkpoint)
    model.eval()
    result = fit_model_policy(model, cfg, load_split(cfg.data.dir, w.split),
                              load_split(cfg.data.dir, "val") if (Path(cfg.data.dir) / "val.jsonl").is_file() else [],
                              evidence_rows)
    model.save_pretrained(out / "final.tmp")
    (out / "final.tmp").rename(out / "final")
    (out / "policy_fit.json").write_text(json.dumps(result, indent=1))
    return result


def fit_model_policy(model, cfg: Config, train: Sequence[Example], val: Sequence[Example], evidence_rows) -> dict:
    """``fit_policy`` on ``model.policy`` with ``cfg.warmup``'s settings; the metrics of the
    training sets per epoch and of the validation sets at the end."""
    w, pol = cfg.warmup, cfg.memory.policy
    t0 = time.perf_counter()
    train = [ex for ex in train if evidence_rows(ex, model.bank)]
    ev = {ex.id: evidence_rows(ex, model.bank) for ex in [*train, *val]}
    folds = w.policy_folds if cfg.memory.retrieval_map else 0
    sets = (cross_fitted_sets(model, train, ev, folds, cfg.memory.retrieval_map, cfg.seed) if folds >= 2
            else policy_sets(model, train, ev))
    history = fit_policy(model.policy, sets, epochs=w.policy_epochs, lr=w.policy_lr, batch_size=w.policy_batch_size,
                         max_budget=pol.max_budget, min_budget=pol.min_budget,
                         fallback_top1=w.policy_target == "evidence_or_top1",
                         generator=torch.Generator().manual_seed(cfg.seed))
    result = {"train_sets": len(sets), "folds": folds, "train_evidence_first": float(sets.evidence[:, 0].float().mean()),
              "epochs": history, "seconds": time.perf_counter() - t0}
    val = [ex for ex in val if ev.get(ex.id)]
    if val:
        result["val"] = {"sets": len(val), **argmax_budgets(model.policy, policy_sets(model, val, ev), pol.min_budget)}
    last = history[-1]
    print(f"[policy-fit] {len(sets)} sets, {w.policy_epochs} epochs, {result['seconds']:.0f} s: loss "
          f"{last['loss']:.3f}, budgets evidence {last['budget/evidence']:.1f} / other {last['budget/other']:.1f}"
          + (f"; val evidence {result['val']['budget/evidence']:.1f} / other {result['val']['budget/other']:.1f}"
             if "val" in result else ""), file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    from elasticmem.bank import BankError
    from elasticmem.data.schema import SchemaError
    from elasticmem.utils.configuration import print_config
    from elasticmem.utils.options import command_name, parse_cli

    cfg, _ = parse_cli(Config, argv, prog=command_name("python -m elasticmem.warmup.budget"), description=__doc__)
    print_config(cfg, file=sys.stderr)
    try:
        run(cfg)
    except (ConfigError, SchemaError, BankError, FileNotFoundError) as e:
        print(f"policy-fit: error: {e}", file=sys.stderr)
        return 2
    print(f"policy-fit: {cfg.warmup.output_dir}/final")
    return 0


if __name__ == "__main__":
    sys.exit(main())
