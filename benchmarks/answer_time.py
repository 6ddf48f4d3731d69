"""Answer time per question: ElasticMem reading KV vs text RAG, the hidden-state projector and no memory.

    OMP_NUM_THREADS=1 python benchmarks/answer_time.py --repeats 3 --minutes 15 --out runs/bench/answer_time.json \
        --write-readme                        # SmolLM2 on LoCoMo, the real run: <= 15 min on one idle core
    OMP_NUM_THREADS=1 python benchmarks/answer_time.py --checkpoint CKPT ...   # + the checkpoint's learned budgets
    python benchmarks/answer_time.py --from-json runs/bench/answer_time.json --write-readme   # the tables only
    python benchmarks/answer_time.py --config configs/tiny.yaml --data synthetic --chunk-tokens 4 8 --zs 2 4 \
        --batches 1 4 --repeats 1 --new-tokens 3 --work /tmp/at                   # seconds (the test's sizes)

Default: SmolLM2 on LoCoMo MC-10 (``configs/locomo_mc10.yaml``; ``--locomo``: locomo10.json, prepared
with ``prepare locomo-mc10`` into ``--work``; ``--data synthetic``: the config's ``data.synthetic``;
``--data-dir``: prepared data). For each ``--chunk-tokens`` C a bank of the groups of the first
``max(--batches)`` questions of ``--split`` is built into ``--work/bank_C`` (or reused: ``--bank
C=PATH``) with ``chunking.max_tokens = bank.n_cache = C``, the hidden-state cache and the per-layer KV
(float16), from histories whose chunks were cut to fit C (``fit_chunks`` says why).

Systems, each its own model from ``build_system`` (as evaluate.py builds it), all reading one open
snapshot of each bank in turn (``use_bank``), greedy, one thread:

- ``kv_max``: ElasticMem, ``memory.content=kv``, budgets ``max`` (B_max = the largest C): every
  retrieved memory at all its stored slots (min(C, L - 1) for a chunk of L tokens: its first
  position is never stored);
- ``kv_learned`` (with ``--checkpoint``): the checkpoint's model and learned budgets (``policy``);
- ``text``: text RAG (``memory.injection=text``): the same query state, top-Z rows, the chunks as text;
- ``hidden``: ``memory.content=hidden``, budgets ``max``, through an UNTRAINED projector (its cost is
  real, its answers are not);
- ``none``: no memory (``top_z=0``).

Each answer is timed in the parts the harness's rollout (``elasticmem.model.rollout.rollout``) runs,
calling the same model methods in the same order (``ElasticMem.greedy`` runs them in one call):
``retrieval`` = query state (``_query_states``) + search (``_retrieve``) + budgets (``_budgets``);
``load`` = the memories' pieces (``_soft_tokens``: KV slots gathered from the bank's shards and moved to
the device; the hidden cache gathered and projected; text: token ids of the chunk texts, memoised
per row, and their embeddings); ``assemble`` (embedding, placing, rotating KV keys, masks);
``prefill`` = the decoder's first forward inside ``generate_answers`` (forward hooks; KV memories
come in as the cache, their positions are not recomputed); ``decode`` = the rest of that call:
``--new-tokens`` tokens, EOS disabled so every system decodes as many. ``load`` is timed warm and
cold: before the cold one, the bank's shard files are dropped from memory (their mappings in this
process by ``madvise(MADV_DONTNEED)``, then the page cache by ``posix_fadvise(POSIX_FADV_DONTNEED)``;
the pages still resident are counted with ``mincore`` and reported), and text's token memo is
cleared (chunk texts stay in RAM: the bank reads its chunks file whole on first use). The warm-up
of each system is ``ElasticMem.greedy`` itself, and the timed path must reproduce its rows, token
counts and answer (``matches_greedy``).

Cells: chunk size x Z (``--zs``) x batch (``--batches``; batch b = the first b questions). Each repeat
runs every cell, its systems in an order that rotates with the repeat (the machine is noisy);
``--minutes`` starts no repeat that would end later. Medians over the repeats, per question (a
batch's time / b), and the ratio ElasticMem / text RAG per cell, in one process.
``--write-readme`` writes ``docs/results/benchmarks/answer_time*.json`` and their tables into
benchmarks/README.md (``scripts/gen_results_tables.py`` renders them).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _bench.py, also when loaded by path
from _bench import REPO, cpu_name, log, med, write_json  # noqa: E402

PARTS = ("query_state", "search", "policy", "load_warm", "load_cold", "assemble", "prefill", "decode")
SYSTEMS: dict[str, tuple[list[str], str]] = {  # name -> (its overrides, budgets mode)
    "kv_max": (["eval.system=elasticmem", "memory.content=kv"], "max"),
    "kv_learned": (["eval.system=elasticmem", "memory.content=kv"], "policy"),
    "text": (["eval.system=text_rag"], "policy"),  # no policy for text: _allocate gives empty budgets
    "hidden": (["eval.system=elasticmem", "memory.content=hidden"], "max"),
    "none": (["eval.system=no_memory"], "policy"),
}
LABELS = {"kv_max": "ElasticMem KV, B_max", "kv_learned": "ElasticMem KV, learned budgets",
          "text": "text RAG", "hidden": "hidden + projector (untrained)", "none": "no memory"}
PLACEHOLDER = "<!-- answer_time: benchmarks/answer_time.py --write-readme puts its tables here -->"
RESULTS = ("benchmarks/answer_time", "benchmarks/answer_time_split")


# ---------------------------------------------------------------- page cache


class BankPages:
    """The bank's shard files as this process maps them (safetensors keeps one mapping per shard
    open for the bank's life), to evict before a cold load. ``posix_fadvise`` alone leaves every
    page this process has touched: the kernel keeps pages that a mapping still points to."""

    MADV_DONTNEED = 4

    def __init__(self, bank):
        self.files = {str((Path(bank.root) / s.file).resolve()) for s in bank.shards}
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

    def mappings(self) -> list[tuple[int, int]]:
        out = []
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].strip() in self.files:
                    a, b = (int(x, 16) for x in parts[0].split("-"))
                    out.append((a, b))
        return out

    def resident(self) -> float | None:
        """Fraction of the mapped pages of the bank's files that are in memory (``mincore``); None
        when nothing maps them (a reader that does not map its files: not measured)."""
        total = held = 0
        page = os.sysconf("SC_PAGE_SIZE")
        for a, b in self.mappings():
            n = (b - a) // page
            vec = (ctypes.c_ubyte * n)()
            if self.libc.mincore(a, b - a, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            total, held = total + n, held + sum(v & 1 for v in vec)
        return held / total if total else None

    def drop(self) -> float | None:
        """Evict the files' pages; returns the fraction still resident after."""
        for a, b in self.mappings():  # the bank is read-only: its private pages equal the file's
            if self.libc.madvise(a, b - a, self.MADV_DONTNEED) != 0:
                raise OSError(ctypes.get_errno(), "madvise failed")
        for path in self.files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return self.resident()


