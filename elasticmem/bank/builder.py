"""Encode memory chunks into a bank (DESIGN.md section 1.1; the keys' and caches' math is in
``elasticmem.bank.encoding``).

Rows are split into fixed shards. Each shard is encoded in length-sorted,
right-padded batches (right padding leaves every real position's state as in
an unpadded forward pass, so results do not depend on batch size), written to
a temporary file and renamed, and recorded in ``.build/``; an interrupted
build skips finished shards. Processes started by ``accelerate launch`` take
shards round-robin; the main process writes the manifest once all are done.

The manifest's ``groups_sha256`` records, per group, ``chunks_fingerprint`` of
the group's chunk texts in row order (computed from the plan, so every process,
shard layout and resumed build records the same). With ``tokenization`` and the
encoder fingerprint it pins what the bank encodes: ``elasticmem.data.validate``
compares it with the chunks of the examples about to be used. Running the
builder again on a finished bank of the same plan that lacks it (built by an
older version) records it without encoding anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from safetensors.torch import save as st_save
from tqdm.auto import tqdm

from elasticmem.bank.encoding import (KEY_VARIANTS, PAPER_KEY, encode_batch, key_spec, key_states, pool_key,
                                      prompt_key_ids)
from elasticmem.bank.kv import kv_spec, rotary_module
from elasticmem.bank.kv_store import (KVFormat, bytes_by_part, cat_rows, content_record, encode_rows, split_rows,
                                      storage_fields, storage_of)
from elasticmem.bank.manifest import CHUNKS, FORMAT_VERSION, GROUPS_SHA256, MANIFEST, BankError
from elasticmem.bank.store import Bank, shard_name
from elasticmem.config import BankConfig, ChunkingConfig, KVScheme, MemoryConfig
from elasticmem.data.chunking import Chunk, chunk_history, chunks_fingerprint, history_fingerprint, tokenize_chunks
from elasticmem.data.schema import Example, SchemaError
from elasticmem.utils.configuration import ConfigError

BUILD_DIR = ".build"


# --------------------------------------------------------------------------- planning


@dataclass
class Plan:
    """Everything that determines the bank's content, fixed before encoding."""

    chunks: list[Chunk]
    token_ids: list[list[int]]
    groups: dict[str, tuple[int, int]]
    shard_bounds: list[tuple[int, int]]
    header: dict[str, Any]
    """Manifest fields known before encoding (encoder, shapes, tokenization)."""
    plan_id: str
    groups_sha256: dict[str, str]
    """``chunks_fingerprint`` of each group's chunks (not part of ``plan_id``, which predates it)."""
    key_ids: list[list[int]] | None = None
    """For ``prompt`` keys: the token ids of each chunk wrapped in the key template."""


def collect_groups(examples_by_split: dict[str, list[Example]]) -> dict[str, Example]:
    """First example of each group, in order of appearance; a group's examples must share a history."""
    first: dict[str, Example] = {}
    digests: dict[str, str] = {}
    for split, examples in examples_by_split.items():
        for ex in examples:
            d = hashlib.sha256(
                json.dumps([[t.to_json() for t in s] for s in ex.history], sort_keys=True).encode()
            ).hexdigest()
            if ex.group not in first:
                first[ex.group], digests[ex.group] = ex, d
            elif digests[ex.group] != d:
                raise SchemaError(
                    f"split '{split}', example {ex.id!r}: group {ex.group!r} has a different history than "
                    f"example {first[ex.group].id!r}; examples of one group must share one history"
                )
    return first


