"""Answering from memory texts through ElasticMem's own prompt and decoder.

A system with its own memory (Mem0, LangMem, A-Mem) hands over the texts its retrieval returned
for each question; ``SharedPromptReader`` answers with them exactly as ``text_rag`` answers with
its retrieved chunks: ``[prompt(q)][a][text_1][sep]...[text_k][sep][suffix(u)]`` under
``memory.prompt_template`` / ``suffix_template`` / ``separator``, greedy, ``memory.max_new_tokens``,
through the same ``generate_answers``; ``a`` is the greedy retrieval-control token where
``memory.retrieval`` is 'control' (text_rag's reasoner writes one before its memories; here it
retrieves nothing). Systems compared this way differ only in their memory.

    reader = SharedPromptReader.from_backbone(backbone, cfg.memory)
    answers = reader.answer(examples, [["Alice likes tea.", ...], ...])

Test with::

    pytest tests/unit/test_reader.py
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from elasticmem.config import MemoryConfig
from elasticmem.data.schema import Example
from elasticmem.model.generation import decode_answers, decoding_config, eos_token_ids, generate_answers
from elasticmem.model.injection import Layout, assemble, left_pad
from elasticmem.model.prompt import encode_prompt


@dataclass
class ReadAnswer:
    """One greedy answer and its token accounting (as ``ElasticMemSystem`` counts #Tok)."""

    text: str
    prompt_tokens: int
    """Task text: prompt(q), the control token, suffix(u) and one separator per memory."""
    memory_tokens: int
    """Tokens of the memory texts."""
    generated_tokens: int
    """Answer tokens up to and including the first end-of-turn token."""
    memory_token_counts: list[int]
    """Tokens of each memory text, in the order given (0 for an empty text, which is left out)."""


class SharedPromptReader:
    """Greedy answers of a causal LM from given memory texts, in ElasticMem's prompt layout."""

    def __init__(self, model: nn.Module, tokenizer, cfg: MemoryConfig):
        """``model``: the causal LM (no adapter: the untrained reasoner text_rag answers with);
        ``cfg``: the memory settings whose prompt, separator and answer budget are used."""
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.sep_ids = tokenizer(cfg.separator, add_special_tokens=False)["input_ids"]
        self.eos_ids = eos_token_ids(model, tokenizer)

    @classmethod
    def from_backbone(cls, backbone, cfg: MemoryConfig) -> SharedPromptReader:
        return cls(backbone.model, backbone.tokenizer, cfg)

    def settings(self) -> dict:
        """What of ``cfg`` changes the answers (for a system's ``identity``)."""
        return {k: getattr(self.cfg, k) for k in ("prompt_template", "suffix_template", "separator",
                                                   "max_new_tokens", "retrieval")}

    def _control_tokens(self, prompts: list[list[int]]) -> list[int | None]:
        """The greedy next token after each prompt (the control token a), or None without one."""
        if self.cfg.retrieval != "control":
            return [None] * len(prompts)
        ids, mask = left_pad(prompts, self.tokenizer.pad_token_id)
        device = self.model.get_input_embeddings().weight.device
        out = self.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                         position_ids=(mask.cumsum(-1) - 1).clamp(min=0).to(device), logits_to_keep=1)
        return out.logits[:, -1].float().argmax(-1).tolist()

    @torch.no_grad()
    def answer(self, examples: Sequence[Example], memories: Sequence[Sequence[str]]) -> list[ReadAnswer]:
        """``memories[i]``: the texts example i answers from, in the order they are shown."""
        if len(memories) != len(examples):
            raise ValueError(f"{len(examples)} examples but {len(memories)} memory lists")
        if not examples:
            return []
        tok, emb = self.tokenizer, self.model.get_input_embeddings()
        device = emb.weight.device
        layouts, counts, task = [], [], []
        texts_ids = [encode_prompt(tok, self.cfg, ex) for ex in examples]
        controls = self._control_tokens([prompt for prompt, _ in texts_ids])
        for (prompt, suffix), a, texts in zip(texts_ids, controls, memories):
            ids = [tok(t, add_special_tokens=False)["input_ids"] if t else [] for t in texts]
            layouts.append(Layout(prompt, a, [emb(torch.as_tensor(i, device=device)) for i in ids if i], suffix, []))
            counts.append([len(i) for i in ids])
            task.append(len(prompt) + (a is not None) + len(suffix) + len(self.sep_ids) * sum(1 for i in ids if i))
        batch_in = assemble(emb, layouts, self.sep_ids)
        config = decoding_config(self.cfg, tok, self.eos_ids, 1.0, greedy=True)
        ids, mask, _ = generate_answers(self.model, self.model, config, batch_in, self.eos_ids, tok.pad_token_id,
                                        1.0, greedy=True)
        texts = decode_answers(tok, ids, mask, self.eos_ids)
        return [ReadAnswer(text=t, prompt_tokens=task[i], memory_tokens=sum(counts[i]),
                           generated_tokens=int(mask[i].sum()), memory_token_counts=counts[i])
                for i, t in enumerate(texts)]
