"""Saving and loading a trained ElasticMem model: the LoRA adapter (peft), ``budget_policy.safetensors``,
``projector.safetensors`` and the config JSON (``CONFIG_FILE``), which names the backbone and bank the
model was trained on. ``ElasticMem.save_pretrained``, ``from_pretrained`` and ``load_weights`` call these.

    python -m pytest -q tests/unit/test_elasticmem.py
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

import torch
from torch import nn

from elasticmem.bank.index import KeyIndex
from elasticmem.bank.store import Bank
from elasticmem.config import MemoryConfig

FORMAT_VERSION = 1
CONFIG_FILE = "elasticmem_config.json"


class Trained(Protocol):
    """What a checkpoint holds: the peft-wrapped reasoner, the two trained heads, and what they were trained on."""

    lm: Any
    policy: nn.Module
    projector: nn.Module
    cfg: MemoryConfig
    backbone_name: str
    fingerprint: str
    bank: Bank

    @property
    def device(self) -> torch.device: ...

    def load_weights(self, path: str | Path) -> None: ...


M = TypeVar("M", bound=Trained)


def save_pretrained(model: Trained, out: str | Path) -> None:
    """LoRA adapter (peft), ``budget_policy.safetensors``, ``projector.safetensors``, config JSON."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # The base weights are frozen and identified by the fingerprint: never copy them into
    # the adapter, even when lm_head (tied to the embeddings) carries LoRA.
    model.lm.save_pretrained(out / "adapter", save_embedding_layers=False)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.policy.state_dict().items()},
              out / "budget_policy.safetensors")
    save_file({k: v.detach().cpu().contiguous() for k, v in model.projector.state_dict().items()},
              out / "projector.safetensors")
    meta = {"format_version": FORMAT_VERSION, "memory": asdict(model.cfg),
            "backbone": {"name_or_path": model.backbone_name, "fingerprint": model.fingerprint},
            "bank": {"fingerprint": model.bank.fingerprint, "dir": str(model.bank.root)}}
    (out / CONFIG_FILE).write_text(json.dumps(meta, indent=1))


def from_pretrained(cls: Callable[[Any, MemoryConfig, Bank, KeyIndex | None], M], path: str | Path, backbone,
                    bank: Bank, index: KeyIndex | None = None) -> M:
    """Rebuild a saved model (``cls(backbone, cfg, bank, index)``) on ``backbone`` (which must be the one
    it was trained on)."""
    from elasticmem.utils.configuration import from_dict

    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a saved ElasticMem model ({CONFIG_FILE} missing)")
    meta = json.loads((path / CONFIG_FILE).read_text())
    saved = meta["backbone"]["fingerprint"]
    if saved != backbone.fingerprint:
        raise ValueError(
            f"{path} was trained on {meta['backbone']['name_or_path']!r} ({saved[:23]}...), but the backbone "
            f"given is {backbone.name_or_path!r} ({backbone.fingerprint[:23]}...)"
        )
    model = cls(backbone, from_dict(MemoryConfig, meta["memory"]), bank, index)
    model.load_weights(path)
    return model


def load_adapter(lm, path: Path, device: torch.device) -> None:
    """The LoRA adapter saved by ``save_pretrained`` in ``path``, into peft model ``lm`` (unknown weights refused)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    adapter = load_file(str(path / "adapter" / "adapter_model.safetensors"), device=str(device))
    result = set_peft_model_state_dict(lm, adapter)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"unexpected adapter weights in {path}: {result.unexpected_keys[:3]}")


def load_weights(model: Trained, path: str | Path) -> None:
    """Load the trained parts (adapter, policy, projector) saved by ``save_pretrained`` into ``model``."""
    from safetensors.torch import load_file

    path, dev = Path(path), str(model.device)
    load_adapter(model.lm, path, model.device)
    model.policy.load_state_dict(load_file(str(path / "budget_policy.safetensors"), device=dev))
    model.projector.load_state_dict(load_file(str(path / "projector.safetensors"), device=dev))