def make_plan(
    examples_by_split: dict[str, list[Example]],
    tokenizer,
    chunking: ChunkingConfig,
    bank_cfg: BankConfig,
    encoder: dict[str, str],
    hidden_size: int,
    cache_dtype: str,
    kv: dict[str, int] | None = None,
    hidden_cache: bool = True,
    kv_format: KVFormat | None = None,
) -> Plan:
    """The chunks, rows, shards and manifest header of a build (``kv``: ``kv_spec`` of the
    encoder when ``bank.kv_cache`` is on; ``hidden_cache``, ``kv_format``: ``storage_of``, whose
    default for ``kv_format`` is the padded layout of banks built before it)."""
    groups_first = collect_groups(examples_by_split)
    if not groups_first:
        raise SchemaError("no examples found: the bank would be empty")
    chunks: list[Chunk] = []
    groups: dict[str, tuple[int, int]] = {}
    groups_sha256: dict[str, str] = {}
    for g, ex in groups_first.items():
        cs = chunk_history(ex.history, g)
        if not cs:
            raise SchemaError(f"example {ex.id!r} (group {g!r}) has no turns: nothing to remember")
        groups[g] = (len(chunks), len(chunks) + len(cs))
        groups_sha256[g] = chunks_fingerprint([c.text for c in cs])
        chunks.extend(cs)
    token_ids = tokenize_chunks(
        [c.text for c in chunks], tokenizer, chunking.max_tokens, chunking.truncation_side, chunking.add_special_tokens
    )
    if bank_cfg.shard_rows < 1 or bank_cfg.n_cache < 1 or bank_cfg.batch_size < 1:
        raise ValueError("bank.shard_rows, bank.n_cache and bank.batch_size must be >= 1")
    n = len(chunks)
    bounds = [(a, min(a + bank_cfg.shard_rows, n)) for a in range(0, n, bank_cfg.shard_rows)]
    header = {
        "format_version": FORMAT_VERSION,
        "encoder": encoder,
        "hidden_size": hidden_size,
        "n_cache": bank_cfg.n_cache,
        "cache_dtype": cache_dtype,
        "num_chunks": n,
        "tokenization": {
            "add_special_tokens": chunking.add_special_tokens,
            "max_tokens": chunking.max_tokens,
            "truncation_side": chunking.truncation_side,
        },
    }
    key = key_spec(bank_cfg)
    # The paper's key leaves the plan hash as it was before banks recorded their key, so a bank
    # built then is recognised as finished ("already built"), not as a different bank.
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    if key != PAPER_KEY:
        h.update(json.dumps(key, sort_keys=True).encode())
    header["key"] = key
    if bank_cfg.content_layer != -1:  # absent = the paper's final layer, as in banks built before
        header["content_layer"] = int(bank_cfg.content_layer)
        h.update(json.dumps({"content_layer": header["content_layer"]}).encode())
    if kv is not None and kv_format is None:  # the layout of banks built before storage_of
        kv_format = KVFormat(KVScheme(bank_cfg.kv_dtype), bank_cfg.n_cache, "padded")
    storage = storage_fields(hidden_cache, kv_format if kv is not None else None, kv)
    if "kv" in storage:  # absent = hidden states only, as in banks built before
        # how the states are stored (layout, integer codes) is not hashed: a plan is what is encoded
        h.update(json.dumps({"kv": content_record(storage["kv"], bank_cfg.n_cache)}, sort_keys=True).encode())
    header.update(storage)
    key_ids = None
    if key["variant"] == "prompt":
        key_ids = prompt_key_ids(tokenizer, [c.text for c in chunks], token_ids, key["template"],
                                 chunking.max_tokens, chunking.add_special_tokens)
    h.update(json.dumps(groups, sort_keys=True).encode())
    h.update(json.dumps(bounds).encode())
    for ids in token_ids:
        h.update(len(ids).to_bytes(4, "little"))
        h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    return Plan(chunks, token_ids, groups, bounds, header, h.hexdigest(), groups_sha256, key_ids)


# --------------------------------------------------------------------------- writing


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    _atomic_write_bytes(path, text.encode("utf-8"))


