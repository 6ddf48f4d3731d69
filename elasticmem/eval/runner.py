"""Run one system over a split: resumable, multi-process, scored once.

Each process answers its share of the examples not yet answered and appends one
``predictions.jsonl`` record per example to its own part file
(``predictions.part-RANK.jsonl``), flushed after every batch. A rerun (after a
crash, Ctrl-C, or with another number of processes) reads every part file first
and only answers what is missing. When all processes are done, the main process
merges the parts into ``predictions.jsonl`` in the split's order, checks that
every example is there exactly once, and writes ``results.json``, ``report.md``,
the budget plots and ``case_study.md``.

Resuming never mixes evaluations: before the first record, ``run_identity.json``
records what makes the answers (``MemorySystem.identity()``: system, weights by
content hash, memory settings, model, bank; plus the split), and each record
carries its example's fingerprint. A folder holding predictions of another
identity, or of examples whose data changed, is refused (``OutputDirError``)
unless ``overwrite`` deletes them first. The limit, batch size and number of
processes are not part of the identity: a larger limit reuses the answered prefix.

``results.json`` records its ``provenance`` (``elasticmem.eval.provenance``): the code's git
commit and dirty flag, the resolved config's hash, and content hashes of the bank manifest,
retrieval map, checkpoint and predictions it came from.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from elasticmem.data.schema import Example
from elasticmem.eval import metrics
from elasticmem.eval.free_form import exact_match
from elasticmem.eval.system import MemorySystem, Prediction, fingerprint
from elasticmem.data.rewards import mc_letter_reward, snapped_action_reward

PART = "predictions.part-{rank}.jsonl"
IDENTITY = "run_identity.json"
OUTPUTS = ("predictions.jsonl", "results.json", "report.md", "case_study.md", "budget_by_rank.png",
           "budget_vs_score.png", "budget_histogram.png")
"""What ``finalize`` writes from the part files (``overwrite`` deletes them with the parts)."""
EXAMPLE_KEY = "example_fingerprint"
"""Key of a record's example fingerprint (``fingerprint(example.to_json())``)."""


class OutputDirError(RuntimeError):
    """The output folder holds predictions of another evaluation (system, weights, settings or data)."""


def gold_and_correct(pred: Prediction, ex: Example) -> tuple[str, bool]:
    """MC: gold is the option letter, correct when the parsed letter matches (data.rewards rules).
    Free form: gold is the reference text, correct on an exact match after A-Mem's normalisation;
    an agent step (``extra["admissible_commands"]``, e.g. the held-out ALFWorld imitation steps)
    is correct when the answer snapped to those commands is the expert's action (the
    ``snapped_action`` reward), so evaluating such a split gives the step accuracy."""
    if ex.is_free_form:
        if "admissible_commands" in ex.extra:
            return str(ex.answer_text), snapped_action_reward(pred.text, ex) == 1.0
        return str(ex.answer_text), bool(exact_match(pred.text, str(ex.answer_text)))
    return ex.answer_letter, mc_letter_reward(pred.text, ex) == 1.0


def _repair_tail(path: Path) -> None:
    """Drop a last line cut short by a crash, so appends start on a fresh line."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def _parts(out: Path) -> list[Path]:
    return sorted(out.glob(PART.format(rank="*")))


def read_parts(out: Path) -> dict[str, dict[str, Any]]:
    """Records already written by any process of any earlier run, by example id."""
    done: dict[str, dict[str, Any]] = {}
    for part in _parts(out):
        for line in part.read_text(encoding="utf-8").splitlines():
            if line.strip():
                rec = json.loads(line)
                done.setdefault(rec["id"], rec)
    return done


def _barrier(state) -> None:
    # The wait at the end can last hours (one process still building an A-Mem / Mem0 / LangMem
    # memory for its conversations): the process group's timeout allows it (eval.dist_timeout_s,
    # set by evaluate.py; PyTorch's NCCL default of 10 minutes would abort the job). A barrier
    # rather than the main process polling the part files: polling would need its own timeout and
    # its own check for a dead process, and the next variant's first barrier would wait as long.
    if state is not None and state.num_processes > 1:
        state.wait_for_everyone()


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat


_ABSENT = object()
_ADVICE = "use another eval.output_dir, or add eval.overwrite=true to delete them and start over"


def _short(v: Any) -> str:
    text = "absent" if v is _ABSENT else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def identity_mismatch(out: Path, identity: dict[str, Any]) -> str | None:
    """Why ``out``'s predictions cannot be resumed by a run of ``identity`` (None = they can)."""
    path = out / IDENTITY
    if not path.is_file():
        if _parts(out) or (out / "predictions.jsonl").exists():
            return (f"{out} holds predictions without {IDENTITY} (written by an older version?), so what "
                    f"made them is unknown: {_ADVICE}")
        return None
    old = json.loads(path.read_text())["identity"]
    if old == identity:
        return None
    a, b = _flatten(old), _flatten(identity)
    diffs = [k for k in sorted(set(a) | set(b)) if a.get(k, _ABSENT) != b.get(k, _ABSENT)]
    listed = "; ".join(f"{k}: {_short(a.get(k, _ABSENT))} there, {_short(b.get(k, _ABSENT))} now" for k in diffs[:6])
    if len(diffs) > 6:
        listed += f"; and {len(diffs) - 6} more (see {path})"
    return (f"{out} holds predictions of system {old.get('system')!r} made differently from this run of "
            f"{identity.get('system')!r} ({listed}): {_ADVICE}")