# ---------------------------------------------------------------- one answer, in parts


class ForwardClock:
    """Each forward of ``decoder`` inside the block: its input (positions [N, T], cached slots
    before it) and its start and end. In ``generate_answers`` the first is the prefill."""

    def __init__(self, decoder: torch.nn.Module, sync):
        self.decoder, self.sync, self.calls = decoder, sync, []

    def __enter__(self) -> "ForwardClock":
        self.hooks = [self.decoder.register_forward_pre_hook(self._pre, with_kwargs=True),
                      self.decoder.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()

    def _pre(self, module, args, kwargs) -> None:
        x = kwargs.get("inputs_embeds") if kwargs.get("inputs_embeds") is not None else kwargs.get("input_ids")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = int(cache.get_seq_length()) if cache is not None else 0
        self.sync()
        self.calls.append({"shape": list(x.shape[:2]), "past": past, "t0": time.perf_counter()})

    def _post(self, module, args, out) -> None:
        self.sync()
        self.calls[-1]["t1"] = time.perf_counter()


def piece_digest(piece: Any) -> str:
    """sha256 (16 hex) of a loaded memory's tensor as loaded (a ``KVPiece``'s slots, or soft tokens)."""
    t = piece.kv if hasattr(piece, "kv") else piece
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]


def answer_once(model, batch: Sequence, mode: str, gen_cfg, sync, pages: BankPages | None,
                record: bool = False, digests: bool = False) -> dict[str, Any]:
    """One batch answered as ``rollout.rollout`` answers it (greedy, G = 1), each part timed.

    Parts and the calls they time are the module docstring's; ``pages``: also a cold load first.
    With ``record``, what each part processed (``what_was_read``)."""
    from elasticmem.model.generation import generate_answers
    from elasticmem.model.injection import Layout

    def now() -> float:
        sync()
        return time.perf_counter()

    c0, t0 = time.process_time(), now()
    texts = [model.encode_texts(ex) for ex in batch]  # rollout's _query_and_retrieve, its two steps apart
    prompts, suffixes, groups = [x[0] for x in texts], [x[1] for x in texts], [ex.group for ex in batch]
    a, _, h = model._query_states(prompts, [ex.question for ex in batch], 1, True)
    t1 = now()
    rows, scores, mask = model._retrieve(h, groups)
    t2 = now()
    budgets, _, _ = model._budgets(mode, h.detach(), rows, scores, mask, True)
    t = {"query_state": t1 - t0, "search": t2 - t1, "policy": now() - t2}
    out: dict[str, Any] = {}
    if pages is not None:
        out["resident_after_drop"] = pages.drop()
        model._chunk_tokens.clear()  # text: the chunks' token ids are memoised per row
        s = now()
        model._soft_tokens(rows, budgets)
        t["load_cold"] = now() - s
        model._retrieve(h, groups)  # the keys back in memory, or the next search reads them cold (untimed)
    s = now()
    soft, counts = model._soft_tokens(rows, budgets)
    t["load_warm"] = now() - s
    layouts = [Layout(p, None if c < 0 else c, m, x, []) for p, c, m, x in zip(prompts, a.tolist(), soft, suffixes)]
    s = now()
    x = model._assemble(layouts)
    t["assemble"] = now() - s
    seen = what_was_read(rows, budgets, counts, a, x, soft, digests) if record else None  # before x's cache grows
    with ForwardClock(model.base.get_decoder(), sync) as fc:
        s = now()
        ids, _, _ = generate_answers(model.lm, model.base, gen_cfg, x, [], model.tokenizer.pad_token_id, 1.0, True)
        gen = now() - s
    t["prefill"] = fc.calls[0]["t1"] - fc.calls[0]["t0"]
    t["decode"] = gen - t["prefill"]
    # CPU over wall time of the whole call (untimed eviction included): well below 1 = other load, or disk
    out.update(seconds=t, cpu_s=time.process_time() - c0, wall_s=now() - t0)
    if seen is not None:
        out["record"] = {**seen, "forwards": [{k: c[k] for k in ("shape", "past")} for c in fc.calls],
                         "answer_ids": ids.tolist()}
    return out


