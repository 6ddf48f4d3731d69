"""prompt(q) and suffix(u) of one example: the text every system that answers through
ElasticMem's prompt reads around its memories (DESIGN.md section 1 item 5).

    python -m pytest -q tests/unit/test_elasticmem.py -k suffix
"""

from __future__ import annotations

from typing import Sequence

from elasticmem.config import MemoryConfig
from elasticmem.data.schema import Example


def format_options(choices: Sequence[str]) -> str:
    return "\n".join(f"({chr(ord('a') + i)}) {c}" for i, c in enumerate(choices))


def format_suffix(template: str, ex: Example) -> str:
    """suffix(u) of one example: ``template`` with {options} (one "(a) text" line per choice),
    {question}, and any string field of ``ex.extra`` (e.g. an agent step's recent actions and
    admissible commands) filled in."""
    fields = {k: v for k, v in ex.extra.items() if isinstance(v, str)}
    fields.update(options=format_options(ex.choices), question=ex.question)
    try:
        return template.format(**fields)
    except KeyError as e:
        raise ValueError(
            f"memory.suffix_template names {{{e.args[0]}}}, which example {ex.id!r} does not have; "
            f"it has {sorted(fields)}"
        ) from None


def encode_prompt(tokenizer, cfg: MemoryConfig, ex: Example) -> tuple[list[int], list[int]]:
    """Token ids of prompt(q) and suffix(u) of one example under ``cfg``'s templates: what every
    system that answers through ElasticMem's prompt reads around its memories."""
    suffix = format_suffix(cfg.suffix_template, ex)
    if cfg.prompt_template == "raw":
        return tokenizer(ex.question)["input_ids"], tokenizer(suffix, add_special_tokens=False)["input_ids"]
    # Chat: render the template around a placeholder and cut there, so the user turn holds
    # the question, then (after a and the memories) the options, then the assistant prompt.
    marker = "\u0000"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    before, after = text.split(marker)
    return (tokenizer(before + ex.question, add_special_tokens=False)["input_ids"],
            tokenizer(suffix + after, add_special_tokens=False)["input_ids"])
