"""Activation checkpointing of the reasoner's decoder layers (``train.gradient_checkpointing``):
``ElasticMem.enable_activation_checkpointing`` turns it on with these functions.

    python -m pytest -q tests/unit/test_gradient_checkpointing.py
"""

from __future__ import annotations

from typing import Callable

from torch import nn


def enable_checkpointing(base: nn.Module, reentrant: bool, wrap: Callable[[Callable], Callable],
                         kv_cache: bool) -> dict:
    """Recompute ``base``'s decoder layers' activations in backward instead of keeping them; returns
    torch.utils.checkpoint's kwargs (also for the logits of ``ElasticMem._token_logps``' chunks).

    Only forward passes in train mode with gradients are checkpointed (scoring, the warm-up's
    steps): rollouts and evaluation (eval mode, ``no_grad``) run as before, KV cache included.
    ``reentrant``: torch's reentrant variant instead of the non-reentrant one, for DeepSpeed
    ZeRO-3, whose partitioned frozen parameters fail the non-reentrant recompute's checks
    (deepspeedai/DeepSpeed#4332); it needs each layer's input to require grad, which
    transformers' input-embedding hook ensures (installed with it, removed otherwise).
    ``wrap``: applied to each layer's checkpoint function (``ElasticMem._same_adapter_state``);
    ``kv_cache``: the layers read KV memories as a cache (memory.content=kv).
    """
    kwargs = {"use_reentrant": reentrant}
    if hasattr(base, "activation_checkpointing_enable"):  # the newer name (the old one warns)
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if not reentrant:
        # the hook makes every embedding output require grad: only the reentrant variant
        # needs it (it sees no gradient path otherwise when the embeddings are frozen)
        base.disable_input_require_grads()
    for m in base.modules():
        if getattr(m, "_gradient_checkpointing_func", None) is not None:
            m._gradient_checkpointing_func = wrap(m._gradient_checkpointing_func)
        if kv_cache and hasattr(m, "_can_checkpoint_with_cache"):
            # KV memories reach the layers as a cache, which transformers drops from checkpointed
            # layers unless they only read it: ``score`` hands them a read-only one (``read_only``)
            m._can_checkpoint_with_cache = True
    return kwargs
