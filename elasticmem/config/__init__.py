"""Every setting of elasticmem, as dataclasses with one docstring per field.

This package holds every setting, one module per part: ``model`` (the backbone, LoRA, the budget policy, the
projector, ElasticMem, MemGen), ``data`` (the splits, the synthetic task, the dataset, chunking, the index and the
bank), ``training`` (text memory, the loss, GRPO training, evaluation, the agent, the warm-up) and ``amem`` (the
A-Mem baseline). It is the one place every setting and its documentation are written (``--help``,
``scripts/gen_config_docs.py`` and docs/configuration.md read it), and ``Config``, here, nests every section; every
public name of the modules is re-exported here (``from elasticmem.config import BankConfig``).

YAML files in ``configs/`` are presets over these defaults; any key can be
overridden on the command line as ``section.key=value``. Run any entry point
with ``--help`` to list all keys with their documentation, e.g.::

    python build_bank.py --help

This package is the ground floor of the package (tests/unit/test_import_layers.py): every
section's dataclass lives in it, with the variant tuples and limits its checks need, and it
imports no feature module (nor torch): its modules import only each other, the standard library
and ``elasticmem.utils``. The feature modules import their settings from here
(``elasticmem.model.budget_policy`` re-exports ``BudgetPolicyConfig``, for instance).
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field

from elasticmem.config.amem import AMEM_ABLATIONS, AMemConfig, AMemLLMConfig
from elasticmem.config.data import (
    SPLITS,
    SYNTHETIC_CATEGORIES,
    SYNTHETIC_FILLER,
    SYNTHETIC_PERSON_NAMES,
    SYNTHETIC_QUESTION_TYPES,
    SYNTHETIC_RELATIONS,
    SYNTHETIC_TINY_KEYS,
    SYNTHETIC_VALUE_POOL,
    BankConfig,
    ChunkingConfig,
    DataConfig,
    IndexConfig,
    KV_INT_BITS,
    KVScheme,
    SyntheticConfig,
    synthetic_fact_types,
)
from elasticmem.config.model import (
    BUDGET_VARIANTS,
    ENCODER_BUDGET_VARIANTS,
    LEARNED_BUDGET_VARIANTS,
    PROJECTOR_VARIANTS,
    BackboneConfig,
    BudgetPolicyConfig,
    BudgetVariant,
    LoraConfig,
    MemGenConfig,
    MemoryConfig,
    ProjectorConfig,
    ProjectorVariant,
    TinyModelConfig,
)
from elasticmem.config.training import (
    ADVANTAGE_SCALES,
    LOSS_TYPES,
    AdvantageScale,
    AgentConfig,
    EvalConfig,
    LossConfig,
    LossType,
    TextMemoryConfig,
    TrainConfig,
    WarmupConfig,
)
from elasticmem.utils import configuration

ConfigError = configuration.ConfigError

__all__ = [
    "ADVANTAGE_SCALES", "AMEM_ABLATIONS", "BUDGET_VARIANTS", "ENCODER_BUDGET_VARIANTS", "LEARNED_BUDGET_VARIANTS",
    "LOSS_TYPES", "PROJECTOR_VARIANTS", "SPLITS", "SYNTHETIC_CATEGORIES", "SYNTHETIC_FILLER", "SYNTHETIC_PERSON_NAMES",
    "SYNTHETIC_QUESTION_TYPES", "SYNTHETIC_RELATIONS", "SYNTHETIC_TINY_KEYS", "SYNTHETIC_VALUE_POOL", "KV_INT_BITS",
    "AMemConfig", "AMemLLMConfig", "AdvantageScale", "AgentConfig", "BackboneConfig", "BankConfig",
    "BudgetPolicyConfig", "BudgetVariant", "ChunkingConfig", "Config", "ConfigError", "DataConfig", "EvalConfig",
    "IndexConfig", "KVScheme", "LoraConfig", "LossConfig", "LossType", "MemGenConfig", "MemoryConfig",
    "ProjectorConfig", "ProjectorVariant", "SyntheticConfig", "TextMemoryConfig", "TinyModelConfig", "TrainConfig",
    "WarmupConfig", "load_config", "synthetic_fact_types",
]


@dataclass
class Config:
    """Top level: one file configures preparation, bank building, training and evaluation."""

    seed: int = 0
    """Global seed (data generation, index training, later training)."""
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    """The base language model (the bank's encoder and the reasoner). Called ``model`` up to 0.1:
    ``model.*`` keys (presets, overrides, saved checkpoints) still load, with a warning, in 0.2."""
    data: DataConfig = field(default_factory=DataConfig)
    """The prepared dataset."""
    chunking: ChunkingConfig = field(default_factory=ChunkingConfig)
    """History to chunks."""
    bank: BankConfig = field(default_factory=BankConfig)
    """The latent memory bank."""
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    """The ElasticMem model."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """GRPO training."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation (evaluate.py)."""
    amem: AMemConfig = field(default_factory=AMemConfig)
    """The A-Mem baseline (eval.system=amem)."""
    memgen: MemGenConfig = field(default_factory=MemGenConfig)
    """The MemGen baseline (train.system=memgen, eval.system=memgen)."""
    textmem: TextMemoryConfig = field(default_factory=TextMemoryConfig)
    """Text-memory libraries as baselines (eval.system=mem0, langmem)."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """The supervised reading warm-up (python -m elasticmem.warmup.reading)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """ALFWorld episodes (eval.task=alfworld)."""

    def __post_init__(self) -> None:
        if not self.train.use_memory:  # 0.1's spelling of memory.top_z=0
            warnings.warn("train.use_memory=false is memory.top_z=0 now (the one way to say 'no memory'); "
                          "the old key is read for one more release", FutureWarning, stacklevel=3)
            self.memory = dataclasses.replace(self.memory, top_z=0)
            self.train = dataclasses.replace(self.train, use_memory=True)

    @property
    def kv_scheme_read(self) -> KVScheme | None:
        """The ``bank.kv_scheme()`` the reasoner reads its memories' keys and values with
        (``memory.reads_kv``), else None: what ``Bank.open(expect_kv=...)`` holds a bank to (a
        bank's storage matters only to a reader of its per-layer KV)."""
        return self.bank.kv_scheme() if self.memory.reads_kv else None


Config.__renamed__ = {"model": "backbone"}  # old section name -> new (read with a warning for one release)


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML preset <- ``key=value`` overrides; unknown keys raise ``ConfigError``."""
    return configuration.load(Config, path, overrides)
