"""The fingerprint of an encoder (sha256 of config + base weights + tokenizer) and its cache.

A bank records the fingerprint of the model that encoded it, and a bank built by another
encoder is refused. Hashing every base weight as float32 takes 1.5-3 minutes for a 7B model,
so a model loaded from a folder caches the value in ``$ELASTICMEM_HOME/fingerprints``, keyed by
the identity of the folder's files (``elasticmem.backbone.load.weights_identity``).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from elasticmem.backbone.home import elasticmem_home

# Config entries that say how a model was loaded or saved, not what it computes.
_VOLATILE_CONFIG_KEYS = {
    "transformers_version", "torch_dtype", "dtype", "quantization_config", "use_cache",
    "output_hidden_states", "output_attentions", "return_dict", "name_or_path",
}


def _base_parameter_name(name: str) -> str | None:
    """Name of a base weight with PEFT wrapping removed; None for adapter weights."""
    if "lora_" in name or "modules_to_save" in name:
        return None
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def model_fingerprint(model: torch.nn.Module, tokenizer) -> str:
    """sha256 over the architecture config, the base weights and the tokenizer.

    Weights are hashed as float32 (exact for bf16/fp16 checkpoints), so loading the
    same checkpoint in another compute dtype that holds it exactly gives the same
    fingerprint (not so a float32 checkpoint loaded in bfloat16: that rounds);
    LoRA adapter weights are ignored (the bank encoder is the adapter-disabled model).
    """
    h = hashlib.sha256()
    _hash_config(h, model.config)
    params = {}
    for name, p in model.named_parameters():
        base = _base_parameter_name(name)
        if base is not None:
            params[base] = p
    step = 1 << 24
    for name in sorted(params):
        flat = params[name].detach().reshape(-1)
        h.update(f"{name}:{tuple(params[name].shape)};".encode())
        for i in range(0, flat.numel(), step):  # bounded extra memory for huge embeddings
            h.update(flat[i : i + step].to("cpu", torch.float32).numpy().tobytes())
    _hash_tokenizer(h, tokenizer)
    return "sha256:" + h.hexdigest()


def _hash_config(h, config) -> None:
    """The config part of model_fingerprint (first)."""
    cfg = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())


def _hash_tokenizer(h, tokenizer) -> None:
    """The tokenizer part of model_fingerprint (last)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        tok = json.loads(backend.to_str())
        tok.pop("truncation", None)
        tok.pop("padding", None)
    else:
        tok = sorted(tokenizer.get_vocab().items())
    h.update(json.dumps(tok, sort_keys=True).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())


# --------------------------------------------------------------------------- fingerprint cache
#
# model_fingerprint reads every base weight (a 7B model: ~30 GB as float32, ~90 s of a free
# CPU core) and every process of a launch needs the value at start (bank check, checkpoints).
# The value depends only on what the weights, config and tokenizer were loaded from, how they
# were loaded and the code that loads and hashes them, so a model loaded from a folder caches it
# under a key made of all of that (weights_identity). Entries are small JSON files, one per key,
# written atomically (tmp + rename): processes that race write the same value, and a reader sees
# a whole entry or none. Anyone who can write the cache folder can forge a fingerprint, as anyone
# who can write the model folder can change the weights: keep it as private as the models.

FINGERPRINT_CACHE_FORMAT = 1
"""Bump when the key or what model_fingerprint hashes changes (edits of the fingerprint functions'
source also invalidate entries on their own, see _fingerprint_code_id)."""
FINGERPRINT_CACHE_ENV = "ELASTICMEM_FINGERPRINT_CACHE"
_FINGERPRINT_RE = re.compile(r"^sha256:[0-9a-f]{64}$")

def fingerprint_cache_dir() -> Path:
    return elasticmem_home() / "fingerprints"


