"""ElasticMem and the baselines that share its code path, behind the ``MemorySystem`` interface.

``no_memory``, ``text_rag`` and ``full_context`` are ElasticMem with other memory settings
(DESIGN.md: baselines and ablations are config values, not copies of code), so every system
reads the same prompt, retrieves from the same bank and generates with the same decoder:

- ``no_memory``: ``top_z=0``, nothing retrieved;
- ``text_rag``: ``injection=text``, the same top-Z chunks as plain text;
- ``full_context``: ``injection=text, retrieval=recent``, the latest history that fits.

A-Mem (``amem``, ``elasticmem.baselines.amem``), Mem0 and LangMem (``mem0``, ``langmem``,
``elasticmem.baselines.textmem``) have their own memories; with ``answer_prompt=shared`` they read
what they retrieve through the same prompt and decoder (``elasticmem.eval.reader``). MemGen
(``memgen``, ``elasticmem.baselines.memgen``) shares the prompt, retrieval and bank but
answers with its own weaver and trigger.

This registry sits above ``elasticmem.eval`` and the baselines (tests/unit/test_import_layers.py):
it imports every system, while the baselines implement ``elasticmem.eval.system.MemorySystem``
and read through ``elasticmem.eval.reader``; the evaluation CLI and the live server, above it,
build systems from here.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from pathlib import Path
from typing import Iterator, Sequence

from elasticmem.config import Config, MemoryConfig
from elasticmem.data.schema import Example
from elasticmem.eval.system import MemorySystem, Prediction, Retrieved, fingerprint
from elasticmem.utils.common import sha256_file
from elasticmem.utils.configuration import ConfigError, from_dict, load, to_dict

SYSTEM_MEMORY: dict[str, list[str]] = {
    "elasticmem": [],
    "no_memory": ["top_z=0"],
    "text_rag": ["injection=text"],
    "full_context": ["injection=text", "retrieval=recent", "top_z=1000000"],
    "memgen": [],
}
"""Memory settings (relative to ``memory.``) that make each ElasticMem-path system."""


def memory_config(cfg: Config, overrides: Sequence[str]) -> MemoryConfig:
    """The memory settings of ``cfg.eval.system``: the checkpoint's (else ``cfg.memory``), then
    the ``memory.*`` entries of ``overrides`` (command line, variant), then the system's preset.

    The preset's keys define the system (no_memory's ``top_z=0``, text_rag's
    ``injection=text``), so an override of one of them is ignored with a warning: a
    ``memory.top_z=4`` given for ElasticMem on the command line of a comparison must not turn
    its no-memory variant into a memory system."""
    base = cfg.memory
    if cfg.eval.checkpoint:
        meta_path = Path(cfg.eval.checkpoint) / "elasticmem_config.json"
        if not meta_path.is_file():
            raise FileNotFoundError(f"{cfg.eval.checkpoint} is not a saved ElasticMem model "
                                    f"({meta_path.name} missing); give train.output_dir/final or a checkpoint folder")
        base = from_dict(MemoryConfig, json.loads(meta_path.read_text())["memory"])
    preset = SYSTEM_MEMORY[cfg.eval.system]
    pinned = {p.split("=", 1)[0] for p in preset}
    mine = [o.removeprefix("memory.") for o in overrides if o.startswith("memory.")]
    ignored = [o for o in mine if o.split("=", 1)[0].strip() in pinned]
    if ignored:
        warnings.warn(f"eval.system={cfg.eval.system} sets {', '.join(preset)}; ignoring "
                      f"{', '.join('memory.' + o for o in ignored)}", stacklevel=2)
    return load(MemoryConfig, None, [o for o in mine if o not in ignored] + preset, base=base)


CHECKPOINT_WEIGHTS = ("adapter/adapter_model.safetensors", "budget_policy.safetensors", "projector.safetensors")
"""The files of a saved model (``ElasticMem.save_pretrained``) that hold trained weights."""
MEMGEN_WEIGHTS = ("adapter/adapter_model.safetensors", "memgen.safetensors")
"""The same for a saved MemGen model (``MemGen.save_pretrained``)."""


def checkpoint_fingerprint(path: str | Path) -> str:
    """Hash of a checkpoint's weight files' contents: a model retrained into the same folder differs."""
    files = MEMGEN_WEIGHTS if (Path(path) / MEMGEN_WEIGHTS[1]).is_file() else CHECKPOINT_WEIGHTS
    return fingerprint({f: sha256_file(Path(path) / f) for f in files})


def bank_fingerprint(bank) -> str:
    """Hash of a bank's manifest (encoder, tokenization, groups, every shard's sha256, the build
    plan's hash of the chunk tokens), leaving out how many processes built it."""
    manifest = {k: v for k, v in bank.manifest.items() if k != "build"}
    manifest["plan_id"] = bank.manifest.get("build", {}).get("plan_id")
    return fingerprint(manifest)


