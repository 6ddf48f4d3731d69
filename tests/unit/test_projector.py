"""Tests of the latent projector and the cached-state selection (elasticmem.model.projector).

Run with::

    pytest tests/unit/test_projector.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elasticmem.model.projector import Projector, ProjectorConfig, select_last_valid
from elasticmem.utils.configuration import field_docs

D = 16


def _padded_cache(cache_len: torch.Tensor, n_cache: int, d: int, seed: int) -> torch.Tensor:
    """Right-aligned random caches whose padding is NaN, so any selected padding shows."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(len(cache_len), n_cache, d, generator=g)
    for i, c in enumerate(cache_len.tolist()):
        cache[i, : n_cache - c] = float("nan")
    return cache


def _reference_select(cache: torch.Tensor, cache_len: torch.Tensor, budgets: torch.Tensor):
    n_cache = cache.shape[1]
    rows, counts = [], []
    for i in range(cache.shape[0]):
        valid = cache[i, n_cache - int(cache_len[i]):]
        take = min(int(budgets[i]), int(cache_len[i]))
        rows.extend(valid[len(valid) - take:])
        counts.append(take)
    states = torch.stack(rows) if rows else cache.new_zeros(0, cache.shape[2])
    return states, torch.tensor(counts, dtype=torch.long)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_select_last_valid_matches_loop(seed):
    n, n_cache, d = 12, 5, 3
    g = torch.Generator().manual_seed(100 + seed)
    cache_len = torch.randint(0, n_cache + 1, (n,), generator=g)
    budgets = torch.randint(0, n_cache + 4, (n,), generator=g)
    # make sure the edge cases are there whatever the seed
    cache_len[:4] = torch.tensor([0, 2, n_cache, 3])
    budgets[:4] = torch.tensor([3, 7, 0, 3])
    cache = _padded_cache(cache_len, n_cache, d, seed)

    states, counts = select_last_valid(cache, cache_len, budgets)
    want_states, want_counts = _reference_select(cache, cache_len, budgets)

    assert counts.dtype == torch.long
    assert torch.equal(counts, want_counts)
    assert states.shape == (int(want_counts.sum()), d)
    assert not torch.isnan(states).any(), "padding was selected"
    assert torch.equal(states, want_states)


def test_select_last_valid_empty_and_int32():
    cache = _padded_cache(torch.tensor([2, 0]), 4, 3, 0)
    states, counts = select_last_valid(cache, torch.tensor([2, 0], dtype=torch.int32),
                                       torch.tensor([0, 5], dtype=torch.int32))
    assert states.shape == (0, 3)
    assert counts.tolist() == [0, 0]


@pytest.mark.parametrize("cache_len,budgets", [([1, 2], [-1, 2]), ([1, 5], [1, 1])])
def test_select_last_valid_rejects_bad_lengths(cache_len, budgets):
    cache = torch.zeros(2, 4, 3)
    with pytest.raises(ValueError):
        select_last_valid(cache, torch.tensor(cache_len), torch.tensor(budgets))


def test_config_fields_documented_and_validated():
    docs = field_docs(ProjectorConfig)
    assert all(docs.get(f.name) for f in dataclasses.fields(ProjectorConfig))
    for bad in (dict(variant="linear"), dict(hidden_size=0), dict(dropout=1.0), dict(dropout=-0.1)):
        with pytest.raises(ValueError):
            ProjectorConfig(**bad)


def test_identity_returns_input_and_has_no_parameters():
    proj = Projector(ProjectorConfig(variant="identity"), D)
    assert list(proj.parameters()) == []
    x = torch.randn(3, 5, D, dtype=torch.bfloat16)
    assert torch.equal(proj(x), x)
    assert proj(x).dtype == torch.bfloat16


def test_mlp_shape_parameters_and_layernorm_statistics():
    dp = 24
    proj = Projector(ProjectorConfig(hidden_size=dp), D).eval()
    expected = (D * dp + dp) + (dp * D + D) + 2 * D
    assert sum(p.numel() for p in proj.parameters()) == expected
    x = torch.randn(4, 7, D) * 30 + 5  # cached states need not be embedding-sized
    y = proj(x)
    assert y.shape == x.shape
    # LayerNorm at init has weight 1, bias 0: each token is standardised
    assert torch.allclose(y.mean(-1), torch.zeros(4, 7), atol=1e-5)
    assert torch.allclose(y.var(-1, unbiased=False), torch.ones(4, 7), atol=1e-2)


def test_mlp_dropout_only_in_train_mode():
    proj = Projector(ProjectorConfig(hidden_size=64, dropout=0.5), D)
    x = torch.randn(2, 3, D)
    torch.manual_seed(0)
    assert not torch.equal(proj.train()(x), proj(x))
    proj.eval()
    assert torch.equal(proj(x), proj(x))


def test_mlp_computes_in_parameter_dtype_and_returns_input_dtype():
    proj = Projector(ProjectorConfig(hidden_size=32), D).eval()
    x = torch.randn(2, 3, D)
    half = x.to(torch.bfloat16)
    out = proj(half)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, proj(half.float()).to(torch.bfloat16))

    proj_bf16 = Projector(ProjectorConfig(hidden_size=32), D).eval().to(torch.bfloat16)
    proj_bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in proj.state_dict().items()})
    out32 = proj_bf16(x)
    assert out32.dtype == torch.float32
    assert torch.equal(out32, proj_bf16(x.to(torch.bfloat16)).float())


def test_mlp_rejects_wrong_width():
    with pytest.raises(ValueError):
        Projector(ProjectorConfig(hidden_size=8), D)(torch.randn(2, D + 1))


def test_mlp_is_differentiable():
    proj = Projector(ProjectorConfig(hidden_size=32, dropout=0.0), D)
    x = torch.randn(5, D)
    proj(x).pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in proj.parameters())