def what_was_read(rows, budgets, counts, control, x, soft, digests: bool) -> dict[str, Any]:
    """Rows [N, Z], budgets, tokens each memory gave, control tokens, each row's text positions in
    the prefill and its memory slots in the cache (KV), and with ``digests`` [row, count, digest]
    of every memory loaded (the test compares them with ``Bank.gather_kv``)."""
    out = {"rows": rows.tolist(), "budgets": budgets.tolist(), "counts": counts.tolist(), "control": control.tolist(),
           "positions": x.lengths.tolist(),
           "past_per_row": x.past_valid.sum(-1).tolist() if x.past_valid is not None else None}
    if digests:
        used = [[r for r, n in zip(rr, cc) if n > 0] for rr, cc in zip(rows.tolist(), counts.tolist())]
        out["loaded"] = [[[r, int((p.kv if hasattr(p, "kv") else p).shape[0]), piece_digest(p)]
                          for r, p in zip(rs, pieces)] for rs, pieces in zip(used, soft)]
    return out


def matches_greedy(model, batch: Sequence, mode: str, mine: dict[str, Any]) -> bool:
    """Whether the timed path retrieved, loaded and answered as ``ElasticMem.greedy`` (the harness's
    path) does: the same rows, token counts and answer tokens up to greedy's first EOS."""
    traj = model.greedy(list(batch), budgets=mode)
    rec = mine["record"]
    if traj.rows.tolist() != rec["rows"] or traj.soft_counts.tolist() != rec["counts"]:
        return False
    ids = torch.tensor(rec["answer_ids"])
    for i in range(len(batch)):
        n = int(traj.answer_mask[i].sum())
        if ids[i, :n].tolist() != traj.answer_ids[i, :n].tolist():
            return False
    return True


# ---------------------------------------------------------------- data, banks, systems


