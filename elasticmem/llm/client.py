"""LLM backends and the wrapper that turns their outputs into validated JSON.

Both backends implement the one protocol that ``StructuredLLM`` wraps and share its statistics; the
local backend's constrained decoding is ``elasticmem.llm.constrained``.

Shared by the text-memory baselines (A-Mem, Mem0-style text memory), the agent's skill cards and
the local OpenAI-compatible server (``elasticmem.baselines.openai_server``).

Backends implement ``generate(requests, temperature, seed) -> [Completion]`` for a batch of
chat requests, plus token counting:

* ``TransformersBackend``: a local causal LM (SmolLM2-135M-Instruct offline, Qwen for users who
  have it). With ``constrained=True`` a request's JSON schema drives a logits processor that only
  lets through tokens that keep the output a valid prefix of the schema's canonical form
  (``structured.Matcher``), so every finished JSON answer parses and validates by construction.
  Requests are batched (left padding; each row keeps its own budget and stop rule).
* ``OpenAIBackend``: any OpenAI-compatible ``/v1/chat/completions`` server (vLLM, SGLang, Ollama,
  OpenAI), with timeouts, retries with back-off, structured output (``response_format``
  json_schema, downgraded once to a portable schema, then JSON mode, then prompt-only when the
  server refuses it) and concurrent requests.

``StructuredLLM`` sits on top: it parses and validates JSON answers, retries the failed ones
(sampled), and after ``json_retries`` uses a caller-given fallback, which is counted and logged,
never silent. ``LLMStats`` keeps calls, attempts, valid answers, fallbacks, tokens and seconds
per kind of call (note, decision, expansion, answer).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from elasticmem.config import AMemLLMConfig
from elasticmem.llm.constrained import DecodeRow, NgramBan, TokenChooser, vocab_info
from elasticmem.llm.structured import Matcher, Obj, normalise, parse_json_object
from elasticmem.model.injection import left_pad

logger = logging.getLogger(__name__)

Messages = list[dict[str, str]]


@dataclass
class GenRequest:
    """One chat completion to produce."""

    messages: Messages
    max_new_tokens: int
    schema: Obj | None = None
    """The JSON answer's schema; None = free text."""
    stop: tuple[str, ...] = ()
    """Free text only: the answer is cut at the first of these strings."""
    kind: str = "text"
    """What the call is for (note, decision, expansion, answer): the statistics are kept per kind."""
    no_repeat_ngram: int = 0
    """Local decoding only (``TransformersBackend``): no token may complete an n-gram of this many
    tokens that is already in the prompt or the answer (transformers' ``no_repeat_ngram_size``),
    so a small model can neither loop on a phrase nor copy a span of the prompt; JSON structure
    the schema forces, or needs where every valid token is banned, is exempt. 0 = off. Servers
    ignore it."""


@dataclass
class Completion:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finished: bool = True
    """False when the generation budget ran out before the answer ended."""


class LLMBackend(Protocol):
    name: str

    def generate(self, requests: Sequence[GenRequest], temperature: float = 0.0, seed: int = 0) -> list[Completion]:
        """Completions in request order; temperature 0 = greedy."""
        ...

    def count_tokens(self, text: str) -> int:
        """Tokens of a piece of prompt text (for the task/memory split of the token accounting)."""
        ...


# --------------------------------------------------------------------------- statistics


@dataclass
class KindStats:
    calls: int = 0
    """Logical requests (one per note, decision, question ...)."""
    attempts: int = 0
    """Generations, retries included."""
    valid_attempts: int = 0
    """Generations whose JSON parsed and validated (free-text calls: all of them)."""
    valid_first: int = 0
    """Requests valid at the first attempt."""
    fallbacks: int = 0
    """Requests that used the fallback after every attempt failed."""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0


@dataclass
class LLMStats:
    by_kind: dict[str, KindStats] = field(default_factory=dict)

    def kind(self, name: str) -> KindStats:
        return self.by_kind.setdefault(name, KindStats())

    def total(self, json_only: bool = False) -> KindStats:
        out = KindStats()
        for name, s in self.by_kind.items():
            if json_only and name == "answer":
                continue
            for f in ("calls", "attempts", "valid_attempts", "valid_first", "fallbacks", "prompt_tokens",
                      "completion_tokens"):
                setattr(out, f, getattr(out, f) + getattr(s, f))
            out.seconds += s.seconds
        return out

    @property
    def valid_json_rate(self) -> float:
        """Fraction of JSON generations (retries included) that parsed and validated."""
        t = self.total(json_only=True)
        return t.valid_attempts / t.attempts if t.attempts else float("nan")

    def to_dict(self) -> dict[str, Any]:
        t = self.total(json_only=True)
        return {
            "valid_json_rate": self.valid_json_rate,
            "json_valid_first_rate": t.valid_first / t.calls if t.calls else float("nan"),
            "json_fallbacks": t.fallbacks,
            "by_kind": {k: asdict(v) for k, v in sorted(self.by_kind.items())},
        }