def claim_output(out: Path, identity: dict[str, Any], *, state=None, overwrite: bool = False,
                 meta: dict[str, Any] | None = None) -> None:
    """Make ``out`` hold only predictions of ``identity`` or raise ``OutputDirError``.

    The main process deletes the old outputs (``overwrite``), or records ``identity`` in a folder
    without predictions, and repairs the part files it may resume; then every process compares
    the folder with ``identity`` itself, so all of them fail alike and none waits at a barrier."""
    identity = json.loads(json.dumps(identity))  # as it reads back from disk (tuples -> lists, ...)
    if state is None or state.process_index == 0:
        out.mkdir(parents=True, exist_ok=True)
        if overwrite:
            for p in [*_parts(out), out / IDENTITY, *(out / f for f in OUTPUTS)]:
                p.unlink(missing_ok=True)
        if not _parts(out) and not (out / "predictions.jsonl").exists():
            tmp = out / f"{IDENTITY}.tmp"
            tmp.write_text(json.dumps({"identity": identity, "meta": meta or {}}, indent=1, ensure_ascii=False))
            os.replace(tmp, out / IDENTITY)
        if identity_mismatch(out, identity) is None:
            for part in _parts(out):
                _repair_tail(part)
    _barrier(state)
    why = identity_mismatch(out, identity)
    if why is not None:
        raise OutputDirError(why)


def process_share(examples: Sequence[Example], rank: int, world: int) -> list[Example]:
    """The examples process ``rank`` of ``world`` answers, in their order: whole groups, each to
    the process with the fewest examples so far (largest groups first, ties to the lower rank),
    so every process computes the same partition and the shares differ by at most one group."""
    sizes: dict[str, int] = {}
    for ex in examples:
        sizes[ex.group] = sizes.get(ex.group, 0) + 1
    load, owner = [0] * world, {}
    for group in sorted(sizes, key=lambda g: -sizes[g]):  # stable: ties keep first-appearance order
        r = min(range(world), key=lambda i: load[i])
        owner[group] = r
        load[r] += sizes[group]
    return [ex for ex in examples if owner[ex.group] == rank]


