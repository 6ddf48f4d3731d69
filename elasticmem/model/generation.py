"""Generating and scoring answers after the memories: EOS ids, chunked token log-probabilities, the
decoding config with every sampling knob off, batched generation over soft tokens or per-layer
memory keys and values (with a cache), and decoding the answer ids to text.

Shared by ``ElasticMem`` and every reader that answers through its prompt (``eval/reader.py``).

    python -m pytest -q tests/unit/test_elasticmem.py tests/unit/test_kv_content.py
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Callable

import torch
from torch import nn

from elasticmem.config import MemoryConfig
from elasticmem.model.injection import Assembled, attention_bias


def eos_token_ids(model: nn.Module, tokenizer) -> list[int]:
    """Every token that ends an answer: the model's generation config's EOS ids and the tokenizer's."""
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


LOGIT_CHUNK_ELEMENTS = 2**26
"""Logits (rows x vocabulary) one chunk of ``token_logps`` holds: 256 MB in float32 (441 rows of
Qwen2.5's 152k vocabulary)."""


def token_logps(head: nn.Module, h: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                chunk_elements: int | None = None, recompute: dict | None = None) -> torch.Tensor:
    """``log_softmax(head(h) / temperature)[target]`` of each row: ``h`` [M, d], ``targets`` [M] -> [M] float32.

    The target's logit minus the row's logsumexp, over chunks of at most ``chunk_elements``
    logits (None: ``LOGIT_CHUNK_ELEMENTS``), so the [M, V] logits (in the head's dtype, their
    float32 copy, the scaled copy and the log-softmax: ~10 GB at the warm-up reconstruction's
    16 x 257 rows of a 152k vocabulary) never exist at once. With gradients, autograd still
    keeps each chunk's float32 logits for backward unless ``recompute`` (``torch.utils.checkpoint``'s
    kwargs, e.g. ``{"use_reentrant": False}``) recomputes them there, one chunk at a time, from
    the chunk's rows of ``h``.
    """
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]
    rows = max(1, (chunk_elements or LOGIT_CHUNK_ELEMENTS) // vocab)

    def chunk(hc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
        z = head(hc).float()
        if temperature != 1.0:
            z = z / temperature
        return z.gather(-1, tc[:, None]).squeeze(-1) - torch.logsumexp(z, -1)

    if h.shape[0] <= rows:  # one chunk: nothing to bound by recomputing it
        return chunk(h, targets)
    out = []
    for a in range(0, h.shape[0], rows):
        hc, tc = h[a : a + rows], targets[a : a + rows]
        if recompute is not None and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            out.append(checkpoint(chunk, hc, tc, **recompute))
        else:
            out.append(chunk(hc, tc))
    return torch.cat(out)


def read_only(x: Assembled) -> Assembled:
    """``x`` with its KV memory cache (if any) made read-only: each layer's ``update`` returns the
    memory slots followed by the call's keys and values and stores nothing, so that a layer
    recomputed under activation checkpointing reads the same memories as its first pass (an
    appending cache would hold the text tokens twice by then). For scoring (``use_cache=False``:
    nothing reads the grown cache afterwards)."""
    if x.cache is not None:
        for layer in x.cache.layers:
            layer.update = functools.partial(_prepend_memories, layer)
    return x


def _prepend_memories(layer, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
    return torch.cat([layer.keys, keys], -2), torch.cat([layer.values, values], -2)


def decoding_config(cfg: MemoryConfig, tokenizer, eos_ids: list[int], temperature: float, greedy: bool):
    """Sampling from softmax(logits / temperature) and nothing else (argmax when ``greedy``).

    Every knob of transformers' ``generate`` that changes which token is drawn, or with
    what probability, is set to its off value (``DECODING_OFF``). Unset (None) fields would
    not stay unset: ``generate`` fills them from ``model.generation_config`` (a checkpoint's
    own: Qwen2.5 top_k 20, top_p 0.8, repetition_penalty 1.05; others suppress_tokens,
    bad_words_ids, ...) and then from transformers' defaults (top_k 50); ``generate_answers`` runs
    with a blank model config (``_blank_model_generation_config``) so the off values that
    are None stay None. The recorded log-probs are then of the distribution sampled from.
    """
    from transformers import GenerationConfig

    off = dict(DECODING_OFF)
    if greedy:  # warpers are only built when sampling; top_k=0 would draw a warning about that
        off["top_k"] = None
    return GenerationConfig(
        **off, max_new_tokens=cfg.max_new_tokens, do_sample=not greedy,
        temperature=1.0 if greedy else temperature,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=eos_ids,
        return_dict_in_generate=False,
    )


_STEP_GATE: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("step_gate", default=None)
_PREFILL_CHUNK: contextvars.ContextVar[int | None] = contextvars.ContextVar("prefill_chunk", default=None)


@contextlib.contextmanager
def step_gate(gate: Callable[[], None] | None, prefill_chunk: int | None = None):
    """Inside the block, every answer generation of this thread calls ``gate()`` between two
    decoding steps (None: nothing is called, e.g. in work the gate itself runs); with
    ``prefill_chunk``, prompts longer than that are also read in chunks of that many positions,
    the gate called between two chunks (``chunked_prefill``).

    The server's worker uses it to let other tenants' waiting requests run between the steps of a
    long batch (``serve.worker``). The gate runs on the generating thread with the step's state
    alive, so what it runs must leave the model as it found it (``LiveMemory.preemptible``)."""
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be a positive number of positions or None, got {prefill_chunk}")
    token, chunk = _STEP_GATE.set(gate), _PREFILL_CHUNK.set(prefill_chunk if gate is not None else None)
    try:
        yield
    finally:
        _STEP_GATE.reset(token)
        _PREFILL_CHUNK.reset(chunk)


def chunked_prefill(decoder: nn.Module, attention_mask: torch.Tensor, position_ids: torch.Tensor, *,
                    input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                    upto: int | None = None, cache=None) -> tuple[torch.Tensor, object] | None:
    """The decoder's pass over the first ``upto`` positions (default: all) of a prompt, read in
    chunks when this thread's step gate asks for it (``step_gate(gate, prefill_chunk=C)``) and the
    prompt is longer than C: the gate runs between two chunks and after the last. Returns the final
    states of the last chunk [N, c, d] (its last row is the last position's) and the KV cache of
    every position read; None when no chunking is asked for (the caller runs its one pass).

    Why: a prompt's forward pass is the one piece of a request no decoding step can interrupt;
    on a CPU a 4096-token prompt on SmolLM2 takes seconds. Read in chunks over the cache, the same
    positions see the same keys (the attention mask up to the chunk's end, the caller's position
    ids), so the states equal one pass's up to float error (``tests/unit/test_serve_preemption.py``).

    ``attention_mask`` [N, L] (left padding), or [N, 1, L, M + L] over a ``cache`` that already holds
    M slots (KV memories: ``injection.assemble``'s mask, rows cut to the chunk, columns to what it
    sees); ``position_ids`` [N, L]; ``input_ids`` [N, L] or ``inputs_embeds`` [N, L, d].
    """
    gate, chunk = _STEP_GATE.get(), _PREFILL_CHUNK.get()
    x = input_ids if input_ids is not None else inputs_embeds
    n = x.shape[1] if upto is None else upto
    if gate is None or chunk is None or n <= chunk:
        return None
    if cache is None:
        from transformers import DynamicCache

        cache = DynamicCache(config=decoder.config)
    slots = attention_mask.shape[-1] - x.shape[1]  # a 4D mask's columns before the text
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        if start:
            gate()
        part = {"input_ids": x[:, start:end]} if input_ids is not None else {"inputs_embeds": x[:, start:end]}
        mask = attention_mask[:, :end] if attention_mask.dim() == 2 else attention_mask[:, :, start:end, :slots + end]
        out = decoder(**part, attention_mask=mask, position_ids=position_ids[:, start:end], cache=cache,
                      use_cache=True)
    gate()
    return out.last_hidden_state, cache


def _gate_criterion():
    """``generate``'s stopping criterion that calls the thread's step gate and stops nothing; None
    without a gate."""
    gate = _STEP_GATE.get()
    if gate is None:
        return None
    from transformers import StoppingCriteria

    class Gate(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            gate()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return Gate()


def generate_answers(lm: nn.Module, base: nn.Module, generation_config, batch_in: Assembled, eos_ids: list[int],
                     pad_id: int, temperature: float, greedy: bool):
    """Answer tokens [N, T], their mask (up to the first EOS) and log-probs at the temperature.

    Greedy rollouts (evaluation) do no log-prob work: their ``logp_answer`` is 0, nothing
    reads it. Sampled rollouts gather the drawn token's log-prob step by step
    (``_answer_logp_hooks``), so at most one step's [N, V] log-softmax is alive, instead of
    ``output_logits``' T steps of [N, V] float32 plus a stacked copy and a log-softmax of it
    (0.6 GB each at N=64, T=16, V=152k). ``benchmarks/rollout_memory.py`` measures it.
    """
    if batch_in.cache is not None:
        return _generate_with_cache(base, generation_config.max_new_tokens, batch_in, eos_ids, pad_id, temperature,
                                    greedy)
    hooks: dict = {}
    if not greedy:
        record, gather, steps = _answer_logp_hooks(temperature)
        hooks = dict(logits_processor=[record], stopping_criteria=[gather])
    gate = _gate_criterion()
    if gate is not None:  # after ``gather``: the step's log-prob is taken before other work runs
        hooks.setdefault("stopping_criteria", []).append(gate)
    mask = batch_in.attention_mask
    # all but the last position: generate's own pass over that one gives the first token's logits
    pre = chunked_prefill(base.get_decoder(), mask, (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0),
                          inputs_embeds=batch_in.embeds, upto=batch_in.embeds.shape[1] - 1)
    if pre is not None:  # generate reads only the positions its cache does not hold
        hooks["cache"] = pre[1]
    with _blank_model_generation_config(base):
        # With inputs_embeds and no input_ids, a decoder-only generate returns the new tokens only.
        ids = lm.generate(inputs_embeds=batch_in.embeds, attention_mask=mask,
                          generation_config=generation_config, **hooks)
    T = ids.shape[1]
    if greedy:
        logp = torch.zeros(ids.shape)
    else:  # generate may run a step it then undoes (deferred stop check on mps): keep T
        logp = torch.stack(steps[:T], 1).cpu()
    ids = ids.cpu()
    eos = torch.isin(ids, torch.tensor(eos_ids, dtype=ids.dtype))
    after_eos = (eos.cumsum(-1) - eos.long()) > 0  # strictly after the first EOS
    mask = ~after_eos
    ids = torch.where(mask, ids, torch.full_like(ids, pad_id))
    return ids, mask, torch.where(mask, logp, torch.zeros_like(logp))


def _generate_with_cache(base: nn.Module, max_new_tokens: int, x: Assembled, eos_ids: list[int], pad_id: int,
                         temperature: float, greedy: bool):
    """``generate_answers`` for an input that starts from a KV cache (memory.content=kv).

    transformers' ``generate`` cannot continue from a cache whose slots sit at positions of our
    choosing behind a custom 4D mask, so this is its sampling loop written out for the one case
    used here: plain sampling from softmax(logits / temperature), or argmax, with nothing else
    (``DECODING_OFF``), stopping at EOS or ``max_new_tokens``; rows that ended get ``pad_id``
    while the others continue, and the loop stops once every row has ended, as ``generate`` does.
    Returns (ids [N, T], mask up to the first EOS, log-probs of the drawn tokens at the
    temperature; zeros when greedy).
    """
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    pre = chunked_prefill(decoder, x.attention_mask, x.position_ids, inputs_embeds=x.embeds, cache=x.cache)
    if pre is None:
        out = decoder(**x.forward_kwargs(), use_cache=True)
        pre = out.last_hidden_state, out.cache
    h, cache = pre[0][:, -1], pre[1]
    valid = torch.cat([x.past_valid, x.text_valid], 1)
    pos = x.position_ids[:, -1] + 1
    N, device = h.shape[0], h.device
    eos = torch.tensor(eos_ids, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    ids, logps = [], []
    gate = _STEP_GATE.get()
    for _ in range(max_new_tokens):
        if gate is not None and ids:
            gate()
        logits = head(h).float()
        if greedy:
            tok = logits.argmax(-1)
            logps.append(torch.zeros(N, device=device))
        else:
            logp = torch.log_softmax(logits / temperature, -1)
            tok = torch.multinomial(logp.exp(), 1).squeeze(1)
            logps.append(logp.gather(1, tok[:, None]).squeeze(1))
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        ids.append(tok)
        done = done | torch.isin(tok, eos)
        if bool(done.all()) or len(ids) == max_new_tokens:
            break
        valid = torch.cat([valid, torch.ones(N, 1, dtype=torch.bool, device=device)], 1)
        mask = valid[:, None, None, :]
        if x.attention_mask.dtype != torch.bool:  # the eager attention's additive form, as assemble made it
            mask = attention_bias(mask, x.embeds.dtype)
        out = decoder(input_ids=tok[:, None], attention_mask=mask, position_ids=pos[:, None], cache=cache,
                      use_cache=True)
        cache, h, pos = out.cache, out.last_hidden_state[:, -1], pos + 1
    ids_t, logp = torch.stack(ids, 1).cpu(), torch.stack(logps, 1).cpu()
    is_eos = torch.isin(ids_t, torch.tensor(eos_ids, dtype=ids_t.dtype))
    mask = ~((is_eos.cumsum(-1) - is_eos.long()) > 0)
    ids_t = torch.where(mask, ids_t, torch.full_like(ids_t, pad_id))
    return ids_t, mask, torch.where(mask, logp, torch.zeros_like(logp))


def decode_answers(tokenizer, ids: torch.Tensor, mask: torch.Tensor, eos_ids: list[int]) -> list[str]:
    """The answer text of each row of ``generate_answers``' tokens [N, T]: up to the first EOS, stripped."""
    ends = torch.isin(ids, torch.tensor(eos_ids, dtype=ids.dtype))
    return [tokenizer.decode(row[m], skip_special_tokens=True).strip() for row, m in zip(ids, mask & ~ends)]


# Every GenerationConfig field that transformers 5's generate reads to pick the next token, at
# its off value. Enumerated from GenerationMixin._get_logits_processor (processors and, when
# sampling, warpers), GenerationConfig.get_generation_mode (beam / contrastive / DoLa / assisted
# decoding instead of plain sampling or greedy) and GenerationMixin._get_stopping_criteria
# (stops other than EOS and max_new_tokens); tests/unit/test_elasticmem.py reads those sources
# and fails if the installed transformers reads a field missing here.
DECODING_OFF: dict = dict(
    # _get_logits_processor: processors (greedy and sampling)
    guidance_scale=None, sequence_bias=None, encoder_repetition_penalty=1.0, repetition_penalty=1.0,
    no_repeat_ngram_size=0, encoder_no_repeat_ngram_size=0, bad_words_ids=None,
    min_new_tokens=0, min_length=None,  # generate sets min_length from min_new_tokens (and warns if both are set)
    forced_bos_token_id=None, forced_eos_token_id=None, remove_invalid_values=False,
    exponential_decay_length_penalty=None, suppress_tokens=None, begin_suppress_tokens=None,
    # _get_logits_processor: warpers (sampling only; temperature is set by generation_config)
    top_h=None, top_k=0, top_p=1.0, min_p=None, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0,
    watermarking_config=None, renormalize_logits=False,
    # get_generation_mode: plain sampling / greedy search, one sequence per input
    num_beams=1, num_beam_groups=1, num_return_sequences=1, diversity_penalty=0.0, length_penalty=1.0,
    early_stopping=False, constraints=None, force_words_ids=None, penalty_alpha=None, dola_layers=None,
    use_mtp=False, prompt_lookup_num_tokens=None, assistant_early_exit=None,
    # _get_stopping_criteria: EOS and max_new_tokens only
    max_length=None, max_time=None, stop_strings=None, token_healing=False,
)


@contextlib.contextmanager
def _blank_model_generation_config(model: nn.Module):
    """Run ``generate`` with a blank ``model.generation_config``.

    transformers 5 (``GenerationMixin._prepare_generation_config``) fills every field that is
    None in the config passed to ``generate`` from ``model.generation_config``, and several
    processors are off only as None (suppress_tokens, bad_words_ids, forced_bos_token_id, min_p,
    watermarking_config, ...): without this a checkpoint's values would leak into sampling.
    """
    from transformers import GenerationConfig

    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


def _answer_logp_hooks(temperature: float):
    """A logits processor and a stopping criterion that record log softmax(logits / T)[token].

    transformers' sampling loop calls, per step: the logits processors on the step's float32
    logits [N, V], the token draw, then the stopping criteria with ``input_ids`` ending in the
    drawn token. ``record`` keeps the step's log-softmax; ``gather`` takes the drawn token's
    entry and drops it. Returns (record, gather, steps): ``steps`` fills with one [N] tensor per
    step. transformers puts user processors after its own processors (all off here, see
    ``generation_config``) and before its warpers (only the temperature is on): ``record`` sees
    the raw logits, and the token is drawn from softmax(logits / T), the recorded distribution.
    """
    from transformers import LogitsProcessor, StoppingCriteria

    steps: list[torch.Tensor] = []
    current: list[torch.Tensor] = []

    class Record(LogitsProcessor):
        def __call__(self, input_ids, scores):
            current[:] = [torch.log_softmax(scores.float() / temperature, -1)]
            return scores

    class Gather(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            steps.append(current.pop().gather(1, input_ids[:, -1:]).squeeze(1))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return Record(), Gather(), steps