def examples_and_banks(args, base: list[str]) -> tuple[list, dict[int, Path]]:
    """The first ``max(--batches)`` questions of ``--split`` and a bank per chunk size holding their groups."""
    from elasticmem.backbone import load_backbone
    from elasticmem.bank import Bank, build_bank, resolve_cache_dtype
    from elasticmem.config import load_config
    from elasticmem.data.schema import load_split
    from elasticmem.systems import memory_config

    work = Path(args.work)
    cfg = load_config(args.config, base)
    data_dir = Path(args.data_dir) if args.data_dir else work / "data"
    if not (data_dir / f"{args.split}.jsonl").is_file():
        if args.data == "synthetic":
            from elasticmem.data.synthetic import write_synthetic

            write_synthetic(cfg.data.synthetic, cfg.seed, data_dir)
        else:
            from elasticmem.data.prepare import prepare_real

            prepare_real("locomo-mc10", [args.locomo], str(data_dir))
    split = load_split(data_dir, args.split)
    examples = split[: max(args.batches)]
    groups = {ex.group for ex in examples}
    given = dict(spec.split("=", 1) for spec in args.bank)
    banks, backbone = {}, None
    for C in args.chunk_tokens:
        if str(C) in given:
            banks[C] = Path(given[str(C)])
        else:  # only the questions' groups: a bank of the whole split would take most of the run to build
            ov = bank_overrides(C, work) + base
            cfg = load_config(args.config, ov)
            backbone = backbone or load_backbone(cfg.backbone)
            t0 = time.perf_counter()
            mine = fit_chunks([ex for ex in split if ex.group in groups], backbone.tokenizer, C,
                              cfg.chunking.add_special_tokens)
            res = build_bank({args.split: mine}, backbone, cfg.chunking,
                             cfg.bank, resolve_cache_dtype(cfg.bank.cache_dtype, backbone.device),
                             show_progress=False, memory=memory_config(cfg, ov))
            log(f"bank C={C}: {res.status}, {res.num_chunks} chunks, {time.perf_counter() - t0:.1f} s")
            banks[C] = Path(cfg.bank.dir)
        missing = groups - set(Bank.open(banks[C]).groups)
        if missing:
            raise SystemExit(f"bank {banks[C]} lacks the groups {sorted(missing)[:3]} of the questions")
    return examples, banks


def fit_chunks(examples: list, tokenizer, C: int, special: bool) -> list:
    """``examples`` with each chunk of their histories cut to at most C tokens: the first words of
    each of its turns, the same fraction of each (the largest that fits, by bisection).

    Why not ``chunking.max_tokens`` alone: the bank truncates a chunk's tokens there, but text RAG
    reads the chunk's whole text (``chunks.jsonl``), so the two would read different memories. A
    chunk that does not fit even at one word a turn is left to the bank's truncation."""
    from elasticmem.data.chunking import chunk_history, format_chunk

    def cut(turns: list, f: float) -> list:
        return [dataclasses.replace(t, content=" ".join(t.content.split()[: max(1, round(f * len(t.content.split())))]))
                for t in turns]

    def fits(turns: list) -> bool:
        return len(tokenizer(format_chunk(turns), add_special_tokens=special)["input_ids"]) <= C

    done: dict[str, list] = {}
    for ex in examples:
        if ex.group in done:
            continue
        history = [list(s) for s in ex.history]
        for ch in chunk_history(ex.history, ex.group):
            turns = [history[ch.session][i] for i in ch.turns]
            if fits(turns):
                continue
            lo, hi = 0.0, 1.0
            for _ in range(10):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if fits(cut(turns, mid)) else (lo, mid)
            for i, t in zip(ch.turns, cut(turns, lo)):
                history[ch.session][i] = t
        done[ex.group] = history
    return [dataclasses.replace(ex, history=done[ex.group]) for ex in examples]


def bank_overrides(C: int, work: Path) -> list[str]:
    return [f"chunking.max_tokens={C}", f"bank.n_cache={C}", "bank.kv_cache=true", "bank.hidden_cache=true",
            f"bank.dir={work / f'bank_{C}'}", f"memory.policy.max_budget={C}"]


