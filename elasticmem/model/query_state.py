"""Step 1 of a trajectory (DESIGN.md section 1 item 2): the query state h that retrieval searches
with, per ``memory.retrieval`` mode, and in mode 'control' the retrieval-control token a drawn by
the reasoner (with its log-probability) whose final-layer state h is. ``ElasticMem._query_states``
calls this.

    python -m pytest -q tests/unit/test_query_state.py tests/unit/test_retrieval_options.py
"""

from __future__ import annotations

import torch

from elasticmem.model.generation import chunked_prefill
from elasticmem.model.injection import left_pad
from elasticmem.model.retrieval import key_query_ids
from elasticmem.model.steps import Steps


def query_states(model: Steps, prompts: list[list[int]], questions: list[str], G: int, greedy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Control tokens [B*G] (-1 in modes without one), their log-probs [B*G] (0 there) and query
    states [B*G, d_h] for B prompts (token ids) and their ``questions``, G trajectories each."""
    B, device, mode = len(prompts), model.device, model.cfg.retrieval
    if mode == "semantic":
        h = model.semantic.encode_queries(questions).to(device).repeat_interleave(G, 0)
        return torch.full((B * G,), -1, dtype=torch.long), torch.zeros(B * G), h
    if mode == "recent":  # no query: the latest chunks are taken
        h = torch.zeros(B * G, model.bank.hidden_size, device=device)
        return torch.full((B * G,), -1, dtype=torch.long), torch.zeros(B * G), h
    if mode in ("mean", "prompt", "layer_mean"):  # the bank's key function on the question, adapter off
        h = key_like_states(model, questions).repeat_interleave(G, 0)
        return torch.full((B * G,), -1, dtype=torch.long), torch.zeros(B * G), h
    ids, mask = left_pad(prompts, model.tokenizer.pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with model._decoder(disable_adapter=mode == "frozen"):
        # only the last position's states are read below, and the cache: a chunked read gives both
        chunked = chunked_prefill(model.base.get_decoder(), mask, pos, input_ids=ids)
        H, cache = chunked or model._forward_hidden(input_ids=ids, attention_mask=mask, position_ids=pos,
                                                    use_cache=mode == "control")
    if mode != "control":
        h = H[:, -1].float().repeat_interleave(G, 0)
        return torch.full((B * G,), -1, dtype=torch.long), torch.zeros(B * G), h
    logits = model._logits(H[:, -1]) / (1.0 if greedy else model.cfg.control_temperature)
    logp = torch.log_softmax(logits, -1)  # [B, V]
    if greedy:
        a = logp.argmax(-1, keepdim=True).expand(B, G)
    else:
        a = torch.multinomial(logp.exp(), G, replacement=True)  # [B, G]
    logp_a = logp.gather(1, a).reshape(-1)
    cache.batch_repeat_interleave(G)
    mask_g = torch.cat([mask.repeat_interleave(G, 0), torch.ones(B * G, 1, dtype=torch.long, device=device)], 1)
    pos_a = mask.sum(-1, keepdim=True).repeat_interleave(G, 0)
    H_a, _ = model._forward_hidden(input_ids=a.reshape(-1, 1), attention_mask=mask_g, position_ids=pos_a,
                                   cache=cache, use_cache=True)
    return a.reshape(-1).cpu(), logp_a.cpu(), H_a[:, -1].float()


def key_like_states(model: Steps, questions: list[str]) -> torch.Tensor:
    """[B, d] query states of retrieval 'mean' / 'layer_mean' (the question tokenised as the
    bank's chunks, pooled like its keys) and 'prompt' (last state of memory.query_template)."""
    from elasticmem.bank.encoding import key_states

    ids, spec = key_query_ids(model.cfg, model.bank, model.tokenizer, questions)
    with model._decoder(disable_adapter=True):
        return key_states(model.base.get_decoder(), ids, spec, model.tokenizer.pad_token_id)
