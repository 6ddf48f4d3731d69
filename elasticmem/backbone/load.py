"""Load the base causal LM and its tokenizer, offline, as a ``Backbone``; and the fingerprint cache key.

``load_backbone`` builds the tiny model, or loads a cached alias (``smollm2``), a GGUF file
(converted once), a local HF folder or a hub id already in the local Hugging Face cache.
``weights_identity`` is the key under which a folder's fingerprint is cached: it names the
code below that decides what is loaded, so an edit of it invalidates the entries.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path

import torch

from elasticmem.backbone import fingerprint as fp
from elasticmem.backbone.fingerprint import (
    _VOLATILE_CONFIG_KEYS,
    FINGERPRINT_CACHE_FORMAT,
    _base_parameter_name,
    _hash_config,
    _hash_tokenizer,
    model_fingerprint,
)
from elasticmem.backbone.gguf import ALIASES, gguf_cache_dir
from elasticmem.backbone.home import models_home
from elasticmem.backbone.tiny import build_tiny_model, build_tiny_tokenizer
from elasticmem.config import BackboneConfig

def resolve_device(spec: str = "auto") -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"backbone.device={spec!r} but CUDA is not available; use backbone.device=cpu")
    return dev


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, spec)


# --------------------------------------------------------------------------- loading


@dataclass
class Backbone:
    """A causal LM and its tokenizer. ``fingerprint`` identifies the frozen base weights."""

    model: torch.nn.Module
    tokenizer: object
    name_or_path: str
    weights_key: dict | None = field(default=None, repr=False)
    """Identity of the files the model was loaded from (:func:`weights_identity`): the key of the
    fingerprint cache. None: the fingerprint is always computed (see ``not_cacheable``)."""
    not_cacheable: str = field(default="not loaded from a model folder", repr=False)
    """Why ``weights_key`` is None."""
    _fingerprint_source: str = field(default="", init=False, repr=False, compare=False)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @cached_property
    def fingerprint(self) -> str:
        if self.weights_key is None:
            self._fingerprint_source = f"computed (not cacheable: {self.not_cacheable})"
            return fp.model_fingerprint(self.model, self.tokenizer)
        value, self._fingerprint_source = fp.cached_fingerprint(self.model, self.tokenizer, self.weights_key)
        return value

    @property
    def fingerprint_source(self) -> str:
        """Where ``fingerprint`` came from: 'cache', 'computed' (and stored) or 'computed (why not cached)'."""
        self.fingerprint  # noqa: B018 - computed or looked up on first use
        return self._fingerprint_source


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1


def resolve_model_path(cfg: BackboneConfig) -> str:
    """Map an alias or GGUF file to the HF directory to load; hub ids pass through."""
    name = cfg.name_or_path
    if name in ALIASES:
        out = models_home(cfg.cache_dir) / ALIASES[name]["dirname"]
        if not (out / "config.json").is_file():
            raise FileNotFoundError(
                f"model '{name}' is not cached at {out}; fetch it once with: "
                f"python -m elasticmem.backbone fetch {name}"
            )
        return str(out)
    if name.endswith(".gguf"):
        return str(gguf_cache_dir(name, cfg.cache_dir))
    path = Path(name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model path {path} exists but has no config.json (not an HF model folder)")
        return str(path)
    if _looks_like_path(name):
        raise FileNotFoundError(f"model path not found: {name}")
    return name


def _four_bit_kwargs(device: torch.device, dtype: torch.dtype) -> dict:
    """QLoRA-style NF4 base weights with double quantization, computing in ``dtype``."""
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError:
        raise ImportError("backbone.load_in_4bit needs bitsandbytes: pip install 'elasticmem[gpu]'") from None
    return {
        "quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        ),
        "device_map": {"": device.index or 0},
    }


def _placement_kwargs(device: torch.device) -> dict:
    """Load every weight straight onto ``device`` (``device_map``), not into host memory first.

    Without it from_pretrained materialises the whole model on the host and ``.to(device)``
    copies it over: each process of a launch holds the full weights in RAM at once (8 ranks of a
    7B in bf16: 8 x 15 GB). With a one-device map the safetensors shards are read (mmap) and each
    tensor is copied to the device as it is loaded. Not under DeepSpeed ZeRO-3, which refuses a
    device_map (it places the weights itself when it wraps the model)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return {} if is_deepspeed_zero3_enabled() else {"device_map": {"": device}}


