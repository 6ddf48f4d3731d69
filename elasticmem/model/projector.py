"""The latent projector P_psi and the selection of the cached states it projects.

A memory j with budget b_j contributes its last ``min(b_j, c_j)`` *valid*
cached states (``c_j`` = valid cache length), never padding (the reference
code projects zero padding, a bug not copied here). ``select_last_valid``
gathers them for a whole batch at once; ``Projector`` maps them into the
reasoner's input-embedding space (DESIGN.md section 1, item 4):

* ``mlp``: ``Linear(d, d_p) -> GELU -> Dropout -> Linear(d_p, d) -> LayerNorm(d)``;
* ``identity``: the cached states unchanged (ablation), no parameters.

Test with::

    pytest tests/unit/test_projector.py
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

# The settings live on the ground floor (elasticmem.config); re-exported under their old names.
from elasticmem.config import PROJECTOR_VARIANTS as VARIANTS  # noqa: F401
from elasticmem.config import ProjectorConfig, ProjectorVariant  # noqa: F401


class Projector(nn.Module):
    """P_psi: states [..., d] -> soft tokens [..., d].

    Args:
        cfg: the projector settings.
        d_model: d, the reasoner's hidden size (cache width = embedding width).
    """

    def __init__(self, cfg: ProjectorConfig, d_model: int) -> None:
        super().__init__()
        if d_model < 1:
            raise ValueError(f"d_model must be >= 1, got {d_model}")
        self.cfg = cfg
        self.d_model = d_model
        self.net: nn.Module = nn.Identity()
        if cfg.variant == "mlp":
            self.net = nn.Sequential(
                nn.Linear(d_model, cfg.hidden_size),
                nn.GELU(),
                nn.Dropout(cfg.dropout),
                nn.Linear(cfg.hidden_size, d_model),
                # match the scale of input embeddings whatever the scale of the cached states
                nn.LayerNorm(d_model),
            )

    def forward(self, states: Tensor) -> Tensor:
        """[..., d] -> [..., d], computed in the parameters' dtype, returned in the input's dtype.

        The bank may store caches in float16 while the projector trains in float32 (or
        the reverse); the caller then casts the result to the embedding dtype it needs.
        """
        if states.shape[-1] != self.d_model:
            raise ValueError(f"states must be [..., {self.d_model}], got {tuple(states.shape)}")
        weight = next(self.parameters(), None)
        compute = states if weight is None else states.to(weight.dtype)
        return self.net(compute).to(states.dtype)

    @torch.no_grad()
    def match_embedding_scale(self, embed: Tensor) -> bool:
        """Set the output LayerNorm's affine to the per-dimension std and mean of ``embed``
        [V, d] (the LM's input embeddings) if it still has its default init (weight 1, bias 0).

        A LayerNorm with unit weight emits vectors of norm ~sqrt(d), far from the LM's own
        embeddings (SmolLM2: rows of norm ~3 with per-dimension std ~0.1, against 24): soft
        tokens then start out of the distribution the LM reads. Returns whether it changed.
        """
        ln = self.net[-1] if isinstance(self.net, nn.Sequential) else None
        if not isinstance(ln, nn.LayerNorm) or not (bool((ln.weight == 1).all()) and bool((ln.bias == 0).all())):
            return False
        e = embed.detach().to(ln.weight.device, torch.float32)
        ln.weight.copy_(e.std(0))
        ln.bias.copy_(e.mean(0))
        return True


def select_last_valid(cache: Tensor, cache_len: Tensor, budgets: Tensor) -> tuple[Tensor, Tensor]:
    """The last ``min(budget_i, cache_len_i)`` valid states of each memory, concatenated.

    Args:
        cache: [N, n_cache, d] right-aligned content caches: memory i's valid states are
            ``cache[i, n_cache - cache_len_i:]``, anything before them is padding.
        cache_len: [N] int, valid length c_i, in 0..n_cache.
        budgets: [N] int, b_i >= 0; budgets beyond c_i (or n_cache) take what exists.

    Returns:
        states: [S, d] with S = counts.sum(): memory 0's states, then memory 1's, ...,
            each memory's oldest first.
        counts: [N] long, ``min(budgets, cache_len)``: how many rows each memory contributed.
    """
    if cache.dim() != 3:
        raise ValueError(f"cache must be [N, n_cache, d], got {tuple(cache.shape)}")
    n, n_cache, _ = cache.shape
    for name, t in (("cache_len", cache_len), ("budgets", budgets)):
        if tuple(t.shape) != (n,) or t.is_floating_point() or t.is_complex():
            raise ValueError(f"{name} must be an integer tensor of shape [{n}], got {t.dtype} {tuple(t.shape)}")
    if bool((budgets < 0).any()):
        raise ValueError(f"budgets must be >= 0, got {budgets.tolist()}")
    if bool((cache_len < 0).any() | (cache_len > n_cache).any()):
        raise ValueError(f"cache_len must lie in 0..{n_cache} (the cache width), got {cache_len.tolist()}")
    counts = torch.minimum(budgets.to(cache.device, torch.long), cache_len.to(cache.device, torch.long))
    positions = torch.arange(n_cache, device=cache.device)
    # right alignment makes "last count_i valid states" the positions >= n_cache - count_i,
    # and boolean indexing keeps row-major order: memory by memory, oldest state first
    selected = positions[None, :] >= (n_cache - counts)[:, None]
    return cache[selected], counts