def build_systems(args, base: list[str], bank: Path, names: list[str]) -> dict[str, Any]:
    """{system: its ElasticMem model} (``build_system``, as evaluate.py builds them), on ``bank``."""
    from accelerate.utils import set_seed

    from elasticmem.config import Config
    from elasticmem.systems import build_system
    from elasticmem.utils.configuration import load

    models = {}
    for name in names:
        ov = [f"bank.dir={bank}", *base, *SYSTEMS[name][0]]
        if name != "none":  # no_memory pins top_z=0; the others are built at the largest Z (KV's rotary needs Z > 0)
            ov.append(f"memory.top_z={max(args.zs)}")
        # the checkpoint keeps its own policy and B_max; at the largest C the others read every stored slot
        ov.append(f"eval.checkpoint={args.checkpoint}" if name == "kv_learned"
                  else f"memory.policy.max_budget={max(args.chunk_tokens)}")
        cfg = load(Config, args.config, ov)
        set_seed(cfg.seed)
        models[name] = build_system(cfg, ov).model
    return models


def use_bank(models: dict[str, Any], bank) -> None:
    """Every system reads ``bank`` (one open snapshot per chunk size, shared, as one server's
    systems would share it): ``ElasticMem.refresh_bank``, the library's switch to another bank of the
    same encoder and keys (the index is made anew, text's token memo emptied)."""
    for m in models.values():
        m.refresh_bank(bank)


# ---------------------------------------------------------------- the run


def sync_of(device: torch.device):
    """What each clock read waits for first: the device's queued work (CUDA), nothing on the CPU."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def run(args, base: list[str]) -> dict[str, Any]:
    """Every cell, every system, ``--repeats`` times (fewer where ``--minutes`` would pass); returns
    ``summarize``'s report. Repeats are the outer loop, so a run stopped early has every cell alike."""
    from elasticmem.bank import Bank
    from elasticmem.model.generation import decoding_config

    start = time.monotonic()
    examples, paths = examples_and_banks(args, base)
    names = [n for n in SYSTEMS if n in args.systems and (n != "kv_learned" or args.checkpoint)]
    models = build_systems(args, base, next(iter(paths.values())), names)
    some = next(iter(models.values()))
    banks = {C: Bank.open(path, expect_fingerprint=some.fingerprint) for C, path in paths.items()}
    if "hidden" in models and not all(b.hidden_cache for b in banks.values()):
        raise SystemExit("a bank holds no hidden-state cache: leave 'hidden' out of --systems")
    pages, sync = {C: BankPages(b) for C, b in banks.items()}, sync_of(some.device)
    acc: dict[str, Any] = {"cells": {}, "samples": {}, "checks": {}, "repeats": 0}
    try:
        acc["cold"] = {"possible": True, "method": "madvise(MADV_DONTNEED) + posix_fadvise(POSIX_FADV_DONTNEED)",
                       "resident_after_first_drop": [p.drop() for p in pages.values()]}
    except OSError as e:  # no /proc, or madvise refused: warm loads only
        acc["cold"], pages = {"possible": False, "why": str(e)}, {C: None for C in banks}
    cfg0 = {n: m.cfg for n, m in models.items()}
    gen = {n: decoding_config(dataclasses.replace(m.cfg, max_new_tokens=args.new_tokens), m.tokenizer, [], 1.0, True)
           for n, m in models.items()}  # no EOS id: every answer decodes --new-tokens tokens
    batch = examples[: args.check_batch or min(args.batches)]
    for C, bank in banks.items():
        use_bank(models, bank)
        for n, m in models.items():
            # warm-up (first calls allocate, memoise, read the bank) by the harness's own path, and the
            # check that the timed path is that path, at the largest Z
            m.cfg = dataclasses.replace(cfg0[n], top_z=m.cfg.top_z and max(args.zs), max_new_tokens=args.new_tokens)
            mine = answer_once(m, batch, SYSTEMS[n][1], gen[n], sync, None, record=True)
            acc["checks"][f"c{C}/{n}"] = ok = matches_greedy(m, batch, SYSTEMS[n][1], mine)
            if not ok:
                log(f"WARNING: c{C}/{n}: the timed path differs from ElasticMem.greedy")
    for r in range(args.repeats):
        t0 = time.monotonic()
        for C, bank in banks.items():
            use_bank(models, bank)
            one_repeat(args, r, C, models, cfg0, gen, examples, sync, pages[C], acc)
        acc["repeats"] = r + 1
        now = time.monotonic()
        log(f"repeat {r + 1}/{args.repeats} in {now - t0:.0f} s, {(now - start) / 60:.1f} min in all "
            f"(load average {os.getloadavg()[0]:.2f})")
        if args.minutes and r + 1 < args.repeats and (now - start) + (now - t0) > 60 * args.minutes:
            log(f"stopping after {r + 1} repeats: another would end past --minutes {args.minutes}")
            break
    return summarize(args, examples, acc)