def _tokenizer_class(path: str):
    """AutoTokenizer, except for folders saved with the generic tokenizers backend.

    transformers 5 maps such a folder to the model type's tokenizer class (Qwen2Tokenizer for
    the tiny model), which rebuilds a BPE from the vocab and ignores tokenizer.json; loading
    through the generic backend keeps the saved tokenizer exactly.
    """
    from transformers import AutoTokenizer, TokenizersBackend

    cfg = Path(path) / "tokenizer_config.json"
    if cfg.is_file():
        cls = json.loads(cfg.read_text()).get("tokenizer_class")
        if cls in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            return TokenizersBackend
    return AutoTokenizer


def load_backbone(cfg: BackboneConfig, device: torch.device | str | None = None) -> Backbone:
    """Load (or build) the model in eval mode on ``device`` with the configured dtype."""
    dev = torch.device(device) if device is not None else resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, dev)
    if cfg.load_in_4bit and (dev.type != "cuda" or cfg.name_or_path == "tiny"):
        raise ValueError("backbone.load_in_4bit needs a CUDA device and a real checkpoint (bitsandbytes NF4)")
    key_before, loading, path = None, {}, cfg.name_or_path
    if cfg.name_or_path == "tiny":
        tokenizer = build_tiny_tokenizer(cfg.tiny.char_fallback, cfg.tiny.vocabulary)
        model = build_tiny_model(cfg.tiny, tokenizer)
    else:
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(cfg)
        kwargs = dict(trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
        model_kwargs = _four_bit_kwargs(dev, dtype) if cfg.load_in_4bit else _placement_kwargs(dev)
        key_before = weights_identity(path, cfg, dtype)
        try:
            tokenizer = _tokenizer_class(path).from_pretrained(path, **kwargs)
            model, loading = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=cfg.attn_implementation, output_loading_info=True,
                **kwargs, **model_kwargs,
            )
        except OSError as e:
            raise OSError(
                f"could not load model {cfg.name_or_path!r}: it is not a local folder or file and not in "
                f"the local Hugging Face cache (there is no hub access at run time). Download it where you "
                f"have network (`hf download {cfg.name_or_path}`) or point backbone.name_or_path at a local "
                f"folder. Original error: {e}"
            ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not cfg.load_in_4bit:  # a quantized model is placed by from_pretrained and cannot be cast
        # loaded on dev already (_placement_kwargs): a no-op for the weights; casts the buffers
        # (rotary inv_freq) to dtype as before
        model = model.to(device=dev, dtype=dtype)
    model = model.eval()
    model.requires_grad_(False)
    bb = Backbone(model=model, tokenizer=tokenizer, name_or_path=cfg.name_or_path)
    if cfg.name_or_path == "tiny":
        bb.not_cacheable = "the tiny model is built in code (and small)"
    elif key_before is None:
        bb.not_cacheable = f"no local model folder to identify for {path!r}"
    elif any(loading.get(k) for k in ("missing_keys", "mismatched_keys")):
        # Weights initialised at load are not identified by the files (and usually random).
        bb.not_cacheable = "some weights were not in the checkpoint"
    elif weights_identity(path, cfg, dtype) != key_before:
        bb.not_cacheable = "the model files changed while loading"
    else:
        bb.weights_key = key_before
    return bb


# --------------------------------------------------------------------------- the fingerprint cache key

# Stored float dtypes (safetensors names) that each compute dtype holds exactly: loading those in
# that dtype and hashing as float32 gives the stored values, so the fingerprint is the same for
# every such dtype (a bf16 checkpoint in float32 or bfloat16). Any other combination rounds
# (fp32 -> bf16, bf16 <-> fp16) and changes the fingerprint: the dtype is then part of the key.
_EXACT_IN = {torch.float32: {"F32", "BF16", "F16"}, torch.bfloat16: {"BF16"}, torch.float16: {"F16"}}
_PICKLED_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt")
# The code whose behaviour a cached value stands for (how a folder is loaded, what is hashed),
# captured as defined here: a test may monkeypatch the module attributes, the key must not follow.
_FINGERPRINT_CODE = (model_fingerprint, _hash_config, _hash_tokenizer, _base_parameter_name, load_backbone,
                     _tokenizer_class)


@cache  # the code does not change within a process; reading it costs ~10 ms
def _fingerprint_code_id() -> str:
    try:
        src = "".join(inspect.getsource(f) for f in _FINGERPRINT_CODE)
    except (OSError, TypeError):  # no source (a frozen install): rely on FINGERPRINT_CACHE_FORMAT
        src = "no source"
    src += repr(sorted(_VOLATILE_CONFIG_KEYS))
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def _local_model_folder(path: str, revision: str | None) -> Path | None:
    """The folder ``from_pretrained(path)`` reads: a local folder, or a hub id's cached snapshot."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p.resolve()
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(path, "config.json", revision=revision)
    except Exception:  # not a valid repo id, no hub cache, ...
        return None
    return Path(hit).parent.resolve() if isinstance(hit, str) else None


def _stored_float_dtypes(folder: Path, names: list[str]) -> set[str] | None:
    """The dtypes of every tensor in the folder's safetensors files (headers only); None if unknown."""
    if any(n.endswith(_PICKLED_WEIGHTS) for n in names):
        return None  # pickled weights: reading their dtypes means unpickling them
    dtypes: set[str] = set()
    for name in names:
        if not name.endswith(".safetensors"):
            continue
        try:
            with open(folder / name, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if not 0 < n <= 100 << 20:
                    return None
                header = json.loads(f.read(n))
            dtypes |= {str(v["dtype"]) for k, v in header.items() if k != "__metadata__"}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
    return dtypes


def weights_identity(path: str, cfg: BackboneConfig, dtype: torch.dtype) -> dict | None:
    """The fingerprint cache key of the model ``from_pretrained(path)`` loads with ``cfg`` and ``dtype``.

    Every file at the top of the model folder (weights, config.json, tokenizer files, custom
    code; from_pretrained reads nothing below it) by name, size, mtime_ns, inode and ctime_ns;
    the resolved folder; the load options that change the loaded weights, config or tokenizer;
    the transformers/tokenizers versions (they shape the config dict and the tokenizer JSON that
    are hashed) and the fingerprint code. Files are followed through symlinks (hub snapshots).
    None when there is no local folder (the fingerprint is then computed every time).

    Size + mtime alone would miss a file rewritten with the same size whose mtime was put back
    (``touch -d``, ``cp -p``, ``rsync -t``). The inode changes when a file is replaced (rename,
    most copy tools) and ctime cannot be set from user space (any write or utime sets it to
    now), so the remaining hole is an in-place rewrite to the same size within one tick of the
    kernel's file-timestamp clock (a few ms) after the previous change: not something a model
    download or conversion does. The cost of all of this: a stat per file and the safetensors
    headers (a few KB per shard).
    """
    folder = _local_model_folder(path, cfg.revision)
    if folder is None:
        return None
    files = []
    try:
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if entry.name.startswith(".") or not entry.is_file():  # is_file follows symlinks
                continue
            st = entry.stat()  # follows symlinks
            files.append([entry.name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns])
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    names = [f[0] for f in files]
    # The weights as hashed: the stored values when every weight is exact in the compute dtype
    # (then any such dtype gives the same fingerprint), else the dtype the values were rounded to.
    weights_as = str(dtype).removeprefix("torch.")
    stored = _stored_float_dtypes(folder, names)
    if (not cfg.load_in_4bit and stored and stored <= _EXACT_IN.get(dtype, set())
            and not (isinstance(config, dict) and config.get("quantization_config"))):
        weights_as = "stored"
    versions = {}
    for mod in ("transformers", "tokenizers") + (("bitsandbytes",) if cfg.load_in_4bit else ()):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = None
    return {
        "format": FINGERPRINT_CACHE_FORMAT,
        "code": _fingerprint_code_id(),
        "folder": str(folder),
        "files": files,
        "weights_as": weights_as,
        "load": {
            "load_in_4bit": bool(cfg.load_in_4bit),
            "trust_remote_code": bool(cfg.trust_remote_code),
            "revision": cfg.revision,
            "attn_implementation": cfg.attn_implementation,
        },
        "versions": versions,
    }
