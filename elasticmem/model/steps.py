"""The model's state and steps as the modules of a trajectory's parts call them (``query_state.py``,
``rollout.py``, ``scoring.py``): a protocol that ``ElasticMem`` (and MemGen, its subclass) meets,
so that those modules name what they use without importing ``elasticmem.py``, which imports them.

    python -m pytest -q tests/unit/test_elasticmem.py
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, Sequence

import torch
from torch import nn

from elasticmem.bank.store import Bank
from elasticmem.config import MemoryConfig
from elasticmem.data.schema import Example
from elasticmem.model.injection import Assembled, Layout

Rows = Sequence[set[int]]
"""Bank rows per example (its evidence, or the memories to read)."""


class Steps(Protocol):
    """``ElasticMem``'s state and steps, as its methods document them."""

    cfg: MemoryConfig
    tokenizer: Any
    bank: Bank
    semantic: Any
    sep_ids: list[int]
    eos_ids: list[int]

    @property
    def device(self) -> torch.device: ...

    @property
    def base(self) -> nn.Module: ...

    def encode_texts(self, ex: Example) -> tuple[list[int], list[int]]: ...

    def _decoder(self, disable_adapter: bool = False) -> contextlib.AbstractContextManager: ...

    def _forward_hidden(self, **kw) -> tuple[torch.Tensor, object]: ...

    def _logits(self, h: torch.Tensor) -> torch.Tensor: ...

    def _token_logps(self, h: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor: ...

    def _query_and_retrieve(self, batch: Sequence[Example], G: int, greedy: bool,
                            texts: list[tuple[list[int], list[int]]] | None = None) -> tuple: ...

    def _given(self, h: torch.Tensor, memories: Rows) -> tuple: ...

    def _include(self, h: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor,
                 include: Rows | None) -> tuple: ...

    def _allocate(self, h, rows, scores, mask, greedy: bool, budgets: torch.Tensor | None = None): ...

    def _budgets(self, mode: str, h: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor, mask: torch.Tensor,
                 greedy: bool, generator: torch.Generator | None = None, evidence: Rows | None = None) -> tuple: ...

    def _soft_tokens(self, rows: torch.Tensor, budgets: torch.Tensor) -> tuple[list[list], torch.Tensor]: ...

    def _chunk_ids(self, row: int) -> list[int]: ...

    def _assemble(self, layouts: Sequence[Layout]) -> Assembled: ...

    def _generate(self, batch_in: Assembled, temperature: float, greedy: bool) -> tuple: ...