def fingerprint_cache_mode() -> str:
    """``$ELASTICMEM_FINGERPRINT_CACHE``: on (default), off (never read or write), refresh (recompute, rewrite)."""
    raw = os.environ.get(FINGERPRINT_CACHE_ENV, "").strip().lower()
    if raw in ("", "1", "on", "true", "yes"):
        return "on"
    if raw in ("0", "off", "false", "no"):
        return "off"
    if raw == "refresh":
        return "refresh"
    raise ValueError(f"{FINGERPRINT_CACHE_ENV}={raw!r}: use on, off or refresh")


def fingerprint_cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return fingerprint_cache_dir() / f"{digest}.json"


def read_cached_fingerprint(key: dict) -> str | None:
    """The cached fingerprint for ``key``, or None (no entry, unreadable, or a different key)."""
    try:
        entry = json.loads(fingerprint_cache_path(key).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != key:
        return None
    value = entry.get("fingerprint")
    return value if isinstance(value, str) and _FINGERPRINT_RE.match(value) else None


def write_cached_fingerprint(key: dict, value: str) -> Path:
    """Store ``value`` for ``key`` atomically (a unique tmp file renamed over the entry)."""
    path = fingerprint_cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:16]}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"fingerprint": value, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "key": key}, f, indent=1)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a cache shared by users must stay readable
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def cached_fingerprint(model: torch.nn.Module, tokenizer, key: dict, mode: str | None = None) -> tuple[str, str]:
    """``model_fingerprint(model, tokenizer)`` through the cache: (value, 'cache' | 'computed ...').

    ``key`` must describe what ``model`` was loaded from (:func:`weights_identity`, taken around
    the load) and the base weights must be unchanged since. ``mode``: see
    :func:`fingerprint_cache_mode` (default: from the environment).
    """
    mode = mode or fingerprint_cache_mode()
    if mode == "off":
        return model_fingerprint(model, tokenizer), f"computed (cache off: {FINGERPRINT_CACHE_ENV}=off)"
    if mode == "refresh":  # asked to recompute: every process does, as told
        return _compute_and_store(model, tokenizer, key, mode)
    hit = read_cached_fingerprint(key)
    if hit is not None:
        return hit, "cache"
    with _fill_lock(key):
        hit = read_cached_fingerprint(key)  # written by the process this one waited for
        if hit is not None:
            return hit, "cache"
        return _compute_and_store(model, tokenizer, key, mode)


@contextlib.contextmanager
def _fill_lock(key: dict) -> Iterator[None]:
    """Hold an exclusive flock on ``key``'s lock file while the block runs.

    Every process of a launch asks for the fingerprint at about the same time (the bank check):
    on a cold cache each would hash the whole model (a 7B: ~90 s of a CPU core and 30 GB read as
    float32, eight times over on a node). Under the lock one process computes and writes the entry
    and the others, once it is released, read it. A file lock rather than a barrier
    (accelerate's main_process_first): the fingerprint is a lazy property, first read wherever a
    program happens to need it, not always at the same point on every process, where a
    collective would hang; the lock needs no collective and also serves separate jobs sharing the
    cache (array tasks, nodes with a shared home). Where the folder cannot be written or its file
    system has no flock, no lock: every process computes, as without it. The kernel releases the
    lock of a process that dies."""
    path = fingerprint_cache_path(key)
    fd = None
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        # read-only suffices for flock, so a lock file made by another user of a shared cache works
        fd = os.open(path.with_name(f".{path.stem}.lock"), os.O_RDONLY | os.O_CREAT, 0o644)
    if fd is None:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock (the file stays: removing it would race with waiters)


def _compute_and_store(model: torch.nn.Module, tokenizer, key: dict, mode: str) -> tuple[str, str]:
    value = model_fingerprint(model, tokenizer)
    try:
        write_cached_fingerprint(key, value)
    except OSError as e:  # a read-only home: still correct, just slow next time
        warnings.warn(f"could not write the fingerprint cache in {fingerprint_cache_dir()}: {e}", stacklevel=2)
        return value, f"computed (cache not written: {e})"
    return value, "computed" + (" (refresh)" if mode == "refresh" else "")
