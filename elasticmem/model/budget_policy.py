"""The elastic budget policy pi_phi: how many latent tokens each retrieved memory gets.

For a query state ``h`` and its ``Z`` retrieved memories (rank order, keys
``k_j``, cosine scores ``s_j``) the policy gives each memory a categorical
distribution over budgets ``{min_budget..max_budget}`` and samples ``b_j``
(DESIGN.md section 1, item 3). Variants, all behind one interface and chosen
by ``BudgetPolicyConfig.variant``:

* ``transformer`` (paper): a Transformer encoder reads the Z memories jointly;
* ``autoregressive`` (reference code): the same encoder under a causal mask,
  each memory also seeing an embedding of the previous decision ``b_{j-1}``;
* ``mlp``: each memory scored alone, no comparison between memories;
* ``uniform``: every memory gets ``uniform_budget`` (no parameters);
* ``random``: budgets uniform over ``{min_budget..max_budget}`` (no parameters).

The learned variants share one path: per-memory features
``Linear([h; k_j; h*k_j; s_j]) + rank_embedding[j]`` -> body -> ``Linear(d_b, K)``
with ``K = max_budget - min_budget + 1`` classes, class ``c`` meaning budget
``min_budget + c``. The two fixed variants are constant logits (all zero for
``random``, a point mass for ``uniform``), so sampling, log-probabilities and
entropies are computed by the same code for every variant.

Slots whose ``mask`` is False (fewer than Z memories retrieved) get budget 0,
log-prob 0 and entropy 0, and never influence the other slots. Sampling,
log-probabilities and entropies run in float32, whatever the input dtype, an
enclosing autocast or the parameters' dtype (DeepSpeed's bf16 mode casts the
whole model to bf16: the features are then cast to it and the logits back).

Test with::

    pytest tests/unit/test_budget_policy.py
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, NamedTuple

import torch
from torch import Tensor, nn

# The settings live on the ground floor (elasticmem.config); re-exported under their old names.
from elasticmem.config import (  # noqa: F401
    BUDGET_VARIANTS as VARIANTS,
    ENCODER_BUDGET_VARIANTS as ENCODER_VARIANTS,
    LEARNED_BUDGET_VARIANTS as LEARNED_VARIANTS,
    BudgetPolicyConfig,
    BudgetVariant,
)
from elasticmem.utils.common import require as _require


class BudgetSample(NamedTuple):
    """One allocation for a batch of retrieved sets; every field is 0 at masked slots.

    * ``budgets`` [N, Z] long: latent tokens per memory (clipped in greedy mode when
      ``clip_budget`` is set);
    * ``log_prob`` [N, Z] float32: log pi(b_j) of the sampled action before clipping;
    * ``entropy`` [N, Z] float32: entropy of each memory's budget distribution.
    """

    budgets: Tensor
    log_prob: Tensor
    entropy: Tensor


@contextlib.contextmanager
def _float32(like: Tensor) -> Iterator[None]:
    # An enclosing bf16 autocast (accelerate mixed precision) would otherwise run the small
    # policy in bf16, where log-prob ratios of near-equal logits are too coarse for GRPO.
    with torch.autocast(device_type=like.device.type, enabled=False):
        yield


class BudgetPolicy(nn.Module):
    """Assigns each of the Z retrieved memories a budget (see the module docstring).

    Args:
        cfg: the policy settings.
        hidden_size: d, the width of the query state h and of the keys k_j.

    Inputs of every method (N retrieved sets, Z slots, d = hidden_size):
    ``h`` [N, d] query states, ``keys`` [N, Z, d], ``scores`` [N, Z] cosine scores,
    ``mask`` [N, Z] bool, True where a memory was retrieved. Values at masked
    slots are ignored (they may be garbage, even NaN). Parameters in float32 keep
    the whole network in float32; bf16 ones (DeepSpeed's bf16 mode) run it in bf16
    with float32 logits. The caller detaches the inputs if the policy should not
    send gradients into the reasoner.
    """

    def __init__(self, cfg: BudgetPolicyConfig, hidden_size: int) -> None:
        super().__init__()
        _require(hidden_size >= 1, f"hidden_size must be >= 1, got {hidden_size}")
        self.cfg = cfg
        self.hidden_size = hidden_size
        self.num_classes = cfg.num_classes
        if cfg.variant not in LEARNED_VARIANTS:
            return
        num_features = (3 if cfg.product_feature else 2) * hidden_size + 1 + (cfg.features == "normalized")
        self.input_proj = nn.Linear(num_features, cfg.d_model)
        self.rank_embedding = nn.Embedding(cfg.max_rank, cfg.d_model)
        self.body: nn.Module
        if cfg.variant == "mlp":
            # with input_proj and head this is Linear-GELU-Dropout-Linear per memory
            self.body = nn.Sequential(nn.GELU(), nn.Dropout(cfg.dropout))
        else:
            layer = nn.TransformerEncoderLayer(
                cfg.d_model, cfg.num_heads, dim_feedforward=4 * cfg.d_model, dropout=cfg.dropout,
                batch_first=True,
            )
            self.body = nn.TransformerEncoder(layer, cfg.num_layers, enable_nested_tensor=False)
        if cfg.variant == "autoregressive":
            # decision tokens: 0 = start (slot 0), 1..K = class of b_{j-1}, K+1 = slot j-1 absent
            self.decision_embedding = nn.Embedding(self.num_classes + 2, cfg.d_model)
        self.head = nn.Linear(cfg.d_model, self.num_classes)

    # ----------------------------------------------------------------- public interface

    def logits(
        self, h: Tensor, keys: Tensor, scores: Tensor, mask: Tensor, prev_budgets: Tensor | None = None
    ) -> Tensor:
        """Budget logits [N, Z, K]; class c is budget min_budget + c.

        ``prev_budgets`` [N, Z] long is required by the autoregressive variant and
        ignored by the others: the budgets b_0..b_{Z-1} of the trajectory being scored
        (teacher forcing); slot j sees b_{j-1} only. ``uniform`` returns a point mass
        (0 at its class, -inf elsewhere) and ``random`` all zeros.
        """
        self._check_inputs(h, keys, scores, mask)
        prev = None
        if self.cfg.variant == "autoregressive":
            _require(prev_budgets is not None,
                     "the autoregressive budget policy needs prev_budgets (the decisions it conditions on)")
            prev = self._to_classes(prev_budgets, mask)
        with _float32(h):
            return self._logits(h, keys, scores, mask, prev)

    def sample(
        self,
        h: Tensor,
        keys: Tensor,
        scores: Tensor,
        mask: Tensor,
        greedy: bool = False,
        generator: torch.Generator | None = None,
    ) -> BudgetSample:
        """Draw budgets (greedy: the most likely ones) with their log-probs and entropies.

        The autoregressive variant decodes slot by slot, each decision conditioning
        the next. ``greedy`` is ignored by ``random`` (a random allocation stays random
        at evaluation). ``clip_budget`` applies in greedy mode only, after decoding, so
        ``log_prob`` is that of the unclipped action and later slots of the
        autoregressive variant saw the unclipped decisions. Draws use ``generator``
        (on the inputs' device), so a seeded generator gives the same budgets.
        """
        self._check_inputs(h, keys, scores, mask)
        argmax = greedy and self.cfg.variant != "random"
        with _float32(h):
            if self.cfg.variant == "autoregressive":
                logits, classes = self._decode(h, keys, scores, mask, argmax, generator)
            else:
                logits = self._logits(h, keys, scores, mask, None)
                classes = self._choose(logits, argmax, generator)
            classes = torch.where(mask, classes, 0)
            log_prob, entropy = self._log_prob_entropy(logits, classes, mask)
        budgets = torch.where(mask, classes + self.cfg.min_budget, 0)
        if greedy and self.cfg.clip_budget is not None:
            budgets = budgets.clamp_max(self.cfg.clip_budget)
        if greedy and self.cfg.token_cap is not None:
            levels = torch.arange(self.cfg.min_budget, self.cfg.max_budget + 1, device=logits.device, dtype=torch.float32)
            value = (torch.softmax(logits.float(), -1) * levels).sum(-1)  # E[b_j]
            budgets = cap_budgets(budgets, value, mask, self.cfg.token_cap)
        return BudgetSample(budgets, log_prob, entropy)

    def log_prob(
        self, h: Tensor, keys: Tensor, scores: Tensor, mask: Tensor, budgets: Tensor
    ) -> tuple[Tensor, Tensor]:
        """(log pi(b_j) [N, Z], entropy [N, Z]) of given budgets, with gradients; 0 at masked slots.

        Reproduces ``sample(...).log_prob`` for the sampled budgets when the module is
        in the same mode (eval: no dropout); a sample drawn under ``torch.no_grad`` in eval
        mode goes through PyTorch's fused encoder kernel and may differ by ~1e-7. Budgets outside {min_budget..max_budget}
        at present slots raise ValueError; under ``uniform`` any budget other than
        uniform_budget has log-prob -inf.
        """
        self._check_inputs(h, keys, scores, mask)
        classes = self._to_classes(budgets, mask)
        with _float32(h):
            logits = self._logits(h, keys, scores, mask, classes)
            return self._log_prob_entropy(logits, classes, mask)

    # ----------------------------------------------------------------- internals

    def _check_inputs(self, h: Tensor, keys: Tensor, scores: Tensor, mask: Tensor) -> None:
        d = self.hidden_size
        _require(h.dim() == 2 and h.shape[1] == d, f"h must be [N, {d}], got {tuple(h.shape)}")
        n = h.shape[0]
        _require(keys.dim() == 3 and keys.shape[0] == n and keys.shape[2] == d,
                 f"keys must be [N={n}, Z, {d}], got {tuple(keys.shape)}")
        z = keys.shape[1]
        _require(tuple(scores.shape) == (n, z), f"scores must be [N, Z] = [{n}, {z}], got {tuple(scores.shape)}")
        _require(tuple(mask.shape) == (n, z), f"mask must be [N, Z] = [{n}, {z}], got {tuple(mask.shape)}")
        _require(mask.dtype == torch.bool, f"mask must be bool, got {mask.dtype}")
        _require(self.cfg.variant not in LEARNED_VARIANTS or z <= self.cfg.max_rank,
                 f"{z} retrieved memories exceed max_rank ({self.cfg.max_rank}) of the rank embedding")

    def _to_classes(self, budgets: Tensor, mask: Tensor) -> Tensor:
        """Budgets [N, Z] -> class indices [N, Z] long (0 at masked slots); ValueError when out of range."""
        _require(budgets.shape == mask.shape,
                 f"budgets must be [N, Z] = {tuple(mask.shape)}, got {tuple(budgets.shape)}")
        _require(not budgets.is_floating_point() and not budgets.is_complex(),
                 f"budgets must be an integer tensor, got {budgets.dtype}")
        present = budgets[mask]
        lo, hi = self.cfg.min_budget, self.cfg.max_budget
        if present.numel() and bool((present < lo).any() | (present > hi).any()):
            raise ValueError(f"budgets at present slots must lie in {lo}..{hi}, got values in "
                             f"{int(present.min())}..{int(present.max())}")
        return torch.where(mask, budgets.long() - lo, 0)

    def _logits(self, h: Tensor, keys: Tensor, scores: Tensor, mask: Tensor, prev: Tensor | None) -> Tensor:
        """[N, Z, K] logits; ``prev`` [N, Z]: the classes the autoregressive variant conditions on."""
        if self.cfg.variant not in LEARNED_VARIANTS:
            return self._fixed_logits(mask)
        tokens = None
        if self.cfg.variant == "autoregressive":
            assert prev is not None, "the public methods supply prev to the autoregressive variant"
            tokens = self._decision_tokens(prev, mask)
        return self._forward(self._embed(h, keys, scores, mask), mask, tokens)

    def _fixed_logits(self, mask: Tensor) -> Tensor:
        """Constant [N, Z, K] logits of the parameter-free variants."""
        n, z = mask.shape
        if self.cfg.variant == "random":
            return torch.zeros(n, z, self.num_classes, device=mask.device)
        budget = self.cfg.max_budget if self.cfg.uniform_budget is None else self.cfg.uniform_budget
        logits = torch.full((n, z, self.num_classes), -math.inf, device=mask.device)
        logits[..., budget - self.cfg.min_budget] = 0.0
        return logits

    def _embed(self, h: Tensor, keys: Tensor, scores: Tensor, mask: Tensor) -> Tensor:
        """Per-memory inputs [N, Z, d_b]: Linear([h; k_j; h*k_j; s_j]) + rank embedding of j."""
        keys = keys.float()
        h = h.float()
        extra = []
        if self.cfg.features == "normalized":
            h = torch.nn.functional.normalize(h, dim=-1)
            extra = [_standardized(scores.float(), mask)[..., None]]
        hq = h[:, None, :].expand_as(keys)
        parts = [hq, keys, hq * keys] if self.cfg.product_feature else [hq, keys]
        features = torch.cat(parts + [scores.float()[..., None]] + extra, dim=-1)
        # zero absent slots before the projection: NaN garbage there would otherwise reach the
        # other slots through 0-weight attention (0 * NaN) and the weight gradients
        features = torch.where(mask[..., None], features, 0.0)
        # Called as a module, not indexed through .weight: ZeRO-3 gathers a partitioned
        # parameter only inside its module's forward (its dtype is known without the gather).
        # The features follow the weights' dtype: DeepSpeed's bf16 mode casts them to bf16.
        ranks = torch.arange(keys.shape[1], device=features.device)
        return self.input_proj(features.to(self.input_proj.weight.dtype)) + self.rank_embedding(ranks)

    def _decision_tokens(self, classes: Tensor, mask: Tensor) -> Tensor:
        """[N, Z] long: the decision token slot j sees (start, class of b_{j-1} + 1, or absent)."""
        handed_on = torch.where(mask, classes + 1, self.num_classes + 1)
        start = torch.zeros_like(handed_on[:, :1])
        return torch.cat([start, handed_on[:, :-1]], dim=1)

    def _forward(self, x: Tensor, mask: Tensor, tokens: Tensor | None) -> Tensor:
        """[N, Z, d_b] inputs -> [N, Z, K] float32 logits (whatever the parameters' dtype)."""
        if tokens is not None:
            x = x + self.decision_embedding(tokens)
        if self.cfg.variant == "mlp":
            return self.head(self.body(x)).float()
        return self.head(self.body(x, mask=self._attention_mask(mask))).float()

    def _attention_mask(self, mask: Tensor) -> Tensor:
        """[N * heads, Z, Z] bool, True where query slot i may not attend to key slot j."""
        z = mask.shape[1]
        eye = torch.eye(z, dtype=torch.bool, device=mask.device)
        # absent keys are hidden from every other slot; each slot still sees itself, so no
        # softmax row is empty (an empty row, e.g. an all-absent set, would be NaN)
        blocked = ~mask[:, None, :] & ~eye
        if self.cfg.variant == "autoregressive":
            blocked = blocked | torch.ones_like(eye).triu(1)
        return blocked.repeat_interleave(self.cfg.num_heads, dim=0)

    def _decode(
        self, h: Tensor, keys: Tensor, scores: Tensor, mask: Tensor, argmax: bool,
        generator: torch.Generator | None,
    ) -> tuple[Tensor, Tensor]:
        """Autoregressive decoding: (logits [N, Z, K] each computed before its own decision, classes [N, Z])."""
        x = self._embed(h, keys, scores, mask)
        n, z = mask.shape
        classes = torch.zeros(n, z, dtype=torch.long, device=mask.device)
        steps = []
        for j in range(z):
            # the causal mask hides slots > j, so their placeholder decisions do not matter
            step = self._forward(x, mask, self._decision_tokens(classes, mask))[:, j]
            classes[:, j] = self._choose(step, argmax, generator)
            steps.append(step)
        return torch.stack(steps, dim=1), classes

    def _choose(self, logits: Tensor, argmax: bool, generator: torch.Generator | None) -> Tensor:
        """Class per row of logits [..., K] -> [...] long: argmax, or a draw from softmax."""
        if argmax:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits.detach().float(), dim=-1).reshape(-1, self.num_classes)
        if probs.shape[0] == 0:
            return torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
        return torch.multinomial(probs, 1, generator=generator).reshape(logits.shape[:-1])

    def _log_prob_entropy(self, logits: Tensor, classes: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Logits [N, Z, K] and classes [N, Z] -> (log-prob, entropy), each [N, Z] and 0 at masked slots."""
        logp = torch.log_softmax(logits.float(), dim=-1)
        chosen = logp.gather(-1, classes[..., None]).squeeze(-1)
        # clamp so impossible classes (-inf, uniform variant) add 0 * finite instead of 0 * -inf = NaN
        entropy = (logp.exp() * -logp.clamp_min(torch.finfo(logp.dtype).min)).sum(dim=-1)
        return torch.where(mask, chosen, 0.0), torch.where(mask, entropy, 0.0)


def _standardized(scores: Tensor, mask: Tensor) -> Tensor:
    """[N, Z] scores standardised over each row's present slots ((s - mean) / std, std floored at
    1e-3; 0 at absent slots and for a row with one memory)."""
    m = mask.float()
    n = m.sum(-1, keepdim=True).clamp(min=1)
    s = torch.where(mask, scores, 0.0)
    mean = s.sum(-1, keepdim=True) / n
    var = (torch.where(mask, scores - mean, 0.0) ** 2).sum(-1, keepdim=True) / n
    return torch.where(mask, (scores - mean) / var.sqrt().clamp(min=1e-3), 0.0)


def cap_budgets(budgets: Tensor, value: Tensor, mask: Tensor, cap: int) -> Tensor:
    """Budgets [N, Z] within ``cap`` tokens per row, the lowest-value memories cut first.

    Memories are taken in order of ``value`` [N, Z] (highest first; equal values by rank), each
    keeping ``min(b_j, what is left of the cap)``: the memory that crosses the cap is trimmed and
    the ones after it get 0. Rows within the cap are unchanged; masked slots stay 0.
    """
    _require(budgets.shape == value.shape == mask.shape, "budgets, value and mask must all be [N, Z]")
    _require(cap >= 0, f"cap must be >= 0, got {cap}")
    key = torch.where(mask, value.float(), torch.full_like(value, float("-inf"), dtype=torch.float32))
    order = torch.sort(-key, dim=-1, stable=True).indices  # value descending; a stable sort keeps rank order in ties
    b = torch.where(mask, budgets, torch.zeros_like(budgets)).gather(1, order)
    before = b.cumsum(-1) - b  # tokens kept by the higher-value memories
    kept = torch.minimum(b, (cap - before).clamp(min=0))
    return torch.zeros_like(budgets).scatter(1, order, kept)


def spread_budgets(mask: Tensor, max_budget: int, cap: int | None) -> Tensor:
    """Uniform budgets [N, Z]: ``max_budget`` per retrieved memory, or, under a token ``cap``, the
    cap shared out evenly over a row's n memories: ``cap // n`` each and one more for the
    ``cap % n`` highest-ranked, at most ``max_budget`` (the uniform allocation at the same cost
    as a capped policy)."""
    mask = mask.bool()
    if cap is None:
        return torch.where(mask, max_budget, 0).long()
    n = mask.sum(-1, keepdim=True)
    place = mask.long().cumsum(-1) - 1  # 0 for a row's first retrieved memory, 1 for the next, ...
    each = cap // n.clamp(min=1) + (place < cap % n.clamp(min=1)).long()
    return torch.where(mask, each.clamp(max=max_budget), 0).long()


def budget_supervision_loss(logits: Tensor, target: Tensor, mask: Tensor, min_budget: int = 0,
                            positive: Tensor | None = None) -> Tensor:
    """Cross-entropy of the policy's budget logits [N, Z, K] towards target budgets [N, Z] (class
    ``target - min_budget``) over the present slots of ``mask`` [N, Z] (0 without any).

    A departure from the paper (``warmup.budget_weight``): where the data records evidence, the
    target is max_budget for the evidence memories and min_budget for the others, the allocation
    the elastic budget should learn, as ``retrieval_loss`` supervises retrieval. With ``positive``
    [N, Z] (the evidence slots) the classes are balanced: in each set the evidence slots and the
    others weigh half each, so a memory the features cannot tell from the evidence is kept (its
    greedy budget is the larger class) rather than dropped because evidence is 1 of Z; without it,
    the mean over the present slots."""
    _require(logits.dim() == 3 and logits.shape[:2] == target.shape == mask.shape,
             f"logits must be [N, Z, K] and target, mask [N, Z], got {tuple(logits.shape)}, "
             f"{tuple(target.shape)}, {tuple(mask.shape)}")
    if not bool(mask.any()):
        return logits.sum() * 0.0
    classes = (target - min_budget).clamp(0, logits.shape[-1] - 1)
    logp = torch.log_softmax(logits.float(), -1).gather(-1, classes[..., None]).squeeze(-1)
    if positive is None:
        return -(logp * mask).sum() / mask.sum()
    pos, neg = (positive & mask).float(), (~positive & mask).float()
    n_pos, n_neg = pos.sum(-1, keepdim=True), neg.sum(-1, keepdim=True)
    # each set with both kinds weighs 1, half on each kind; a set of one kind weighs 1 on it
    w = torch.where(n_pos > 0, pos / n_pos.clamp(min=1), 0.0) + torch.where(n_neg > 0, neg / n_neg.clamp(min=1), 0.0)
    w = w / ((n_pos > 0).float() + (n_neg > 0).float()).clamp(min=1)
    return -(logp * w).sum() / (mask.any(-1)).sum()