def encode_shard(
    decoder: torch.nn.Module,
    token_ids: Sequence[Sequence[int]],
    n_cache: int,
    batch_size: int,
    pad_id: int,
    cache_dtype: torch.dtype,
    progress: Callable[[int], None] | None = None,
    key: dict[str, Any] | None = None,
    key_ids: Sequence[Sequence[int]] | None = None,
    content_layer: int = -1,
    kv_dtype: torch.dtype | None = None,
    kv_format: KVFormat | None = None,
    hidden_cache: bool = True,
) -> dict[str, torch.Tensor]:
    """Encode one shard's rows (in order) into CPU tensors ``keys``, ``cache`` (with
    ``hidden_cache``), ``cache_len`` (``key``, ``key_ids``, ``content_layer``: as in
    ``encode_batch``, for the shard's rows), and the per-layer KV tensors of ``kv_format``
    (``elasticmem.bank.kv_store``; ``kv_dtype`` alone: the padded layout at that float dtype)."""
    if kv_format is None and kv_dtype is not None:
        if not kv_dtype.is_floating_point:
            raise ValueError(f"kv_dtype {kv_dtype} is not a float dtype: pass the bank's kv_format for integer codes")
        kv_format = KVFormat(KVScheme(str(kv_dtype).removeprefix("torch.")), n_cache, "padded")
    n = len(token_ids)
    d = decoder.config.hidden_size
    keys = torch.empty(n, d, dtype=torch.float32)
    cache = torch.empty(n, n_cache, d, dtype=cache_dtype)
    cache_len = torch.empty(n, dtype=torch.int32)
    kv_rows: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    order = sorted(range(n), key=lambda i: -len(token_ids[i]))  # length-sorted: little padding
    with torch.inference_mode():
        for a in range(0, n, batch_size):
            idx = order[a : a + batch_size]
            k, c, cl, *rest = encode_batch(decoder, [token_ids[i] for i in idx], n_cache, pad_id, key,
                                           None if key_ids is None else [key_ids[i] for i in idx], content_layer,
                                           kv=kv_format is not None)
            c = c.to(cache_dtype)
            checks = [("cache", c, cache_dtype)]
            if rest:  # integer codes quantize the float16 states (elasticmem.bank.quant)
                kv_cast = torch.float16 if kv_format.scheme.quantized else getattr(torch, kv_format.dtype)
                checks.append(("kv", rest[0].to(kv_cast), kv_cast))
            for name, x, dtype in checks:
                if not torch.isfinite(x).all():
                    raise FloatingPointError(f"non-finite values after casting the {name} to {dtype}; "
                                             f"use bank.{'cache' if name == 'cache' else 'kv'}_dtype=float32 or bfloat16")
            t = torch.as_tensor(idx)
            keys[t], cache[t], cache_len[t] = k.cpu(), c.cpu(), cl.cpu()
            if rest:
                counts = torch.tensor([len(token_ids[i]) - 1 for i in idx]).clamp(0, kv_format.slots)
                block = {name: x.cpu() for name, x in encode_rows(rest[0], counts, kv_format).items()}
                for i, row in zip(idx, split_rows(block)):
                    kv_rows[i] = row
            if progress is not None:
                progress(len(idx))
    out = {"keys": keys, **({"cache": cache} if hidden_cache else {}), "cache_len": cache_len}
    return out if kv_format is None else {**out, **cat_rows(kv_rows)}


def _write_shard(
    out: Path, i: int, tensors: dict[str, torch.Tensor], plan_id: str, process: int = 0
) -> dict[str, Any]:
    data = st_save(tensors, metadata={"plan_id": plan_id})
    digest = hashlib.sha256(data).hexdigest()
    _atomic_write_bytes(out / shard_name(i), data)
    rec = {"file": shard_name(i), "rows": int(tensors["keys"].shape[0]), "sha256": digest, "bytes": len(data),
           "process": process, "tensor_bytes": bytes_by_part(tensors)}
    _atomic_write_text(out / BUILD_DIR / f"{shard_name(i)}.json", json.dumps(rec))
    return rec


def _done_record(out: Path, i: int) -> dict[str, Any] | None:
    """The record of a finished shard, if its file is there with the recorded size."""
    rec_path = out / BUILD_DIR / f"{shard_name(i)}.json"
    if not rec_path.is_file():
        return None
    try:
        rec = json.loads(rec_path.read_text())
    except json.JSONDecodeError:
        return None
    f = out / rec["file"]
    return rec if f.is_file() and f.stat().st_size == rec["bytes"] else None