@dataclass
class CallResult:
    """What a request produced after validation and retries."""

    value: Any
    """The validated, normalised JSON value; the fallback value after every attempt failed; the
    text for free-text requests."""
    text: str
    """The last raw output."""
    ok: bool
    attempts: int
    fallback: bool
    errors: list[str]
    prompt_tokens: int
    """Summed over attempts (what the call really cost)."""
    completion_tokens: int

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class StructuredLLM:
    """Validated JSON and plain text from any backend, with retries, fallbacks and statistics."""

    def __init__(self, backend: LLMBackend, json_retries: int = 2, retry_temperature: float = 0.7):
        self.backend = backend
        self.json_retries = json_retries
        self.retry_temperature = retry_temperature
        self.stats = LLMStats()

    @classmethod
    def from_config(cls, cfg: AMemLLMConfig, backbone=None) -> StructuredLLM:
        backend: LLMBackend
        if cfg.backend == "transformers":
            backend = TransformersBackend.from_config(cfg, backbone)
        else:
            backend = OpenAIBackend(cfg)
        return cls(backend, cfg.json_retries, cfg.retry_temperature)

    def count_tokens(self, text: str) -> int:
        return self.backend.count_tokens(text)

    def json(self, requests: Sequence[GenRequest], fallbacks: Sequence[Callable[[], Any]]) -> list[CallResult]:
        """Validated JSON for each request; ``fallbacks[i]()`` is used when request i keeps failing."""
        if len(fallbacks) != len(requests):
            raise ValueError("one fallback per request")
        results: list[CallResult | None] = [None] * len(requests)
        spent = [[0, 0] for _ in requests]
        last: list[tuple[str, list[str]]] = [("", []) for _ in requests]
        pending = list(range(len(requests)))
        for attempt in range(self.json_retries + 1):
            if not pending:
                break
            temp = 0.0 if attempt == 0 else self.retry_temperature
            t0 = time.perf_counter()
            outs = self.backend.generate([requests[i] for i in pending], temperature=temp, seed=attempt)
            dt = (time.perf_counter() - t0) / len(pending)
            still = []
            for i, out in zip(pending, outs):
                req = requests[i]
                st = self.stats.kind(req.kind)
                st.attempts += 1
                st.seconds += dt
                st.prompt_tokens += out.prompt_tokens
                st.completion_tokens += out.completion_tokens
                spent[i][0] += out.prompt_tokens
                spent[i][1] += out.completion_tokens
                value, errors = _parse(out, req.schema)
                if not errors:
                    st.valid_attempts += 1
                    if attempt == 0:
                        st.valid_first += 1
                    results[i] = CallResult(value, out.text, True, attempt + 1, False, [], *spent[i])
                else:
                    last[i] = (out.text, errors)
                    still.append(i)
            pending = still
        for i in pending:
            req = requests[i]
            st = self.stats.kind(req.kind)
            st.fallbacks += 1
            text, errors = last[i]
            logger.warning("A-Mem %s call gave no valid JSON after %d attempts (%s); using the fallback. "
                           "Last output: %.200r", req.kind, self.json_retries + 1, "; ".join(errors[:3]), text)
            results[i] = CallResult(fallbacks[i](), text, False, self.json_retries + 1, True, errors, *spent[i])
        for r, req in zip(results, requests):
            self.stats.kind(req.kind).calls += 1
        return results  # type: ignore[return-value]

    def text(self, requests: Sequence[GenRequest]) -> list[CallResult]:
        """Greedy free text, cut at each request's stop strings and stripped."""
        t0 = time.perf_counter()
        outs = self.backend.generate(list(requests), temperature=0.0, seed=0)
        dt = (time.perf_counter() - t0) / max(1, len(requests))
        results = []
        for req, out in zip(requests, outs):
            st = self.stats.kind(req.kind)
            st.calls += 1
            st.attempts += 1
            st.valid_attempts += 1
            st.valid_first += 1
            st.seconds += dt
            st.prompt_tokens += out.prompt_tokens
            st.completion_tokens += out.completion_tokens
            text = cut_at_stop(out.text, req.stop).strip()
            results.append(CallResult(text, out.text, True, 1, False, [], out.prompt_tokens, out.completion_tokens))
        return results


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    cut = len(text)
    for s in stops:
        j = text.find(s)
        if j != -1:
            cut = min(cut, j)
    return text[:cut]


