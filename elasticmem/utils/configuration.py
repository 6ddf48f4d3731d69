"""Typed dataclass configs from YAML presets plus dotted ``key=value`` overrides.

Why not OmegaConf/Hydra: their structured configs support neither ``Literal``
nor ``X | Y`` unions and give no "did you mean" for unknown keys; the whole
mechanism here is ~200 lines over ``dataclasses`` + ``yaml``.

Conventions: every config field carries an attribute docstring (a string
literal right below it). ``field_docs`` reads them from the source so that
``--help`` documents every key; a test checks that none is missing.

The command line built on it (``parse_cli``, a command's own options) is
``elasticmem.utils.options``.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import re
import sys
import textwrap
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key."""


def _dotted_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        keys.append(name)
        ft = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(ft):
            keys.extend(_dotted_keys(ft, name + "."))
    return keys


def _unknown(key: str, root: type) -> ConfigError:
    valid = _dotted_keys(root)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if not close:  # a misspelt leaf under the right section: compare last components
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in valid}
        m = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        close = [by_leaf[m[0]]] if m else []
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint} (see --help for all keys)")


def type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; allow int -> float only."""
    origin = get_origin(tp)
    if origin is Literal:
        choices = get_args(tp)
        if isinstance(value, bool) and all(isinstance(c, str) for c in choices):
            # YAML 1.1 reads no/off/false as False (yes/on/true as True): among string choices
            # the word itself was meant (train.mixed_precision=no)
            words = [w for w in (("yes", "on", "true") if value else ("no", "off", "false")) if w in choices]
            value = words[0] if len(words) == 1 else value
        if value not in choices:
            raise ConfigError(f"config key '{key}' must be one of {list(get_args(tp))}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"config key '{key}' may not be null")
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"config key '{key}' must be {type_name(tp)}, got {value!r}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        (item,) = get_args(tp) or (Any,)
        return [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' is a section; give it a mapping, got {value!r}")
        return build_dataclass(tp, value, key + ".")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{key}' must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {tp!r} for '{key}'")


_ROOT: list[type] = []


def build_dataclass(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise _unknown(prefix + k, _ROOT[-1] if _ROOT else cls)
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"invalid config section '{prefix.rstrip('.') or cls.__name__}': {e}") from e


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Build ``cls`` from a nested dict; missing keys keep their defaults."""
    _ROOT.append(cls)
    try:
        return build_dataclass(cls, data)
    finally:
        _ROOT.pop()


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def parse_value(text: str) -> Any:
    # YAML typing makes `n=3`, `lr=2e-5`, `flag=true`, `xs=[1,2]`, `x=null` do the right thing.
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def _merge(base: dict[str, Any], update: dict[str, Any], cls: type, prefix: str = "") -> None:
    hints = typing.get_type_hints(cls)
    for k, v in update.items():
        if k not in hints:
            raise _unknown(prefix + k, _ROOT[-1])
        if dataclasses.is_dataclass(hints[k]) and isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v, hints[k], prefix + k + ".")
        else:
            base[k] = v


def _renamed_key(key: str, renamed: dict[str, str], where: str) -> str:
    """``key`` under its section's new name, with a warning when it used the old one."""
    head, dot, rest = key.partition(".")
    if head not in renamed:
        return key
    new = renamed[head] + dot + rest
    warnings.warn(f"{where}: config key '{key}' is now '{new}'; the old name is read for one more release",
                  FutureWarning, stacklevel=4)
    return new


def _renamed_sections(loaded: dict[str, Any], renamed: dict[str, str], where: str) -> dict[str, Any]:
    """A preset's top-level sections under their new names (a warning for each old one)."""
    out = dict(loaded)
    for old, new in renamed.items():
        if old in out:
            if new in out:
                raise ConfigError(f"{where}: sections '{old}' and '{new}' are the same section ('{old}' is its "
                                  f"old name): keep '{new}' only")
            _renamed_key(old, renamed, where)
            out[new] = out.pop(old)
    return out


def load(cls: type[T], path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
         base: T | None = None) -> T:
    """Defaults (or ``base``) <- YAML preset at ``path`` <- ``key=value`` overrides, validated."""
    _ROOT.append(cls)
    renamed: dict[str, str] = getattr(cls, "__renamed__", {})  # old top-level section -> new name
    try:
        data = to_dict(base if base is not None else cls())
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"config file not found: {p}")
            try:
                loaded = yaml.safe_load(p.read_text()) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{p}: not valid YAML: {e}") from None
            if not isinstance(loaded, dict):
                raise ConfigError(f"{p}: a config file must be a mapping of keys to values")
            _merge(data, _renamed_sections(loaded, renamed, str(p)), cls)
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override '{item}' is not of the form key=value")
            key, text = item.split("=", 1)
            key = _renamed_key(key.strip().removeprefix("--"), renamed, "override")
            parts = key.split(".")
            node, node_cls = data, cls
            for i, part in enumerate(parts):
                hints = typing.get_type_hints(node_cls)
                if part not in hints:
                    raise _unknown(key, cls)
                if i == len(parts) - 1:
                    node[part] = parse_value(text)
                else:
                    if not dataclasses.is_dataclass(hints[part]):
                        raise ConfigError(f"config key '{'.'.join(parts[: i + 1])}' is not a section")
                    node, node_cls = node[part], hints[part]
        return build_dataclass(cls, data)
    finally:
        _ROOT.pop()


def to_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None, width=100)


def save(cfg: Any, path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(to_yaml(cfg))
    tmp.replace(p)


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass, read from its source (a subclass's fields and its
    dataclass bases' fields alike)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for a, b in zip(body, body[1:]):
        if (
            isinstance(a, ast.AnnAssign)
            and isinstance(a.target, ast.Name)
            and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)
            and isinstance(b.value.value, str)
        ):
            docs[a.target.id] = inspect.cleandoc(b.value.value)
    return docs


def describe(cls: type, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, doc) for every leaf key, in declaration order."""
    out = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    default = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(describe(tp, prefix + f.name + "."))
        else:
            out.append((prefix + f.name, type_name(tp), getattr(default, f.name), docs.get(f.name, "")))
    return out


def format_help(cls: type) -> str:
    lines = []
    for key, tp, default, doc in describe(cls):
        lines.append(f"  {key} ({tp}, default {default!r})")
        if doc:
            lines.extend("      " + line for line in textwrap.wrap(doc, 90))
    return "\n".join(lines)


def print_config(cfg: Any, file=sys.stdout) -> None:
    print("resolved config:", file=file)
    print(textwrap.indent(to_yaml(cfg), "  "), file=file, end="")