def _prepare_dir(out: Path, plan: Plan, overwrite: bool, is_main: bool) -> str:
    """Decide what to do with the output folder: 'done', 'resume' or 'fresh'."""
    manifest = out / MANIFEST
    state = out / BUILD_DIR / "plan.json"
    if manifest.is_file() and not overwrite:
        old = json.loads(manifest.read_text())
        if old.get("build", {}).get("plan_id") == plan.plan_id:
            _check_storage(out, old, plan.header)
            return "done"
        raise BankError(
            f"{out} already holds a different bank (other encoder, data or settings); "
            f"set bank.overwrite=true to replace it or choose another bank.dir"
        )
    if state.is_file() and not overwrite:
        started = json.loads(state.read_text())
        if started.get("plan_id") == plan.plan_id:
            if _storage(started.get("header", {})) != _storage(plan.header):
                raise BankError(f"{out} holds an unfinished build of this bank stored otherwise "
                                f"({_storage_text(started['header'])}; now {_storage_text(plan.header)}): "
                                f"set bank.overwrite=true to discard it")
            return "resume"
        raise BankError(
            f"{out} holds an unfinished build of a different bank; set bank.overwrite=true to discard it"
        )
    if is_main:
        if out.exists():
            for p in out.iterdir():
                if p.name in (MANIFEST, CHUNKS, BUILD_DIR, "index.faiss", "index.json", "config.yaml") or (
                    p.name.startswith(("shard-", "chunks-"))
                ):
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
        (out / BUILD_DIR).mkdir(parents=True, exist_ok=True)
        _atomic_write_text(state, json.dumps({"plan_id": plan.plan_id, "header": plan.header}))
    return "fresh"


def _storage(header: dict[str, Any]) -> tuple[bool, KVFormat | None]:
    """What a manifest (or a plan's header) says its shards store besides keys: ``storage_of``'s pair."""
    return bool(header.get("hidden_cache", True)), KVFormat.of(header)


def _storage_text(header: dict[str, Any]) -> str:
    hidden, fmt = _storage(header)
    return (f"hidden-state cache {'stored' if hidden else 'not stored'}"
            + (f", per-layer KV {fmt.describe()}" if fmt else ""))


def _check_storage(out: Path, manifest: dict[str, Any], header: dict[str, Any]) -> None:
    """A finished bank of this plan: refused when it lacks what the build asks for (a hidden cache,
    per-layer KV at the asked dtype); its layout may differ (a bank built before the ragged one)."""
    (had, old), (want, new) = _storage(manifest), _storage(header)
    if want and not had:
        raise BankError(f"{out} holds this bank without the hidden-state cache, which bank.hidden_cache asks for: "
                        f"set bank.overwrite=true to rebuild it")
    if old and new and old.scheme != new.scheme:
        raise BankError(f"{out} holds this bank with per-layer KV stored as {old.describe()}, but the config asks "
                        f"for {new.describe()}: convert it (build_bank.py --config ... --convert) or set "
                        f"bank.overwrite=true to rebuild it")
    if (had, old) != (want, new):
        print(f"note: {out} holds this bank stored as built then ({_storage_text(manifest)}; this build would store "
              f"{_storage_text(header)}): kept; bank.overwrite=true rebuilds it", file=sys.stderr)


@contextlib.contextmanager
def _dir_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on the folder itself (a lock file inside would be wiped by a fresh
    build's cleanup while held)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _write_chunks(out: Path, plan: Plan) -> None:
    lines = []
    for row, (c, ids) in enumerate(zip(plan.chunks, plan.token_ids)):
        rec = {"row": row, "group": c.group, "text": c.text, "n_tokens": len(ids),
               "session": c.session, "turns": list(c.turns)}
        lines.append(json.dumps(rec, ensure_ascii=False))
    _atomic_write_text(out / CHUNKS, "\n".join(lines) + "\n")


def _record_fingerprints(out: Path, plan: Plan) -> None:
    """A finished bank of this plan whose manifest lacks this data's chunk fingerprints (an older
    version's bank, or texts that differ only past the token cap): its rows are exactly what this
    data gives, so record the chunk texts and their fingerprints without encoding anything."""
    manifest = json.loads((out / MANIFEST).read_text())
    if manifest.get(GROUPS_SHA256) == plan.groups_sha256 or manifest.get("build", {}).get("appends"):
        return  # an appended bank records its fingerprints, and holds more than this plan's chunks
    _write_chunks(out, plan)
    manifest[GROUPS_SHA256] = plan.groups_sha256
    _atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))


