"""Rewards of one generated answer (DESIGN.md section 1, item 6): how a task scores an answer.

They belong to the data layer, next to the examples they score: data validation, evaluation,
the agent episodes and GRPO all use them, and nothing in them is GRPO's.

Every reward is a plain function ``(prediction: str, example: Example) -> float``
registered in ``REWARDS`` under the name a config uses:

* ``mc_letter`` (QA): 1.0 when the option letter parsed from the answer is the
  gold letter, else 0.0;
* ``snapped_action`` (ALFWorld): 1.0 when the answer, snapped to the nearest
  admissible command, is the expert action, else 0.0.

Test with::

    pytest tests/unit/test_rewards.py
"""

from __future__ import annotations

import difflib
import re
import string
from functools import lru_cache
from typing import Callable, Sequence

from elasticmem.data.schema import Example

Reward = Callable[[str, Example], float]

MAX_OPTIONS = 10
"""Option letters are a..j (MC-10 at most), as in the reference rule ``\\(([a-j])\\)``."""

# Characters that glue a letter into a word: "I'd", "don't", "x_1", "b2" are not bare letters.
_WORD = r"\w'\u2019"


@lru_cache(maxsize=MAX_OPTIONS)
def _letter_patterns(num_options: int) -> tuple[re.Pattern[str], re.Pattern[str]]:
    letters = f"[a-{string.ascii_lowercase[num_options - 1]}]"
    parenthesised = re.compile(rf"\(\s*({letters})\s*\)", re.IGNORECASE)
    bare = re.compile(rf"(?<![{_WORD}])({letters})(?![{_WORD}])", re.IGNORECASE)
    return parenthesised, bare


def parse_option_letter(text: str, num_options: int) -> int | None:
    """Index of the option letter in ``text`` (0 for a), or None when there is none.

    The reference rule (DESIGN.md): the first ``(x)``, else the first bare option
    letter. Choices made to apply it robustly:

    * case-insensitive: ``(C)``, ``C`` and ``c`` all parse as c;
    * whitespace anywhere, also inside the parentheses: ``"\\n ( c ) "`` -> c;
    * a parenthesised letter wins over an earlier bare one:
      ``"Answer: (c)"`` -> c, ``"(C) Paris"`` -> c, ``"a guess: (b)"`` -> b;
    * a bare letter is a standalone one, with punctuation around it allowed:
      ``"c"``, ``"The answer is b."``, ``"b)"``, ``"B:"``. A letter inside a word
      (``"bad"``) or glued by an apostrophe or digit (``"I'd"``, ``"b2"``) is not one;
    * only the first ``num_options`` letters count, in both steps: with 4 options
      ``"(e)"`` and ``"e"`` are ignored and the search goes on past them.

    Known false positives, kept because they are the reference rule: a standalone
    English word that is an option letter counts, so ``"a dog"`` parses as a (the
    article), and with 9 or more options ``"I think so"`` parses as i. Answers are
    a few tokens (max_new_tokens 5), where such words are rare next to the letter
    itself; a prompt that ends in ``"Answer:"`` makes the letter come first.
    """
    if not 1 <= num_options <= MAX_OPTIONS:
        raise ValueError(f"num_options must be in 1..{MAX_OPTIONS}, got {num_options}")
    for pattern in _letter_patterns(num_options):
        match = pattern.search(text)
        if match:
            return ord(match.group(1).lower()) - ord("a")
    return None


def mc_letter_reward(prediction: str, example: Example) -> float:
    """1.0 if the option letter parsed from ``prediction`` is ``example.answer_index``, else 0.0."""
    letter = parse_option_letter(prediction, len(example.choices))
    return 1.0 if letter == example.answer_index else 0.0


def _normalise(command: str) -> str:
    return " ".join(command.lower().split())


def snap_action(prediction: str, admissible: Sequence[str]) -> str:
    """The admissible command nearest to ``prediction`` (returned as written in ``admissible``).

    Commands are compared after lower-casing and collapsing whitespace. Only the
    first non-empty line of the prediction is used: a command is one line, and an
    answer cut at max_new_tokens often runs on into the next step. An exact match
    wins; otherwise the highest ``difflib.SequenceMatcher`` ratio (stdlib, no
    dependency, deterministic; its ratio 2*matches/(len a + len b) rewards shared
    words in order, which is what a garbled command keeps), ties broken by list
    order. An empty prediction snaps by similarity like any other.
    """
    if not admissible:
        raise ValueError("snap_action needs at least one admissible command, got none")
    lines = [line for line in prediction.splitlines() if line.strip()]
    target = _normalise(lines[0] if lines else "")
    candidates = [_normalise(c) for c in admissible]
    if target in candidates:
        return admissible[candidates.index(target)]
    # autojunk off: its heuristic only kicks in for long strings and would make ratios length-dependent
    ratios = [difflib.SequenceMatcher(None, target, c, autojunk=False).ratio() for c in candidates]
    return admissible[ratios.index(max(ratios))]  # index() finds the first maximum: list order breaks ties


def snapped_action_reward(prediction: str, example: Example) -> float:
    """1.0 if ``prediction`` snapped to ``example.extra["admissible_commands"]`` is the expert
    action ``example.answer_text`` (compared normalised), else 0.0."""
    admissible = example.extra.get("admissible_commands")
    if not isinstance(admissible, (list, tuple)) or not admissible or not all(isinstance(c, str) for c in admissible):
        raise ValueError(
            f"example {example.id!r}: the snapped_action reward needs extra['admissible_commands'], a non-empty "
            f"list of strings; got {admissible!r}"
        )
    if not isinstance(example.answer_text, str) or not example.answer_text.strip():
        raise ValueError(
            f"example {example.id!r}: the snapped_action reward needs answer_text, the expert action; "
            f"got {example.answer_text!r}"
        )
    return 1.0 if _normalise(snap_action(prediction, admissible)) == _normalise(example.answer_text) else 0.0


REWARDS: dict[str, Reward] = {
    "mc_letter": mc_letter_reward,
    "snapped_action": snapped_action_reward,
}


def get_reward(name: str) -> Reward:
    """The reward function registered as ``name``; ValueError listing the valid names otherwise."""
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; valid names: {sorted(REWARDS)}") from None