def one_repeat(args, r: int, C: int, models: dict[str, Any], cfg0: dict, gen: dict, examples: list, sync,
               pages: BankPages | None, acc: dict[str, Any]) -> None:
    """Every cell of chunk size C once, each cell's systems one after another in an order that
    rotates with the repeat ``r``; the first repeat also records what each read."""
    names = list(models)
    for Z in args.zs:
        for b in args.batches:
            for n in names[r % len(names):] + names[: r % len(names)]:
                if n == "none" and Z != args.zs[0]:
                    continue  # Z does not change a model that retrieves nothing: one cell per batch
                z = 0 if n == "none" else Z
                key = f"c{C}_z{z}_b{b}"
                models[n].cfg = dataclasses.replace(cfg0[n], top_z=z)
                first = (key, n) not in acc["samples"]
                res = answer_once(models[n], examples[:b], SYSTEMS[n][1], gen[n], sync, pages, record=first,
                                  digests=args.record_loads)
                acc["samples"].setdefault((key, n), []).append(res)
                if first:
                    bank = str(models[n].bank.root)
                    cell = acc["cells"].setdefault(key, {"chunk_tokens": C, "z": z, "batch": b, "bank": bank,
                                                         "records": {}})
                    cell["records"][n] = res.pop("record")


def summarize(args, examples: list, acc: dict[str, Any]) -> dict[str, Any]:
    """Medians per question for every (cell, system); ratios to text RAG per cell."""
    from elasticmem.bank import Bank

    cells = acc["cells"]
    for (key, n), runs in acc["samples"].items():
        cells[key].setdefault("systems", {})[n] = system_summary(runs, cells[key]["records"][n], cells[key]["batch"])
    chunks_of = {b: Bank.open(b).chunks() for b in {c["bank"] for c in cells.values()}}  # each bank's once
    for c in cells.values():
        s = c["systems"]
        for n in ("kv_max", "kv_learned", "hidden"):
            if n in s and "text" in s:
                c[f"{n}_over_text"] = s[n]["per_question_s"]["total_warm"] / s["text"]["per_question_s"]["total_warm"]
        recs = c["records"]
        rows = [r for row in (recs.get("text") or recs.get("kv_max") or {"rows": []})["rows"] for r in row if r >= 0]
        chunks = chunks_of[c["bank"]]
        c["mean_chunk_tokens"] = sum(chunks[r]["n_tokens"] for r in rows) / len(rows) if rows else 0.0
    return {"settings": {k: v for k, v in vars(args).items() if k not in ("write_readme", "from_json")},
            "threads": torch.get_num_threads(), "cpu": cpu_name(), "load_average_end": os.getloadavg(),
            "questions": [ex.id for ex in examples], "repeats_done": acc["repeats"], "matches_greedy": acc["checks"],
            "cold": acc["cold"], "cells": cells}


def added_over_text(cells: dict[str, dict[str, Any]]) -> None:
    """Per memory cell, ``{system}_added_over_text``: the time a memory adds to answering without one,
    over text's: what is left once the floor every system pays (the prompt's prefill, decoding) is
    taken out of both."""
    for c in cells.values():
        none = cells.get(f"c{c['chunk_tokens']}_z0_b{c['batch']}", {}).get("systems", {}).get("none")
        s = c["systems"]
        if not c["z"] or none is None or "text" not in s:
            continue
        floor = none["per_question_s"]["total_warm"]
        for n in ("kv_max", "kv_learned", "hidden"):
            if n in s:
                c[f"{n}_added_over_text"] = ((s[n]["per_question_s"]["total_warm"] - floor)
                                             / (s["text"]["per_question_s"]["total_warm"] - floor))


def system_summary(runs: list[dict[str, Any]], rec: dict[str, Any], b: int) -> dict[str, Any]:
    """One system in one cell: each part's median per question (a batch's seconds / ``b``), the totals
    with a warm and a cold load, and what a question read (``rec``: the first repeat's record)."""
    parts = {p: med([x["seconds"][p] for x in runs if p in x["seconds"]]) / b for p in PARTS}
    parts["retrieval"] = parts["query_state"] + parts["search"] + parts["policy"]
    parts["total_warm"] = parts["retrieval"] + sum(parts[p] for p in ("load_warm", "assemble", "prefill", "decode"))
    parts["total_cold"] = parts["total_warm"] - parts["load_warm"] + parts["load_cold"]
    held = [x["resident_after_drop"] for x in runs if x.get("resident_after_drop") is not None]
    return {"per_question_s": parts, "runs": [x["seconds"] for x in runs],
            "cpu_share": med([x["cpu_s"] / x["wall_s"] for x in runs]),
            "memory_tokens": sum(map(sum, rec["counts"])) / b,
            "prefill_positions": sum(rec["positions"]) / b,
            "prefill_past": sum(rec["past_per_row"]) / b if rec["past_per_row"] is not None else 0,
            "resident_after_drop": max(held) if held else None}