def bytes_per_chunk(shards: list[dict[str, Any]], rows: int) -> dict[str, int]:
    """Mean tensor bytes a row of the shards' records (``_write_shard``) by part (``bytes_by_part``)
    and in all; a shard recorded before records had parts counts its file size as ``total``."""
    parts = {"keys": 0, "cache": 0, "kv": 0}
    total = 0
    for r in shards:
        tb = r.get("tensor_bytes") or {}
        for k in parts:
            parts[k] += int(tb.get(k, 0))
        total += sum(int(v) for v in tb.values()) if tb else int(r["bytes"])
    return {**{k: round(v / max(rows, 1)) for k, v in parts.items()}, "total": round(total / max(rows, 1))}


@dataclass
class BuildResult:
    bank_dir: Path
    status: str
    """'built', 'resumed' or 'already built'."""
    num_chunks: int
    num_groups: int
    num_tokens: int
    shards_encoded: int
    seconds: float


def build_bank(
    examples_by_split: dict[str, list[Example]],
    backbone,
    chunking: ChunkingConfig,
    bank_cfg: BankConfig,
    cache_dtype: torch.dtype,
    state=None,
    show_progress: bool = True,
    memory: MemoryConfig | None = None,
) -> BuildResult:
    """Build (or resume, or confirm) the bank in ``bank_cfg.dir``.

    ``memory``: the config's ``memory`` section (the reader the bank is for), which decides what is
    stored besides the keys (``storage_of``); None keeps the hidden cache and ``n_cache`` KV slots.

    ``state`` is an ``accelerate.PartialState`` (or anything with ``process_index``,
    ``num_processes``, ``is_main_process``, ``wait_for_everyone()``); None = one process.
    With ``bank_cfg.part`` = 'K/N' this call is one of N independent jobs (no shared barrier):
    it prepares the folder under a file lock, encodes the shards i % N == K and returns with
    status 'part K/N'; a later call without ``part`` writes the manifest.
    """
    t0 = time.perf_counter()
    part = bank_cfg.part_index()
    if part is not None and state is not None and state.num_processes > 1:
        raise ConfigError("bank.part splits a build over separate jobs (a job array); with accelerate launch the "
                          "processes already split it: drop one of the two")
    rank, world = (state.process_index, state.num_processes) if state is not None else (0, 1)
    if part is not None:
        rank, world = part
    is_main = rank == 0 and part is None
    barrier = state.wait_for_everyone if state is not None else (lambda: None)
    out = Path(bank_cfg.dir)
    encoder = {
        "name_or_path": backbone.name_or_path,
        "fingerprint": backbone.fingerprint,
        "dtype": str(next(backbone.model.parameters()).dtype).removeprefix("torch."),
    }
    n = backbone.model.config.num_hidden_layers  # hidden_states holds n + 1 entries
    for name, layers in (("key_layers", bank_cfg.key_layers if bank_cfg.key == "layer_mean" else []),
                         ("content_layer", [bank_cfg.content_layer])):
        bad = [x for x in layers if not -(n + 1) <= int(x) <= n]
        if bad:
            raise ValueError(f"bank.{name} {bad} out of range for {backbone.name_or_path} ({n} layers: "
                             f"hidden_states indices 0..{n}, or negative from the end)")
    if bank_cfg.kv_cache:
        rotary_module(backbone.model.get_decoder())  # a model without rotary embeddings: refused before encoding
    hidden_cache, kv_format = storage_of(bank_cfg, memory)
    plan = make_plan(
        examples_by_split, backbone.tokenizer, chunking, bank_cfg, encoder,
        backbone.hidden_size, str(cache_dtype).removeprefix("torch."),
        kv_spec(backbone.model.config) if bank_cfg.kv_cache else None, hidden_cache, kv_format,
    )
    num_tokens = sum(len(t) for t in plan.token_ids)
    if part is not None:
        # Parts start in any order: whichever takes the lock first prepares the folder, the
        # others find it prepared for the same plan ('resume').
        out.mkdir(parents=True, exist_ok=True)
        with _dir_lock(out):
            status = _prepare_dir(out, plan, overwrite=False, is_main=True)
            if status == "fresh" or (status == "resume" and not (out / CHUNKS).is_file()):
                _write_chunks(out, plan)
    else:
        # Every process inspects the folder before anyone changes it, then the main one prepares it.
        status = _prepare_dir(out, plan, bank_cfg.overwrite, is_main=False) if not is_main else None
        barrier()
        if is_main:
            status = _prepare_dir(out, plan, bank_cfg.overwrite, is_main=True)
            if status != "done":
                _write_chunks(out, plan)
            else:
                _record_fingerprints(out, plan)
        barrier()
    if status == "done":
        return BuildResult(out, "already built", len(plan.chunks), len(plan.groups), num_tokens, 0,
                           time.perf_counter() - t0)

    mine = [i for i in range(len(plan.shard_bounds)) if i % world == rank]
    todo = [i for i in mine if _done_record(out, i) is None]
    rows_todo = sum(plan.shard_bounds[i][1] - plan.shard_bounds[i][0] for i in todo)
    decoder = backbone.model.get_decoder()
    shown = show_progress and (is_main or part is not None)  # a part is its own job: it shows its own bar
    bar = tqdm(total=rows_todo, desc="encoding chunks", unit="chunk", disable=not shown, file=sys.stderr,
               dynamic_ncols=True)
    for i in todo:
        a, b = plan.shard_bounds[i]
        tensors = encode_shard(
            decoder, plan.token_ids[a:b], bank_cfg.n_cache, bank_cfg.batch_size,
            backbone.tokenizer.pad_token_id, cache_dtype, progress=bar.update, key=plan.header["key"],
            key_ids=None if plan.key_ids is None else plan.key_ids[a:b],
            content_layer=plan.header.get("content_layer", -1), kv_format=KVFormat.of(plan.header),
            hidden_cache=plan.header.get("hidden_cache", True),
        )
        _write_shard(out, i, tensors, plan.plan_id, rank)
    bar.close()
    if part is not None:
        return BuildResult(out, f"part {rank}/{world}", len(plan.chunks), len(plan.groups), num_tokens,
                           len(todo), time.perf_counter() - t0)
    barrier()

    if is_main:
        shards = []
        for i in range(len(plan.shard_bounds)):
            rec = _done_record(out, i)
            if rec is None:
                raise BankError(f"shard {i} of {out} was not written by its process")
            shards.append(rec)
        manifest = dict(plan.header)
        manifest["shards"] = [{k: r[k] for k in ("file", "rows", "sha256", "bytes")} for r in shards]
        manifest["groups"] = {g: list(r) for g, r in plan.groups.items()}
        manifest[GROUPS_SHA256] = plan.groups_sha256
        manifest["build"] = {
            "plan_id": plan.plan_id,
            "num_processes": world,
            "shard_writers": [r["process"] for r in shards],  # which process encoded each shard
            "num_tokens": num_tokens,
            "bytes_per_chunk": bytes_per_chunk(shards, len(plan.chunks)),
        }
        _atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))
        shutil.rmtree(out / BUILD_DIR, ignore_errors=True)
        for p in out.glob("*.tmp*"):  # debris of a crash mid-write
            p.unlink()
    barrier()
    return BuildResult(
        out, "resumed" if status == "resume" else "built", len(plan.chunks), len(plan.groups), num_tokens,
        len(todo), time.perf_counter() - t0,
    )


def resolve_cache_dtype(spec: str, device: torch.device) -> torch.dtype:
    if spec == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return getattr(torch, spec)


__all__ = ["KEY_VARIANTS", "PAPER_KEY", "Bank", "BuildResult", "build_bank", "chunks_fingerprint", "encode_batch",
           "encode_shard", "bytes_per_chunk", "history_fingerprint", "key_spec", "key_states", "make_plan",
           "pool_key", "prompt_key_ids", "resolve_cache_dtype"]