def _parse(out: Completion, schema: Obj | None) -> tuple[Any, list[str]]:
    if schema is None:
        return out.text, []
    try:
        value = parse_json_object(out.text)
    except ValueError as e:
        reason = "the output was cut by the token budget" if not out.finished else str(e)
        return None, [reason]
    errors = schema.validate(value)
    if errors:
        return None, errors
    return normalise(value, schema), []


# --------------------------------------------------------------------------- local transformers


class TransformersBackend:
    """A local causal LM with batched, optionally constrained generation."""

    MIN_SHARED_PREFIX = 16
    """Fewest common prompt tokens worth a prefill of their own."""

    def __init__(self, model, tokenizer, batch_size: int = 8, constrained: bool = True, name: str = "transformers",
                 share_prefix: bool = True, drop_closed: bool = True):
        """``share_prefix``: prefill the batch's common prompt prefix once (``_prefill``).
        ``drop_closed``: take rows that have finished out of the batch (and their KV cache) instead
        of feeding them padding until the longest row ends."""
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.constrained = constrained
        self.name = name
        self.share_prefix = share_prefix
        self.drop_closed = drop_closed
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.eos_id = int(tokenizer.eos_token_id)

    @classmethod
    def from_config(cls, cfg: AMemLLMConfig, backbone=None) -> TransformersBackend:
        """Load ``cfg.model`` with elasticmem.backbone, or reuse an already loaded ``backbone``."""
        if backbone is None:
            from elasticmem.backbone import load_backbone
            from elasticmem.config import BackboneConfig

            backbone = load_backbone(BackboneConfig(name_or_path=cfg.model, device=cfg.device, dtype=cfg.dtype))
        return cls(backbone.model, backbone.tokenizer, cfg.batch_size, cfg.constrained, name=cfg.model)

    def render(self, messages: Messages) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenRequest], temperature: float = 0.0, seed: int = 0) -> list[Completion]:
        prompts = [self.render(r.messages) for r in requests]
        lengths = [len(self.tokenizer(p, add_special_tokens=False).input_ids) for p in prompts]
        # Similar lengths together: less padding per batch.
        order = sorted(range(len(requests)), key=lambda i: lengths[i])
        out: list[Completion | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            for i, c in zip(idx, self._generate_batch([requests[i] for i in idx], [prompts[i] for i in idx],
                                                      temperature, seed)):
                out[i] = c
        return out  # type: ignore[return-value]

    def _prefill(self, token_ids: list[list[int]], cache, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the prompts into ``cache``; the last position's logits [B, V] and the attention mask.

        The rows' common token prefix (A-Mem's calls of one kind share their instructions: about
        200-300 tokens of a 300-800-token prompt) is run once and its cache repeated over the
        batch, when ``share_prefix`` and it is at least ``MIN_SHARED_PREFIX`` tokens; each row's
        rest follows, left-padded, so padding sits between the prefix and the row's own tokens
        (masked, positions counted over real tokens only). Only the last position's logits are
        computed (the [B, L, V] float32 logits of a 49k vocabulary were a fifth of the prefill)."""
        dev = self.model.device
        shared = 0
        if self.share_prefix and len(token_ids) > 1:
            first, shortest = token_ids[0], min(len(t) for t in token_ids)
            while shared < shortest - 1 and all(t[shared] == first[shared] for t in token_ids):
                shared += 1
            if shared < self.MIN_SHARED_PREFIX:
                shared = 0
        rests = [t[shared:] for t in token_ids]
        ids, rest_mask = left_pad(rests, pad)
        if shared:
            self.model(input_ids=torch.tensor([token_ids[0][:shared]], device=dev), cache=cache, use_cache=True,
                       logits_to_keep=1)
            cache.batch_repeat_interleave(len(rests))
        mask = torch.cat([torch.ones((len(rests), shared), dtype=torch.long), rest_mask], dim=1)
        positions = shared + (rest_mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=positions.to(dev),
                         cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :].float(), mask.to(dev)

    def _generate_batch(self, requests: list[GenRequest], prompts: list[str], temperature: float,
                        seed: int) -> list[Completion]:
        """Own decoding loop (KV cache, left padding): unlike ``generate`` it can append several
        forced tokens to a row in one forward pass (JSON keys and brackets cost no extra steps);
        rows appending fewer tokens in a step are padded with masked positions."""
        from transformers import DynamicCache

        vocab = vocab_info(self.tokenizer)
        rows = []
        for r in requests:
            matcher = Matcher(r.schema) if (r.schema is not None and self.constrained) else None
            rows.append(DecodeRow(budget=r.max_new_tokens, matcher=matcher, stops=tuple(r.stop)))
        dev = self.model.device
        token_ids = self.tokenizer(prompts, add_special_tokens=False)["input_ids"]
        for row, r, row_ids in zip(rows, requests, token_ids):
            if r.no_repeat_ngram > 0:
                row.ngrams = NgramBan(r.no_repeat_ngram, row_ids)
        prompt_tokens = [len(t) for t in token_ids]
        next_pos = torch.tensor(prompt_tokens)  # position of each row's next real token
        gen = torch.Generator().manual_seed(seed)
        chooser = TokenChooser(self.tokenizer, vocab, self.eos_id, temperature, gen)
        pad = int(self.tokenizer.pad_token_id)
        cache = DynamicCache()
        logits, mask = self._prefill(token_ids, cache, pad)
        live = list(range(len(rows)))  # the rows in the cache, in cache order
        while True:
            # One copy of the step's [B, V] logits to the host: the chooser works row by row in
            # Python with host tables (token ids by first character, a CPU sampling generator), so
            # device logits would mix devices there (a CPU tensor indexed by a CUDA argsort, CUDA
            # probabilities sampled with a CPU generator: errors) and sync once per row anyway.
            host = logits.cpu()
            steps = [[] if rows[i].closed else chooser.next_tokens(rows[i], host[b]) for b, i in enumerate(live)]
            if all(rows[i].closed for i in live):
                break
            if self.drop_closed and any(rows[i].closed for i in live):
                # Rows finish at very different lengths (A-Mem's answers: 30 to 180 tokens in one
                # batch); a finished row left in would cost as much per step as a live one.
                keep = [b for b, i in enumerate(live) if not rows[i].closed]
                index = torch.tensor(keep, device=dev)
                cache.batch_select_indices(index)
                mask, next_pos = mask[index], next_pos[keep]
                steps, live = [steps[b] for b in keep], [live[b] for b in keep]
            width = max(len(t) for t in steps)
            new_ids = torch.full((len(live), width), pad, dtype=torch.long)
            new_mask = torch.zeros((len(live), width), dtype=mask.dtype)
            new_pos = torch.zeros((len(live), width), dtype=torch.long)
            for b, toks in enumerate(steps):
                n = len(toks)
                if n:
                    new_ids[b, :n] = torch.tensor(toks)
                    new_mask[b, :n] = 1
                new_pos[b] = next_pos[b] + torch.arange(width).clamp(max=max(0, n - 1))
            new_ids, new_mask, new_pos = new_ids.to(dev), new_mask.to(dev), new_pos.to(dev)
            mask = torch.cat([mask, new_mask], dim=1)
            out = self.model(input_ids=new_ids, attention_mask=mask, position_ids=new_pos, cache=cache,
                             use_cache=True)
            last = torch.tensor([max(0, len(t) - 1) for t in steps], device=dev)
            logits = out.logits[torch.arange(len(live), device=dev), last].float()
            next_pos = next_pos + torch.tensor([len(t) for t in steps], device=next_pos.device)
        outs = []
        for row, pt in zip(rows, prompt_tokens):
            if row.matcher is not None:
                text = row.text  # exactly what the matcher accepted
            else:
                text = self.tokenizer.decode(row.tokens, skip_special_tokens=True)
            outs.append(Completion(text, int(pt), len(row.tokens), row.finished))
        return outs


# --------------------------------------------------------------------------- OpenAI-compatible HTTP


def _httpx():
    """httpx, or its fork httpx2 (what huggingface_hub installs): the same client API."""
    try:
        import httpx

        return httpx
    except ImportError:
        try:
            import httpx2

            return httpx2
        except ImportError:
            raise ImportError("the 'openai' A-Mem backend needs an HTTP client: pip install httpx") from None


_PORTABLE_DROP = {"minLength", "maxLength", "minItems", "maxItems"}


def portable_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema without length keywords, which some servers' strict modes reject."""
    if isinstance(schema, dict):
        return {k: portable_schema(v) for k, v in schema.items() if k not in _PORTABLE_DROP}
    if isinstance(schema, list):
        return [portable_schema(v) for v in schema]
    return schema


class ServerError(RuntimeError):
    """The server did not answer after every retry, or refused the request."""


class OpenAIBackend:
    """``POST {api_base}/chat/completions`` with retries, back-off and structured output."""

    MODES = ("json_schema", "json_schema_portable", "json_object", "none")

    def __init__(self, cfg: AMemLLMConfig, client=None, tokenizer=None, sleep: Callable[[float], None] = time.sleep):
        self.cfg = cfg
        self.name = cfg.model
        hx = _httpx()
        self._hx = hx
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self.client = client if client is not None else hx.Client(timeout=cfg.timeout_s)
        self.headers = headers
        self.url = cfg.api_base.rstrip("/") + "/chat/completions"
        self.mode = cfg.structured_output
        self.sleep = sleep
        self.tokenizer = tokenizer
        if self.tokenizer is None and cfg.tokenizer:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer, local_files_only=True)

    def count_tokens(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer(text, add_special_tokens=False).input_ids)
        return math.ceil(len(text) / 4)  # rough estimate; set llm.tokenizer for exact counts

    def generate(self, requests: Sequence[GenRequest], temperature: float = 0.0, seed: int = 0) -> list[Completion]:
        if len(requests) <= 1 or self.cfg.batch_size <= 1:
            return [self._one(r, temperature, seed) for r in requests]
        # The server batches concurrent requests (continuous batching in vLLM/SGLang).
        with ThreadPoolExecutor(max_workers=self.cfg.batch_size) as pool:
            return list(pool.map(lambda r: self._one(r, temperature, seed), requests))

    def _payload(self, req: GenRequest, temperature: float, seed: int) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": self.cfg.model, "messages": req.messages, "max_tokens": req.max_new_tokens,
            "temperature": temperature,
        }
        if temperature > 0:
            payload["seed"] = seed
        if req.stop:
            payload["stop"] = list(req.stop)
        if req.schema is not None and self.mode != "none":
            if self.mode == "json_object":
                payload["response_format"] = {"type": "json_object"}
            else:
                schema = req.schema.to_json_schema()
                if self.mode == "json_schema_portable":
                    schema = portable_schema(schema)
                payload["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": req.kind or "answer", "schema": schema, "strict": True},
                }
        return payload

    def _downgrade(self, detail: str) -> bool:
        i = self.MODES.index(self.mode)
        if i + 1 >= len(self.MODES):
            return False
        old, self.mode = self.mode, self.MODES[i + 1]
        logger.warning("server %s refused response_format mode %r (%s); using %r from now on",
                       self.url, old, detail[:200], self.mode)
        return True

    def _one(self, req: GenRequest, temperature: float, seed: int) -> Completion:
        hx = self._hx
        tries = 0
        while True:
            payload = self._payload(req, temperature, seed)
            try:
                resp = self.client.post(self.url, json=payload, headers=self.headers, timeout=self.cfg.timeout_s)
            except (hx.TimeoutException, hx.TransportError) as e:
                err = f"{type(e).__name__}: {e}"
            else:
                if resp.status_code == 200:
                    return self._completion(resp.json(), req)
                body = resp.text
                refused_format = resp.status_code == 400 and "response_format" in payload and (
                    "response_format" in body or "json_schema" in body or "schema" in body)
                if refused_format and self._downgrade(body):
                    continue  # not a failed try: the same request in a mode the server takes
                if resp.status_code != 429 and resp.status_code < 500:
                    raise ServerError(f"{self.url} answered HTTP {resp.status_code}: {body[:500]}")
                err = f"HTTP {resp.status_code}: {body[:200]}"
            if tries >= self.cfg.http_retries:
                raise ServerError(f"{self.url} failed after {tries + 1} tries; last error: {err}")
            delay = self.cfg.retry_backoff_s * (2 ** tries)
            logger.warning("request to %s failed (%s); retrying in %.1f s", self.url, err, delay)
            self.sleep(delay)
            tries += 1

    def _completion(self, data: dict[str, Any], req: GenRequest) -> Completion:
        choice = (data.get("choices") or [{}])[0]
        text = (choice.get("message") or {}).get("content") or ""
        usage = data.get("usage") or {}
        pt = usage.get("prompt_tokens")
        ct = usage.get("completion_tokens")
        if pt is None:
            pt = self.count_tokens("\n".join(m["content"] for m in req.messages))
        if ct is None:
            ct = self.count_tokens(text)
        return Completion(text, int(pt), int(ct), finished=choice.get("finish_reason") != "length")


def dump_stats(stats: LLMStats) -> str:
    return json.dumps(stats.to_dict(), indent=2)