def evaluate(
    system: MemorySystem,
    examples: Sequence[Example],
    out_dir: str | Path,
    *,
    batch_size: int = 8,
    state=None,
    meta: dict[str, Any] | None = None,
    case_studies: int = 5,
    plots: bool = True,
    progress: bool = True,
    scorer: Callable[[Prediction, Example], tuple[str, bool]] = gold_and_correct,
    settings: dict[str, Any] | None = None,
    overwrite: bool = False,
    config: Any = None,
    results_options: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Answer ``examples`` with ``system`` into ``out_dir``; the results dict (main process).

    ``state`` is an ``accelerate.PartialState`` (None = one process). The examples not answered
    yet are shared out over the processes round-robin, or a whole group (conversation) at a time
    for a system whose ``memory_per_group`` is true (A-Mem, Mem0, LangMem build a memory per
    group: each in one process only; ``process_share``). Either way a resumed run with another
    number of processes answers each example exactly once.
    ``settings``: what else changes the answers (e.g. ``{"split": "test"}``), added to
    ``system.identity()``. A folder holding another identity's predictions, or predictions of
    examples whose data changed, raises ``OutputDirError``; ``overwrite`` deletes them first.
    ``config`` (a config dataclass) is saved as ``config.yaml`` once the folder is this run's.
    ``results_options``: keyword arguments of ``metrics.build_results`` (e.g. ``primary``).
    """
    out = Path(out_dir)
    rank, world = (state.process_index, state.num_processes) if state is not None else (0, 1)
    main = rank == 0
    ids = [ex.id for ex in examples]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate example ids in the evaluation set")
    ident = getattr(system, "identity", None)
    identity = {"system": system.name, **(ident() if ident is not None else {}), **(settings or {})}
    claim_output(out, identity, state=state, overwrite=overwrite, meta=meta)
    if main and config is not None:
        from elasticmem.utils.configuration import save

        save(config, out / "config.yaml")
    prints = {ex.id: fingerprint(ex.to_json()) for ex in examples}
    done = read_parts(out)
    changed = [i for i in ids if i in done and done[i].get(EXAMPLE_KEY) != prints[i]]
    if changed:
        raise OutputDirError(f"{out} holds predictions of {len(changed)} example(s) whose data differ from this "
                             f"run's (e.g. {changed[:3]}; the split file changed since they were answered): "
                             f"{_ADVICE}")
    pending = [ex for ex in examples if ex.id not in done]
    mine = process_share(pending, rank, world) if getattr(system, "memory_per_group", False) else pending[rank::world]
    _barrier(state)  # every process has read the parts before any appends: they all split the same list
    if main and done:
        print(f"[evaluate] {out}: {len(examples) - len(pending)} of {len(examples)} examples already answered; "
              f"answering {len(pending)}", file=sys.stderr)
    from tqdm.auto import tqdm

    bar = tqdm(total=len(pending), desc=f"eval {system.name}", unit="ex", disable=not (main and progress),
               file=sys.stderr, dynamic_ncols=True)
    with open(out / PART.format(rank=rank), "a", encoding="utf-8") as f:
        for i in range(0, len(mine), batch_size):
            batch = list(mine[i : i + batch_size])
            preds = system.predict(batch)
            if [p.id for p in preds] != [ex.id for ex in batch]:
                raise RuntimeError(f"{system.name} answered {[p.id for p in preds]} for {[ex.id for ex in batch]}")
            for p, ex in zip(preds, batch):
                gold, correct = scorer(p, ex)
                rec = metrics.make_record(p, question_type=ex.question_type, gold=gold, correct=correct)
                rec[EXAMPLE_KEY] = prints[ex.id]  # type: ignore[typeddict-unknown-key]
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(batch) * world)  # the others advance at about the same pace
    bar.close()
    _barrier(state)
    if not main:
        return None
    from elasticmem.eval.provenance import evaluation_provenance

    # hashed after answering: a streamed bank has grown to what the last question read
    prov = evaluation_provenance(config, bank_dir=_bank_dir(system))
    return finalize(out, examples, system.name, meta or {}, case_studies=case_studies, plots=plots,
                    results_options=results_options, provenance=prov)


def _bank_dir(system: Any) -> Path | None:
    """The folder of the bank ``system`` read (its model's), or None for a system without one
    (A-Mem, Mem0 and LangMem keep their own memories)."""
    root = getattr(getattr(getattr(system, "model", None), "bank", None), "root", None)
    return None if root is None else Path(root)


def finalize(out: Path, examples: Sequence[Example], name: str, meta: dict[str, Any], *,
             case_studies: int = 5, plots: bool = True,
             results_options: dict[str, Any] | None = None,
             provenance: dict[str, Any] | None = None) -> dict[str, Any]:
    """Merge the part files, check completeness, write every output; returns results.json's dict.

    ``provenance``: ``elasticmem.eval.provenance.evaluation_provenance`` of the run (None = the
    code's alone, without config or inputs); the merged ``predictions.jsonl``'s sha256 is added."""
    from elasticmem.eval import report
    from elasticmem.eval.provenance import evaluation_provenance, file_sha256

    done = read_parts(out)
    missing = [ex.id for ex in examples if ex.id not in done]
    if missing:
        raise RuntimeError(f"{out}: {len(missing)} example(s) have no prediction (e.g. {missing[:3]}); "
                           f"rerun the same command to answer them")
    records = [done[ex.id] for ex in examples]
    tmp = out / "predictions.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    os.replace(tmp, out / "predictions.jsonl")
    results = metrics.build_results(records, system=name, **(results_options or {}))
    results.update(meta)
    results["written_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    prov = dict(provenance) if provenance is not None else evaluation_provenance(None)
    results["provenance"] = {**prov, "predictions_sha256": file_sha256(out / "predictions.jsonl")}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    report.write_report(results, out / "report.md", title=f"{name}: {meta.get('split', '')}".rstrip(": "))
    if plots and any(r["budgets"] for r in records):
        from elasticmem.eval import plots as P

        P.budget_by_rank(records, out / "budget_by_rank.png")
        P.budget_vs_score(records, out / "budget_vs_score.png")
        P.budget_histogram(records, out / "budget_histogram.png")
    if case_studies > 0:
        write_case_studies(records, examples, out / "case_study.md", case_studies)
    return results


def write_case_studies(records: Sequence[dict[str, Any]], examples: Sequence[Example], path: Path, n: int) -> Path:
    """Question, gold, prediction and each retrieved memory's rank, score, budget and text
    (the paper's section 4.4 analysis) for the first ``n`` examples."""
    by_id = {ex.id: ex for ex in examples}
    lines = ["# Case studies", ""]
    for rec in records[:n]:
        ex = by_id[rec["id"]]
        lines += [f"## {rec['id']} ({rec['question_type']})", "", f"**Question:** {ex.question}", ""]
        if ex.choices:
            lines += [f"- ({chr(97 + i)}) {c}" for i, c in enumerate(ex.choices)] + [""]
        lines += [f"**Gold:** {rec['gold']}  ", f"**Prediction:** {rec['prediction']!r} "
                  f"({'correct' if rec['correct'] else 'wrong'})  ",
                  f"**Tokens:** {rec['tokens']['total']} (memory {rec['tokens']['memory']})", ""]
        if rec["retrieved"]:
            lines += ["| rank | score | budget | tokens | memory |", "|---|---|---|---|---|"]
            for m in rec["retrieved"]:
                text = " ".join(m["text"].split())
                text = text if len(text) <= 240 else text[:237] + "..."
                budget = "-" if m["budget"] is None else m["budget"]
                lines.append(f"| {m['rank']} | {m['score']:.3f} | {budget} | {m['tokens']} | "
                             f"{text.replace('|', '/')} |")
            lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
