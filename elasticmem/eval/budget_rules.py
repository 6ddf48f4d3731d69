"""The learned budgets against the simple rules, and what the budgets look like question by question.

The reading ladder (``elasticmem.apps.ladder``) evaluates each simple rule at its own cost:
top-K at B_max (``rule_top1``, ``rule_top2``, ``rule_top4``), the score gap (``rule_gap``: B_max
for every memory whose score is within delta of the best, delta chosen on the validation split)
and the learned policy's mean token total shared out evenly (``rule_spread``); with ``--caps``
also each rule under every cap. This module holds the steps that need other rungs' results (the
gap's choice, the spread's total) and the comparisons:

* ``best_rule``: the learned policy minus the most accurate rule at equal or fewer memory tokens,
  paired by question (and at each cap, the learned policy under the cap against the best rule
  under it);
* ``budget_vectors``: the distribution of the learned budget vectors over the test questions
  (not only their means), and how often every retrieved evidence memory of a question that needs
  two memories gets tokens.

    python -m pytest -q tests/unit/test_budget_rules.py
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence

RULES = ("latent_uniform", "rule_top1", "rule_top2", "rule_top4", "rule_gap", "rule_spread")
"""The rule rungs (latent_uniform is top-Z at B_max), each at its own cost."""
CAP_RULES = ("uniform", "top1", "top2", "gap")
"""The rules of the cost dial, each under every cap (``{rule}_cap{c}``)."""
TOKEN_SLACK = 0.05
"""Memory tokens a rule may spend above the learned policy and still count as 'equal' (rounding
of the spread rule's total)."""


def choose_gap(val: Mapping[float, Mapping[str, float]]) -> float:
    """The score gap of highest validation accuracy (``val``: {gap: {accuracy, memory_tokens}}),
    ties to the fewer memory tokens, then the smaller gap."""
    if not val:
        raise ValueError("no validation results to choose the score gap from")
    return min(val, key=lambda g: (-val[g]["accuracy"], val[g]["memory_tokens"], g))


def gap_variants(gaps: Sequence[float]) -> dict[str, list[str]]:
    """``eval.variants`` of the gap rule at each candidate gap (evaluated on validation)."""
    return {f"gap_{g:g}": ["eval.budgets=gap", f"memory.policy.score_gap={g:g}"] for g in gaps}


def derived_variants(gap: float | None, spread_total: float | None, caps: Sequence[int], top_z: int,
                     rules_at_caps: bool = True) -> dict[str, list[str]]:
    """The rungs whose settings come from other rungs: ``rule_gap`` at the chosen ``gap``,
    ``rule_spread`` at the learned policy's mean total (rounded, at least 1), and each rule of
    ``CAP_RULES`` under every cap (top-K for K < Z; 'uniform' is the ladder's own uniform_cap)."""
    out: dict[str, list[str]] = {}
    if gap is not None:
        out["rule_gap"] = ["eval.budgets=gap", f"memory.policy.score_gap={gap:g}"]
    if spread_total is not None:
        out["rule_spread"] = ["eval.budgets=max", f"memory.policy.token_cap={max(1, round(spread_total))}"]
    if rules_at_caps:
        for c in caps:
            for k in (1, 2):
                if k < top_z:
                    out[f"top{k}_cap{c}"] = [f"eval.budgets=top{k}", f"memory.policy.token_cap={c}"]
            if gap is not None:
                out[f"gap_cap{c}"] = ["eval.budgets=gap", f"memory.policy.score_gap={gap:g}",
                                      f"memory.policy.token_cap={c}"]
    return out


def _row(out_root: Path, name: str) -> dict[str, Any] | None:
    from elasticmem.eval.metrics import load_results
    from elasticmem.eval.report import load_correct

    d = out_root / name
    if not (d / "results.json").is_file():
        return None
    res = load_results(d / "results.json")
    return {"name": name, "accuracy": res["accuracy"], "n": res["num_examples"], "ci95": res["accuracy_ci95"],
            "memory_tokens": res["avg_memory_tokens"], "correct": load_correct(d / "predictions.jsonl")}


def _against(best: Mapping[str, Any], system: Mapping[str, Any]) -> dict[str, Any]:
    from elasticmem.eval import stats

    ca, cb = stats.pair_by_id(best["correct"], system["correct"])
    return {"rule": best["name"], "rule_accuracy": best["accuracy"], "rule_memory_tokens": best["memory_tokens"],
            **stats.paired_comparison(ca, cb).as_dict()}


def pick_best(candidates: Sequence[Mapping[str, Any]], max_tokens: float) -> Mapping[str, Any] | None:
    """The most accurate of ``candidates`` (rows with accuracy and memory_tokens) within
    ``max_tokens`` (+ ``TOKEN_SLACK``); ties to the fewer tokens. None if none is within it."""
    within = [c for c in candidates if c["memory_tokens"] <= max_tokens + TOKEN_SLACK]
    return min(within, key=lambda c: (-c["accuracy"], c["memory_tokens"], c["name"])) if within else None


def best_rule(out_root: Path, caps: Sequence[int] = (), system: str = "latent_learned") -> dict[str, Any]:
    """``system`` against the best rule at equal or fewer memory tokens (paired by question), the
    best rule at any cost, and at each cap the learned policy under it against the best rule
    under it. Rungs not evaluated are left out."""
    learned = _row(out_root, system)
    if learned is None:
        return {}
    rules = [r for r in (_row(out_root, n) for n in RULES) if r is not None]
    out: dict[str, Any] = {"rules": {r["name"]: {k: r[k] for k in ("accuracy", "n", "ci95", "memory_tokens")}
                                     for r in rules}}
    best = pick_best(rules, learned["memory_tokens"])
    out["at_equal_or_fewer_tokens"] = _against(best, learned) if best else None
    top = pick_best(rules, float("inf"))
    out["best_at_any_cost"] = _against(top, learned) if top else None
    dial = []
    for c in caps:
        at_cap = _row(out_root, f"learned_cap{c}")
        capped = [r for r in (_row(out_root, f"{rule}_cap{c}") for rule in CAP_RULES) if r is not None]
        if at_cap is None or not capped:
            continue
        dial.append({"cap": c, "learned_accuracy": at_cap["accuracy"], "learned_memory_tokens": at_cap["memory_tokens"],
                     **_against(pick_best(capped, float("inf")), at_cap)})
    out["cost_dial"] = dial
    return out


def budget_vectors(records: Sequence[Mapping[str, Any]], top: int = 8) -> dict[str, Any] | None:
    """The learned budget vectors over the questions (``predictions.jsonl`` records, memories in
    rank order): the ``top`` most common vectors with their share, the number of distinct ones, how
    many memories get tokens per question (a histogram), per question type the mean budget by rank,
    and, over the questions with two or more evidence memories retrieved, the share whose every
    retrieved evidence memory gets tokens. None when no record has budgets."""
    vectors: list[tuple[int, ...]] = []
    by_type: dict[str, list[tuple[int, ...]]] = {}
    multi = multi_all = 0
    for r in records:
        mems = [m for m in (r.get("retrieved") or []) if m.get("budget") is not None]
        if not mems:
            continue
        v = tuple(int(m["budget"]) for m in sorted(mems, key=lambda m: m.get("rank", 0)))
        vectors.append(v)
        by_type.setdefault(str(r.get("question_type") or (r.get("extra") or {}).get("question_type") or "all"),
                           []).append(v)
        ev = set((r.get("extra") or {}).get("evidence", {}).get("rows") or [])
        got = [int(m["budget"]) > 0 for m in mems if str(m.get("ref", "")).startswith("row:")
               and int(m["ref"].split(":", 1)[1]) in ev]
        if len(got) >= 2:
            multi += 1
            multi_all += all(got)
    if not vectors:
        return None
    n = len(vectors)
    count = Counter(vectors)
    kept = Counter(sum(b > 0 for b in v) for v in vectors)

    def mean_by_rank(vs: Sequence[tuple[int, ...]]) -> list[float]:
        Z = max(len(v) for v in vs)
        return [sum(v[j] for v in vs if j < len(v)) / max(1, sum(j < len(v) for v in vs)) for j in range(Z)]

    return {"n": n, "distinct": len(count),
            "most_common": [{"budgets": list(v), "share": c / n} for v, c in count.most_common(top)],
            "memories_with_tokens": {str(k): kept[k] / n for k in sorted(kept)},
            "mean_by_rank": {t: mean_by_rank(vs) for t, vs in sorted(by_type.items())},
            "two_evidence_questions": multi, "two_evidence_all_read": multi_all / multi if multi else None}


def _diff(p: Mapping[str, Any]) -> str:
    lo, hi = p["difference_ci"]
    return f"{100 * p['difference']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}], p = {p['p_value']:.3g}"


def rules_markdown(rules: Mapping[str, Any], vectors: Mapping[str, Any] | None, gap: float | None) -> str:
    """The ladder's section on the rules and the budget vectors."""
    lines: list[str] = []
    if rules:
        lines += ["", "## The learned budgets against the simple rules", ""]
        if gap is not None:
            lines.append(f"rule_gap's gap, chosen on the validation split: {gap:g}.")
        for key, label in (("at_equal_or_fewer_tokens", "best rule at equal or fewer memory tokens"),
                           ("best_at_any_cost", "best rule at any cost")):
            p = rules.get(key)
            lines.append(f"- learned - {label}: " + (
                f"{p['rule']} ({p['rule_accuracy']:.3f} at {p['rule_memory_tokens']:.1f} tokens): {_diff(p)}"
                if p else "no rule spends that few tokens"))
        if rules.get("cost_dial"):
            lines += ["", "| cap | learned: accuracy (tokens) | best rule under the cap | learned - best rule |",
                      "|---|---|---|---|"]
            for d in rules["cost_dial"]:
                lines.append(f"| {d['cap']} | {d['learned_accuracy']:.3f} ({d['learned_memory_tokens']:.1f}) | "
                             f"{d['rule']}: {d['rule_accuracy']:.3f} ({d['rule_memory_tokens']:.1f}) | {_diff(d)} |")
    if vectors:
        lines += ["", f"## The learned budget vectors ({vectors['n']} questions, {vectors['distinct']} distinct)", "",
                  "| budgets by rank | share |", "|---|---|"]
        lines += [f"| {tuple(v['budgets'])} | {v['share']:.3f} |" for v in vectors["most_common"]]
        lines += ["", "Memories given tokens per question: " + ", ".join(
            f"{k}: {s:.3f}" for k, s in vectors["memories_with_tokens"].items()) + "."]
        if vectors["two_evidence_questions"]:
            lines.append(f"Questions with two or more evidence memories retrieved: {vectors['two_evidence_questions']}; "
                         f"every one of them given tokens in {vectors['two_evidence_all_read']:.3f}.")
        for t, means in vectors["mean_by_rank"].items():
            lines.append(f"- {t}: mean budget by rank " + ", ".join(f"{m:.1f}" for m in means))
    return "\n".join(lines) + ("\n" if lines else "")
