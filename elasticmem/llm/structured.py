"""A tiny JSON schema language for structured LLM answers, and an incremental matcher for it.

Every structured answer A-Mem asks an LLM for (note attributes, the evolution decision,
query keywords) is a JSON object with a *fixed key layout* whose values are strings,
booleans, strings from a fixed set (note ids, action names) and arrays of those. One
description of that layout serves three purposes:

* ``to_json_schema()``: the JSON Schema sent to servers that support structured output;
* ``validate(value)``: the checks applied to whatever came back (types, lengths, enums);
* ``Matcher``: a character-level pushdown matcher of the *canonical* serialisation
  (``{"k": v, "k2": [a, b]}``, an optional space after ``:`` and ``,``, no escapes), used by the
  local backend to allow only tokens that keep the output a valid prefix. Anything the
  matcher accepts to completion is parseable JSON that passes ``validate``, by construction.

Strings exclude ``"``, ``\\`` and control characters (so no escapes are needed) and have
a maximum length, arrays have a maximum number of items: the output is finite, and a
generation budget of ``max_chars()`` tokens always suffices (a token is at least one character).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class Node:
    """A schema node; subclasses below."""

    def to_json_schema(self) -> dict[str, Any]:
        raise NotImplementedError

    def validate(self, value: Any, path: str = "$") -> list[str]:
        """Human-readable problems with ``value`` (empty when valid)."""
        raise NotImplementedError

    def max_chars(self) -> int:
        """Length of the longest canonical serialisation."""
        raise NotImplementedError

    def first_chars(self) -> set[str]:
        """Characters a canonical value can start with."""
        raise NotImplementedError


@dataclass(frozen=True)
class Str(Node):
    """A free string of ``min_len..max_len`` characters without quotes, backslashes or control chars.

    ``exclude``: lower-cased values the string may not take (e.g. note ids as a context or tag,
    which small models copy from the prompt), checked when the string closes; ``banned_prefixes``:
    lower-cased beginnings it may not have, checked as it is typed. Both are checked by ``validate``
    and by the matcher, and left out of the JSON Schema (strict server modes do not support ``not``).
    """

    min_len: int = 1
    max_len: int = 64
    exclude: frozenset[str] = frozenset()
    banned_prefixes: tuple[str, ...] = ()
    """Lower-cased beginnings the string may not have (worked-example sentences a small model copies)."""

    def to_json_schema(self) -> dict[str, Any]:
        return {"type": "string", "minLength": self.min_len, "maxLength": self.max_len}

    def validate(self, value: Any, path: str = "$") -> list[str]:
        if not isinstance(value, str):
            return [f"{path}: expected a string, got {type(value).__name__}"]
        if len(value.strip()) < self.min_len:
            return [f"{path}: string shorter than {self.min_len}"]
        low = value.strip().lower()
        if low in self.exclude or any(low.startswith(p) for p in self.banned_prefixes):
            return [f"{path}: {value!r} is not allowed here"]
        # Over-long strings from a server are truncated by the caller, not rejected: the
        # content is still usable and a retry would cost a whole call.
        return []

    def max_chars(self) -> int:
        return self.max_len + 2

    def first_chars(self) -> set[str]:
        return {'"'}


@dataclass(frozen=True)
class Enum(Node):
    """A string from a fixed set (note ids, action names)."""

    values: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError("Enum needs at least one value")
        for v in self.values:
            if not _plain(v):
                raise ValueError(f"Enum value {v!r} needs escaping; use plain strings")

    def to_json_schema(self) -> dict[str, Any]:
        return {"type": "string", "enum": list(self.values)}

    def validate(self, value: Any, path: str = "$") -> list[str]:
        if value not in self.values:
            return [f"{path}: {value!r} is not one of {list(self.values)}"]
        return []

    def max_chars(self) -> int:
        return max(len(v) for v in self.values) + 2

    def first_chars(self) -> set[str]:
        return {'"'}


@dataclass(frozen=True)
class Bool(Node):
    def to_json_schema(self) -> dict[str, Any]:
        return {"type": "boolean"}

    def validate(self, value: Any, path: str = "$") -> list[str]:
        return [] if isinstance(value, bool) else [f"{path}: expected true or false, got {value!r}"]

    def max_chars(self) -> int:
        return 5

    def first_chars(self) -> set[str]:
        return {"t", "f"}


@dataclass(frozen=True)
class Arr(Node):
    """An array of ``min_items..max_items`` items of one type."""

    item: Node
    min_items: int = 0
    max_items: int = 5

    def __post_init__(self) -> None:
        if not 0 <= self.min_items <= self.max_items:
            raise ValueError(f"Arr needs 0 <= min_items <= max_items, got {self.min_items}, {self.max_items}")

    def to_json_schema(self) -> dict[str, Any]:
        return {"type": "array", "items": self.item.to_json_schema(),
                "minItems": self.min_items, "maxItems": self.max_items}

    def validate(self, value: Any, path: str = "$") -> list[str]:
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {type(value).__name__}"]
        errors = []
        if not self.min_items <= len(value) <= self.max_items:
            if self.min_items == self.max_items:
                errors.append(f"{path}: expected exactly {self.min_items} items, got {len(value)}")
            elif len(value) < self.min_items:
                errors.append(f"{path}: expected at least {self.min_items} items, got {len(value)}")
            # Too many items is truncated by the caller (see Str.validate), not an error.
        for i, v in enumerate(value):
            errors.extend(self.item.validate(v, f"{path}[{i}]"))
        return errors

    def max_chars(self) -> int:
        n = self.max_items
        return 2 + n * self.item.max_chars() + max(0, n - 1) * 2

    def first_chars(self) -> set[str]:
        return {"["}


@dataclass(frozen=True)
class Obj(Node):
    """An object with a fixed key order; every key required."""

    fields: tuple[tuple[str, Node], ...]
    _segments: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        segs: list[Any] = []
        for i, (key, node) in enumerate(self.fields):
            if not _plain(key):
                raise ValueError(f"key {key!r} needs escaping")
            segs.append(("{" if i == 0 else ", ") + json.dumps(key) + ": ")
            segs.append(node)
        segs.append("}")
        object.__setattr__(self, "_segments", tuple(segs))

    @property
    def keys(self) -> list[str]:
        return [k for k, _ in self.fields]

    def to_json_schema(self) -> dict[str, Any]:
        return {"type": "object", "properties": {k: n.to_json_schema() for k, n in self.fields},
                "required": self.keys, "additionalProperties": False}

    def validate(self, value: Any, path: str = "$") -> list[str]:
        if not isinstance(value, dict):
            return [f"{path}: expected an object, got {type(value).__name__}"]
        errors = []
        for key, node in self.fields:
            if key not in value:
                errors.append(f"{path}: missing key {key!r}")
            else:
                errors.extend(node.validate(value[key], f"{path}.{key}"))
        return errors

    def max_chars(self) -> int:
        return sum(len(s) if isinstance(s, str) else s.max_chars() for s in self._segments)

    def first_chars(self) -> set[str]:
        return {"{"}

    def example(self) -> str:
        """A skeleton for prompts: ``{"keywords": [...], "context": "...", ...}``."""
        def show(n: Node) -> str:
            if isinstance(n, Str):
                return '"..."'
            if isinstance(n, Enum):
                return " | ".join(json.dumps(v) for v in n.values[:4]) + (" | ..." if len(n.values) > 4 else "")
            if isinstance(n, Bool):
                return "true | false"
            if isinstance(n, Arr):
                return "[" + show(n.item) + ", ...]"
            if isinstance(n, Obj):
                return n.example()
            return "?"
        return "{" + ", ".join(f"{json.dumps(k)}: {show(n)}" for k, n in self.fields) + "}"


def _plain(s: str) -> bool:
    return all(_string_char_ok(c) for c in s)


def _string_char_ok(ch: str) -> bool:
    return ch not in '"\\' and ord(ch) >= 32


# --------------------------------------------------------------------------- normalising


def normalise(value: Any, node: Node) -> Any:
    """Clip over-long strings and arrays, strip strings, drop duplicate list items.

    Applied after ``validate`` passed, so a server's slightly-too-long answer is kept.
    """
    if isinstance(node, Str):
        return value.strip()[: node.max_len]
    if isinstance(node, Arr):
        out, seen = [], set()
        for v in value:
            v = normalise(v, node.item)
            key = json.dumps(v, sort_keys=True).lower()
            if key not in seen:
                seen.add(key)
                out.append(v)
        # Dropping duplicates must not break an exact length (one entry per neighbour).
        if node.min_items == node.max_items and len(out) != len(value):
            out = [normalise(v, node.item) for v in value]
        return out[: node.max_items]
    if isinstance(node, Obj):
        return {k: normalise(value[k], n) for k, n in node.fields}
    return value


def parse_json_object(text: str) -> Any:
    """The first complete JSON object in ``text`` (code fences and chatter around it ignored).

    Raises ``ValueError`` when there is none.
    """
    start = text.find("{")
    while start != -1:
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[start:])
            return obj
        except json.JSONDecodeError:
            start = text.find("{", start + 1)
    raise ValueError("no JSON object in the output")


# --------------------------------------------------------------------------- incremental matcher

_OBJ, _ARR, _STR, _LIT = 0, 1, 2, 3


class Matcher:
    """Accepts the canonical serialisation of ``root`` one character at a time.

    State is a stack of small lists (frames); ``copy()`` is cheap, so a caller can try a
    token's characters on a copy and keep it only when all are accepted.

    Frames: ``[_OBJ, node, segment, pos]`` (pos = offset inside a literal segment);
    ``[_ARR, node, phase, count, pos]`` (phase 0 expects '[', 1 after '[', 2 after an item,
    3 inside the ", " separator); ``[_STR, node, phase, length, text]`` (text kept only when
    the node excludes values); ``[_LIT, options, typed]``.
    """

    __slots__ = ("done", "stack")

    def __init__(self, root: Node | None = None):
        self.stack: list[list[Any]] = [] if root is None else [_frame(root)]
        self.done = False

    def copy(self) -> Matcher:
        m = Matcher()
        m.stack = [f[:] for f in self.stack]
        m.done = self.done
        return m

    def feed(self, text: str) -> bool:
        """Consume ``text``; False (state then undefined) when it leaves the language."""
        for ch in text:
            if not self._feed_char(ch):
                return False
        return True

    def _pop_complete(self) -> None:
        self.stack.pop()
        if not self.stack:
            self.done = True
            return
        parent = self.stack[-1]
        if parent[0] == _OBJ:
            parent[2] += 1
            parent[3] = 0
        else:  # _ARR
            parent[2] = 2
            parent[3] += 1

    def _feed_char(self, ch: str) -> bool:
        if self.done or not self.stack:
            return False
        f = self.stack[-1]
        kind = f[0]
        if kind == _OBJ:
            seg = f[1]._segments[f[2]]
            if isinstance(seg, str):
                expected = seg[f[3]]
                if expected != ch:
                    if expected != " ":
                        return False
                    # The space after ':' and ',' is optional (some tokenizers cannot emit spaces).
                    self._advance_literal(f, seg)
                    return self._feed_char(ch)
                self._advance_literal(f, seg)
                return True
            if ch not in seg.first_chars():
                return False
            self.stack.append(_frame(seg))
            return self._feed_char(ch)
        if kind == _ARR:
            node, phase = f[1], f[2]
            if phase == 0:
                if ch != "[":
                    return False
                f[2] = 1
                return True
            if phase == 1 or (phase == 3 and f[4] == 2):
                if phase == 1 and ch == "]":
                    if node.min_items > 0:
                        return False
                    self._pop_complete_arr()
                    return True
                if ch not in node.item.first_chars():
                    return False
                self.stack.append(_frame(node.item))
                return self._feed_char(ch)
            if phase == 2:
                if ch == "]" and f[3] >= node.min_items:
                    self._pop_complete_arr()
                    return True
                if ch == "," and f[3] < node.max_items:
                    f[2], f[4] = 3, 1
                    return True
                return False
            # phase 3, after ',': an optional space, then the next item
            f[4] = 2
            return True if ch == " " else self._feed_char(ch)
        if kind == _STR:
            node = f[1]
            if f[2] == 0:
                if ch != '"':
                    return False
                f[2] = 1
                return True
            if ch == '"':
                if f[3] < node.min_len or (node.exclude and f[4].strip().lower() in node.exclude):
                    return False
                self._pop_complete()
                return True
            if f[3] >= node.max_len or not _string_char_ok(ch):
                return False
            # Leading spaces would let a string pass min_len while being blank.
            if f[3] == 0 and ch.isspace():
                return False
            f[3] += 1
            if node.exclude or node.banned_prefixes:
                f[4] += ch
                if node.banned_prefixes:
                    low = f[4].lower()
                    if any(len(low) == len(p) and low == p for p in node.banned_prefixes):
                        return False
            return True
        # _LIT
        typed = f[2] + ch
        options = [o for o in f[1] if o.startswith(typed)]
        if not options:
            return False
        f[2] = typed
        if typed in options:  # options are prefix-free (quoted strings, true/false)
            self._pop_complete()
        return True

    def _pop_complete_arr(self) -> None:
        self._pop_complete()

    def _advance_literal(self, f: list[Any], seg: str) -> None:
        f[3] += 1
        if f[3] == len(seg):
            f[2] += 1
            f[3] = 0
            if f[2] == len(f[1]._segments):
                self._pop_complete()

    def forced(self, space: bool = True) -> str:
        """The text that must come next whatever the model prefers (keys, brackets, the rest of
        ``true`` or of the only enum value left), up to the next real choice. With ``space`` the
        optional space after ':' and ',' is included (the canonical form); without, forcing stops there.
        """
        m = self.copy()
        out = []
        while True:
            first = m.allowed_first()
            if not first:
                break
            if len(first) == 1:
                ch = next(iter(first))
            elif space and " " in first:  # only the optional-space states offer ' ' among others
                ch = " "
            else:
                break
            m.feed(ch)
            out.append(ch)
        return "".join(out)

    def allowed_first(self) -> set[str] | None:
        """Characters that can come next, or None when almost any can (inside a free string)."""
        if self.done or not self.stack:
            return set()
        f = self.stack[-1]
        kind = f[0]
        if kind == _OBJ:
            seg = f[1]._segments[f[2]]
            if not isinstance(seg, str):
                return seg.first_chars()
            if seg[f[3]] != " ":
                return {seg[f[3]]}
            # optional space: the space, or whatever may follow it
            nxt = seg[f[3] + 1] if f[3] + 1 < len(seg) else f[1]._segments[f[2] + 1]
            return {" "} | ({nxt} if isinstance(nxt, str) else nxt.first_chars())
        if kind == _ARR:
            node, phase = f[1], f[2]
            if phase == 0:
                return {"["}
            if phase == 1:
                out = set(node.item.first_chars())
                if node.min_items == 0:
                    out.add("]")
                return out
            if phase == 2:
                out = set()
                if f[3] >= node.min_items:
                    out.add("]")
                if f[3] < node.max_items:
                    out.add(",")
                return out
            return ({" "} | node.item.first_chars()) if f[4] == 1 else node.item.first_chars()
        if kind == _STR:
            if f[2] == 0:
                return {'"'}
            if f[3] >= f[1].max_len:
                return {'"'}
            return None
        return {o[len(f[2])] for o in f[1] if o.startswith(f[2]) and len(o) > len(f[2])}


def _frame(node: Node) -> list[Any]:
    if isinstance(node, Obj):
        return [_OBJ, node, 0, 0]
    if isinstance(node, Arr):
        return [_ARR, node, 0, 0, 0]
    if isinstance(node, Str):
        return [_STR, node, 0, 0, ""]
    if isinstance(node, Enum):
        return [_LIT, tuple(json.dumps(v) for v in node.values), ""]
    if isinstance(node, Bool):
        return [_LIT, ("true", "false"), ""]
    raise TypeError(f"unknown schema node {node!r}")


def accepts(root: Node, text: str) -> bool:
    """Whether ``text`` is a complete canonical serialisation of ``root``."""
    m = Matcher(root)
    return m.feed(text) and m.done


def canonical(value: Any) -> str:
    """The canonical serialisation the matcher accepts (for few-shot examples and tests)."""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def check(root: Node, value: Any) -> list[str]:
    """``root.validate`` for any value; a shorthand used by the LLM wrapper."""
    return root.validate(value)


__all__: Sequence[str] = (
    "Arr",
    "Bool",
    "Enum",
    "Matcher",
    "Node",
    "Obj",
    "Str",
    "accepts",
    "canonical",
    "check",
    "normalise",
    "parse_json_object",
)


def from_json_schema(schema: dict[str, Any], max_len: int = 200, max_items: int = 8) -> Node:
    """The node of a JSON Schema written in this module's subset: objects (every property
    required, in their order), strings (``maxLength``, default ``max_len``), string enums,
    booleans and arrays (``maxItems``, default ``max_items``). Raises ``ValueError`` naming what
    falls outside (numbers, ``anyOf``, free-form objects...), so a server can refuse the request
    instead of constraining to something else."""
    if not isinstance(schema, dict):
        raise ValueError(f"a schema must be an object, got {schema!r}")
    if "enum" in schema:
        values = schema["enum"]
        if not values or not all(isinstance(v, str) for v in values):
            raise ValueError(f"only enums of strings are supported, got {values!r}")
        return Enum(tuple(values))
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties")
        if not props:
            raise ValueError("an object schema needs 'properties' (free-form objects are not supported)")
        return Obj(tuple((k, from_json_schema(v, max_len, max_items)) for k, v in props.items()))
    if kind == "array":
        if "items" not in schema:
            raise ValueError("an array schema needs 'items'")
        return Arr(from_json_schema(schema["items"], max_len, max_items), int(schema.get("minItems", 0)),
                   int(schema.get("maxItems", max_items)))
    if kind == "string":
        return Str(max(1, int(schema.get("minLength", 1))), int(schema.get("maxLength", max_len)))
    if kind == "boolean":
        return Bool()
    raise ValueError(f"type {kind!r} is not supported (objects, arrays, strings, string enums, booleans)")