class ElasticMemSystem:
    """Greedy answers of an ``ElasticMem`` model (any injection / retrieval setting)."""

    def __init__(self, model, name: str = "elasticmem", checkpoint: str | None = None,
                 settings: dict | None = None, memories: str = "retrieved", budgets: str = "policy"):
        """``checkpoint``: the weights' ``checkpoint_fingerprint`` (None = untrained parts);
        ``settings``: other JSON-able settings that change the answers (seed, index), for ``identity``;
        ``memories`` and ``budgets``: ``eval.memories`` and ``eval.budgets`` (the ladder's diagnostics)."""
        self.model = model
        self.name = name
        self.checkpoint = checkpoint
        self.settings = dict(settings or {})
        if memories != "retrieved" or budgets != "policy":  # absent otherwise: earlier runs still resume
            self.settings.update(memories=memories, budgets=budgets)
        self.memories = memories
        self.budgets = budgets
        self._memo: dict | None = None

    @contextlib.contextmanager
    def reuse_retrieval(self) -> Iterator[None]:
        """Within the block, an example whose prompt was seen before gets that example's control
        token, memories and budgets without recomputing them (``ElasticMem.greedy``'s memo): an
        agent episode, whose query is the same objective at every step, retrieves once."""
        self._memo = {}
        try:
            yield
        finally:
            self._memo = None

    def identity(self) -> dict:
        model = self.model
        return {
            "system": self.name,
            "memory": to_dict(model.cfg),
            **({"memgen": to_dict(model.memgen)} if hasattr(model, "memgen") else {}),
            "backbone": {"name_or_path": model.backbone_name, "fingerprint": model.fingerprint,
                         "dtype": str(next(model.lm.parameters()).dtype).removeprefix("torch.")},
            "bank": bank_fingerprint(model.bank),
            "checkpoint": self.checkpoint,
            **self.settings,
        }

    def predict(self, examples: Sequence[Example]) -> list[Prediction]:
        import torch

        model = self.model
        kw = {}
        if self.memories == "evidence" or self.budgets == "oracle":
            from elasticmem.eval.retrieval import evidence_rows

            # a question that records no evidence (2 of LoCoMo's 314 test questions) reads nothing at the
            # evidence-alone rung and gets no budget at the oracle's: what those rungs mean for it
            evidence = [evidence_rows(ex, model.bank) for ex in examples]
            kw = dict(budgets=self.budgets, evidence=evidence,
                      memories=evidence if self.memories == "evidence" else None)
        elif self.budgets != "policy":  # a rule: it reads the retrieval's ranks and scores, not the evidence
            kw = dict(budgets=self.budgets)
        with torch.no_grad():
            traj = model.greedy(list(examples), memo=None if kw else self._memo, **kw)
        n = len(examples)
        latency = {k: v / n for k, v in traj.timings.items()}
        chunks = model.bank.chunks()
        out = []
        for i, ex in enumerate(examples):
            retrieved = [Retrieved(rank=j, ref=f"row:{r}", score=s, text=chunks[r]["text"], budget=b, tokens=c)
                         for j, (r, s, b, c) in enumerate(traj.memories(i))]
            generated = int(traj.answer_mask[i].sum())
            memory = int(traj.memory_tokens[i])
            extra: dict = {"control_token": int(traj.control[i])} if int(traj.control[i]) >= 0 else {}
            evidence = self._evidence(ex)
            if evidence is not None:
                extra["evidence"] = evidence
            out.append(Prediction(
                id=ex.id, text=traj.answers[i], prompt_tokens=int(traj.num_tokens[i]) - memory - generated,
                memory_tokens=memory, generated_tokens=generated, retrieved=retrieved, latency=dict(latency),
                extra=extra,
            ))
        return out

    def _evidence(self, ex: Example) -> dict | None:
        """The bank rows holding ``ex``'s evidence turns and its group's row count, for the
        evidence-recall figures of ``results.json`` (``metrics.evidence_stats``); None when the
        example has no evidence or the bank's chunks do not record their turns (an old bank)."""
        from elasticmem.eval.retrieval import evidence_rows

        if not ex.extra.get("evidence"):
            return None
        bank = self.model.bank
        try:
            rows = evidence_rows(ex, bank)
        except ValueError:  # chunks without session/turns: recall cannot be scored, the answers still can
            return None
        return {"rows": sorted(rows), "group_rows": int(bank.group_row_ids(ex.group).numel())}