# ---------------------------------------------------------------- tables


def table_specs(rep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The two results files' ``data`` and ``table`` (templates over ``data``, gen_results_tables.py)."""
    cells = {k: {kk: vv for kk, vv in c.items() if kk not in ("records", "bank")} for k, c in rep["cells"].items()}
    for c in cells.values():
        c["systems"] = {n: {k: v for k, v in s.items() if k != "runs"} for n, s in c["systems"].items()}
    added_over_text(cells)
    data = {"cells": cells, "cold": rep["cold"], "threads": rep["threads"], "cpu": rep["cpu"],
            "new_tokens": rep["settings"]["new_tokens"], "repeats": rep["repeats_done"]}
    present = [n for n in SYSTEMS if any(n in c["systems"] for c in cells.values())]
    mem = [n for n in present if n != "none"]
    memory_cells = sorted((k for k, c in cells.items() if c["z"] > 0),
                          key=lambda k: (cells[k]["chunk_tokens"], cells[k]["batch"], cells[k]["z"]))

    def q(key: str, n: str, part: str, fmt: str = ".3f") -> str:
        return f"{{cells[{key}][systems][{n}][per_question_s][{part}]:{fmt}}}" if n in cells[key]["systems"] else "-"

    head = ["chunk tokens (mean)", "Z", "batch", *[LABELS[n] for n in present]]
    if "text" in present:
        head += [f"{LABELS[n]} / text RAG" for n in ("kv_max", "kv_learned") if n in present]
        head += [f"{LABELS[n]} / text RAG, time added to no memory" for n in ("kv_max", "kv_learned") if n in present]
    rows = []
    for k in memory_cells:
        c = cells[k]
        row = [f"{c['chunk_tokens']} ({{cells[{k}][mean_chunk_tokens]:.0f}})", str(c["z"]), str(c["batch"])]
        for n in present:
            nk = f"c{c['chunk_tokens']}_z0_b{c['batch']}" if n == "none" else k
            row.append(q(nk, n, "total_warm") if nk in cells else "-")
        if "text" in present:
            row += [f"{{cells[{k}][{n}_over_text]:.2f}}x" for n in ("kv_max", "kv_learned") if n in present]
            row += [f"{{cells[{k}][{n}_added_over_text]:.2f}}x" if "none" in present else "-"
                    for n in ("kv_max", "kv_learned") if n in present]
        rows.append(row)
    split_head = ["chunk", "Z", "batch", "system", "memory tokens", "prefill positions (+ cached)", "retrieval ms",
                  "load warm ms", "load cold ms", "assemble ms", "prefill ms", "decode ms", "total ms"]
    split_rows = []
    for k in sorted(cells, key=lambda k: (cells[k]["chunk_tokens"], cells[k]["batch"], cells[k]["z"])):
        c = cells[k]
        for n in (mem if c["z"] else ["none"]):
            if n not in c["systems"]:
                continue
            s = f"{{cells[{k}][systems][{n}]"
            read = s + "[prefill_positions]:.0f} (+ " + s + "[prefill_past]:.0f})"
            split_rows.append([str(c["chunk_tokens"]), str(c["z"]), str(c["batch"]), LABELS[n],
                               s + "[memory_tokens]:.0f}", read,
                               *[q(k, n, p, "ms.1f") for p in ("retrieval", "load_warm", "load_cold", "assemble",
                                                                "prefill", "decode", "total_warm")]])
    return {RESULTS[0]: {"data": data, "table": {"header": head, "rows": rows}},
            RESULTS[1]: {"data": data, "table": {"header": split_head, "rows": split_rows}}}


def results_tables():
    """scripts/gen_results_tables.py, which renders every published table from its results file."""
    sys.path.insert(0, str(REPO / "scripts"))
    import gen_results_tables

    return gen_results_tables


def write_readme(rep: dict[str, Any], readme: Path, results_dir: Path) -> None:
    """Write the results files and put their tables into ``readme`` (between their markers, or in
    place of ``PLACEHOLDER`` the first time)."""
    gen = results_tables()
    text = readme.read_text()
    blocks = []
    for name, spec in table_specs(rep).items():
        spec = {"command": rep["command"], "commit": rep["commit"],
                "provenance": "benchmarks/answer_time.py --write-readme: medians per question from the run's own "
                              "output (--out), trimmed to them", **spec}
        path = results_dir / f"{Path(name).name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(spec, indent=1) + "\n")
        block = f"<!-- results:{name} -->\n{gen.render(spec)}<!-- /results -->"
        marked = re.compile(rf"<!-- results:{re.escape(name)} -->\n.*?<!-- /results -->", re.S)
        if marked.search(text):
            text = marked.sub(lambda _: block, text)
        else:
            blocks.append(block)
    if blocks:
        if PLACEHOLDER not in text:
            raise SystemExit(f"{readme}: neither the tables' markers nor the placeholder {PLACEHOLDER!r}")
        text = text.replace(PLACEHOLDER, "\n\n".join(blocks))
    readme.write_text(text)
    log(f"wrote {readme} and {results_dir}/answer_time*.json")


def print_tables(rep: dict[str, Any]) -> None:
    for spec in table_specs(rep).values():
        log(results_tables().render({"command": "", "commit": "", "provenance": "", **spec}))


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "locomo_mc10.yaml"))
    p.add_argument("--locomo", default=str(REPO.parent / "shared" / "data" / "locomo10.json"),
                   help="locomo10.json (--data locomo)")
    p.add_argument("--data", choices=("locomo", "synthetic"), default="locomo",
                   help="locomo: --locomo prepared as LoCoMo MC-10; synthetic: the config's data.synthetic")
    p.add_argument("--data-dir", help="prepared data to use instead of preparing it into --work")
    p.add_argument("--split", default="test")
    p.add_argument("--work", default="runs/bench/answer_time_work", help="data and banks are made here")
    p.add_argument("--bank", action="append", default=[], metavar="C=PATH", help="reuse this bank for chunk size C")
    p.add_argument("--checkpoint", help="also time this checkpoint's learned budgets (kv_learned)")
    p.add_argument("--chunk-tokens", type=int, nargs="+", default=[40, 128])
    p.add_argument("--zs", type=int, nargs="+", default=[4, 8, 20])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    p.add_argument("--new-tokens", type=int, default=16, help="tokens every system decodes (EOS disabled)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--check-batch", type=int, help="questions of the warm-up's check against greedy "
                   "(default: the smallest batch)")
    p.add_argument("--minutes", type=float, help="do no further repeat (after the first) that would end "
                   "past this many minutes from the start")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--record-loads", action="store_true", help="record a digest of every loaded memory (tests)")
    p.add_argument("--out", help="the results JSON")
    p.add_argument("--from-json", help="a results JSON of an earlier run: tables only, nothing is timed")
    p.add_argument("--write-readme", action="store_true", help="write the tables into --readme and --results-dir")
    p.add_argument("--readme", default=str(REPO / "benchmarks" / "README.md"))
    p.add_argument("--results-dir", default=str(REPO / "docs" / "results" / "benchmarks"))
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every system")
    args = p.parse_intermixed_args(argv)
    if args.write_readme and not (args.out or args.from_json):
        p.error("--write-readme publishes a results file, which records the run's command: give --out")
    if args.from_json:
        rep = json.loads(Path(args.from_json).read_text())
    else:
        torch.set_num_threads(args.threads)
        # no trained map unless one is given; the preset's checkpoint is kv_learned's only (--checkpoint)
        base = ["memory.retrieval_map=null", "eval.checkpoint=null", *args.overrides]
        log(f"answer time: {args.config}, C {args.chunk_tokens}, Z {args.zs}, batches {args.batches}, "
            f"{args.repeats} repeats, threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}")
        with torch.no_grad():
            rep = run(args, base)
        if args.out:
            write_json(args.out, rep, __file__, argv)
            rep = json.loads(Path(args.out).read_text())
        else:
            rep = {"command": None, "commit": None, **rep}
    print_tables(rep)
    if args.write_readme:
        write_readme(rep, Path(args.readme), Path(args.results_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
