"""Constrained decoding for the local LLM backend (``elasticmem.llm.client.TransformersBackend``).

Each row of a batch carries its token budget, stop strings, an n-gram ban and, for a JSON request, a
``structured.Matcher`` of the schema's canonical form. ``TokenChooser`` picks each row's next tokens:
text the schema forces in one go, else the best (or a sampled) token among those that keep the answer
a valid prefix, so a finished JSON answer parses and validates by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from elasticmem.llm.structured import Matcher

class VocabInfo:
    """Per-tokenizer tables for constrained decoding: each token's text and tokens by first character."""

    def __init__(self, tokenizer):
        n = len(tokenizer)
        self.texts: list[str] = [tokenizer.decode([i]) for i in range(n)]
        special = set(tokenizer.all_special_ids)
        # A token whose text is empty, special, or a piece of a multi-byte character cannot be
        # checked character by character: it is never allowed inside a constrained answer.
        self.usable = [bool(t) and "\ufffd" not in t and i not in special for i, t in enumerate(self.texts)]
        by_first: dict[str, list[int]] = {}
        for i, t in enumerate(self.texts):
            if self.usable[i]:
                by_first.setdefault(t[0], []).append(i)
        self.by_first = {c: torch.tensor(ids, dtype=torch.long) for c, ids in by_first.items()}
        self.has_space = " " in by_first  # some tokenizers (the tiny test one) cannot emit a space


_VOCAB_CACHE: dict[int, VocabInfo] = {}


def vocab_info(tokenizer) -> VocabInfo:
    key = id(tokenizer)
    if key not in _VOCAB_CACHE:
        _VOCAB_CACHE[key] = VocabInfo(tokenizer)
    return _VOCAB_CACHE[key]


@dataclass
class DecodeRow:
    budget: int
    matcher: Matcher | None
    stops: tuple[str, ...]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    """Ended on its own (EOS, a stop string, a complete JSON answer)."""
    closed: bool = False
    """No more tokens: finished, or the budget ran out (then only EOS is allowed)."""
    ngrams: NgramBan | None = None
    """The n-grams this row may not repeat (``GenRequest.no_repeat_ngram``), or None."""


class NgramBan:
    """The tokens that would complete an n-gram already seen (prompt and answer so far)."""

    def __init__(self, n: int, tokens: Sequence[int]):
        self.n = n
        self.seen: dict[tuple[int, ...], set[int]] = {}
        self.tokens: list[int] = []
        for t in tokens:
            self.add(t)

    def add(self, token: int) -> None:
        self.tokens.append(token)
        if len(self.tokens) >= self.n:
            gram = self.tokens[-self.n:]
            self.seen.setdefault(tuple(gram[:-1]), set()).add(gram[-1])

    def banned(self) -> set[int]:
        """Tokens that may not come next: those that followed the last n - 1 tokens before."""
        return self.seen.get(tuple(self.tokens[len(self.tokens) - self.n + 1:]), set())


class TokenChooser:
    """Picks each row's next tokens: forced JSON text in one go, else the best (or a sampled) token
    among those the row's JSON constraint allows; free rows pick from the whole vocabulary."""

    SAMPLE_CANDIDATES = 20
    """With sampling, how many of the best valid tokens a constrained row samples from."""

    def __init__(self, tokenizer, vocab: VocabInfo, eos_id: int, temperature: float, generator: torch.Generator):
        self.tokenizer = tokenizer
        self.vocab = vocab
        self.eos_id = eos_id
        self.temperature = temperature
        self.generator = generator
        self._forced_cache: dict[str, list[int] | None] = {}

    def _forced_tokens(self, text: str) -> list[int] | None:
        """Tokens spelling exactly ``text`` (each one checkable), or None."""
        if text not in self._forced_cache:
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            ok = all(self.vocab.usable[i] for i in ids) and "".join(self.vocab.texts[i] for i in ids) == text
            self._forced_cache[text] = list(ids) if ok and ids else None
        return self._forced_cache[text]

    def _pick(self, logits: torch.Tensor, candidates: list[int]) -> int:
        if self.temperature <= 0 or len(candidates) == 1:
            return candidates[0]
        cand = torch.tensor(candidates)
        probs = torch.softmax(logits[cand].float() / self.temperature, dim=-1)
        return candidates[int(torch.multinomial(probs, 1, generator=self.generator))]

    def _allowed(self, m: Matcher, logits: torch.Tensor, banned: set[int] = frozenset()) -> list[int]:
        """Valid next tokens of a constrained row, best first (1 when greedy)."""
        want = self.SAMPLE_CANDIDATES if self.temperature > 0 else 1
        first = m.allowed_first()
        found: list[int] = []

        def scan(order: torch.Tensor) -> None:
            for tok in order.tolist():
                if not self.vocab.usable[tok] or tok in banned:
                    continue
                trial = m.copy()
                if trial.feed(self.vocab.texts[tok]):
                    found.append(tok)
                    if len(found) >= want:
                        return

        if first is not None:
            cands = [self.vocab.by_first[c] for c in first if c in self.vocab.by_first]
            if cands:
                cand = torch.cat(cands)
                scan(cand[torch.argsort(logits[cand], descending=True)])
        else:
            k = min(64, logits.numel())
            scan(torch.topk(logits, k).indices)
            if not found:  # the model wants something the schema forbids: look further down
                scan(torch.argsort(logits, descending=True)[k:])
        return found

    def next_tokens(self, row: DecodeRow, logits: torch.Tensor) -> list[int]:
        """Tokens to append to ``row`` (EOS closes it); updates the row."""
        m = row.matcher
        banned = row.ngrams.banned() if row.ngrams is not None else set()
        if m is None:
            if banned:
                logits = logits.clone()
                logits[list(banned)] = float("-inf")
            tok = self._pick(logits, torch.topk(logits, min(self.SAMPLE_CANDIDATES, logits.numel())).indices.tolist()
                             if self.temperature > 0 else [int(torch.argmax(logits))])
            self._take(row, [tok])
            return [tok]
        # A trailing space stays with the model: BPE vocabularies spell ' "' or ' [' as one token.
        forced = m.forced(space=self.vocab.has_space).rstrip(" ")
        toks = self._forced_tokens(forced) if forced else None
        if toks is None:
            allowed = self._allowed(m, logits, banned)
            if not allowed and banned:  # the schema needs a banned token (structure): it wins
                allowed = self._allowed(m, logits)
            if not allowed:  # no token of the vocabulary continues the answer: stop it here
                row.closed = True
                return [self.eos_id]
            toks = [self._pick(logits, allowed)]
        toks = toks[: max(1, row.budget - len(row.tokens))]
        self._take(row, toks)
        return toks

    def _take(self, row: DecodeRow, toks: list[int]) -> None:
        for tok in toks:
            if tok == self.eos_id:
                row.finished = row.matcher is None
                row.closed = True
                return
            text = self.vocab.texts[tok]
            row.tokens.append(tok)
            if row.ngrams is not None:
                row.ngrams.add(tok)
            row.text += text
            if row.matcher is not None:
                if not row.matcher.feed(text):  # cannot happen: only matching tokens are chosen
                    raise RuntimeError(f"constrained decoding chose a token outside the schema: {text!r}")
                if row.matcher.done:
                    row.finished = row.closed = True
            elif row.stops and any(st in row.text for st in row.stops):
                row.finished = row.closed = True
        if len(row.tokens) >= row.budget:
            row.closed = True