def build_system(cfg: Config, overrides: Sequence[str] = (), device=None, stream_dir: str | Path | None = None,
                 create_bank: bool = False) -> MemorySystem:
    """The system ``cfg.eval.system`` on ``cfg``'s model and bank (checkpoint loaded if given).

    ``create_bank``: a ``bank.dir`` holding no bank gets an empty one (the settings of a build of
    ``cfg.bank``) for appends to fill (``LiveMemory``). ``stream_dir`` (with ``cfg.eval.stream``
    'session' or 'all'): the folder of the streamed bank, created likewise; the system is a
    ``StreamingSystem`` that fills it as it answers."""
    from elasticmem.backbone import load_backbone

    if cfg.eval.system == "amem":
        from elasticmem.baselines.amem import AMemSystem

        return AMemSystem.from_config(cfg.amem, memory=cfg.memory)
    if cfg.eval.system in ("mem0", "langmem"):
        from elasticmem.baselines.textmem import LangMemSystem, Mem0System

        return (Mem0System if cfg.eval.system == "mem0" else LangMemSystem)(cfg.textmem, cfg.amem, cfg.backbone,
                                                                             memory=cfg.memory)
    from elasticmem.bank import Bank, build_index
    from elasticmem.model.elasticmem import ElasticMem

    backbone = load_backbone(cfg.backbone, device=device)
    stream = cfg.eval.stream != "off"
    if stream and stream_dir is None:
        raise ValueError("eval.stream needs the folder of the streamed bank (stream_dir)")
    bank_dir = Path(stream_dir if stream else cfg.bank.dir)

    def make_bank():  # empty; the same settings as a build of cfg.bank
        import shutil

        from elasticmem.bank import resolve_cache_dtype
        from elasticmem.bank.append import create_bank as create

        shutil.rmtree(bank_dir, ignore_errors=True)
        return create(bank_dir, backbone, cfg.chunking, cfg.bank, resolve_cache_dtype(cfg.bank.cache_dtype,
                                                                                     backbone.device))

    if (stream or create_bank) and not (bank_dir / "manifest.json").is_file():
        bank = make_bank()
    else:
        bank = Bank.open(bank_dir, expect_fingerprint=backbone.fingerprint)
    mem = memory_config(cfg, overrides)
    if mem.reads_kv and bank.num_chunks:
        # an int4 bank is not read as float16 (or the reverse), nor one scheme's keys as another's, silently
        bank.require_kv(cfg.bank.kv_scheme())
    key_index = build_index(bank, cfg.bank.index, cfg.seed, backbone.device.index or 0, device=backbone.device)
    if cfg.eval.system == "memgen":
        from elasticmem.baselines.memgen import MemGen, saved_memgen_config

        mg = saved_memgen_config(cfg.eval.checkpoint) if cfg.eval.checkpoint else cfg.memgen
        if mg is None:
            raise ConfigError(f"eval.system=memgen but {cfg.eval.checkpoint} holds an ElasticMem model")
        model = MemGen(backbone, mem, mg, bank, key_index)
    else:
        if cfg.eval.checkpoint and (Path(cfg.eval.checkpoint) / MEMGEN_WEIGHTS[1]).is_file():
            raise ConfigError(f"{cfg.eval.checkpoint} holds a MemGen model: evaluate it with eval.system=memgen")
        model = ElasticMem(backbone, mem, bank, key_index)
    checkpoint = None
    if cfg.eval.checkpoint:
        checkpoint = checkpoint_fingerprint(cfg.eval.checkpoint)
        model.load_weights(cfg.eval.checkpoint)
    model.eval()
    index = {k: v for k, v in to_dict(cfg.bank.index).items() if k != "save"}  # save only caches
    if (cfg.eval.memories != "retrieved" or cfg.eval.budgets != "policy") and cfg.eval.system == "memgen":
        raise ConfigError("eval.memories and eval.budgets are ElasticMem's diagnostics; MemGen has neither")
    system = ElasticMemSystem(model, cfg.eval.system, checkpoint, {"seed": cfg.seed, "index": index},
                              memories=cfg.eval.memories, budgets=cfg.eval.budgets)
    if stream:
        from elasticmem.eval.streaming import StreamingSystem

        return StreamingSystem(system, cfg.eval.stream, make_bank)
    return system
