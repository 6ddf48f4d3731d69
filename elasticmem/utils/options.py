"""The command line of every entry point: ``--config PATH [key=value ...]`` plus a command's own options.

A command's own options, the ones that are not config keys (``--append``, ``--out``,
``--port``), are described like config sections: a small dataclass under a section name
(``Options``). Each field is then both a dotted ``SECTION.field=value`` argument, typed and
checked like a config key, and a ``--flag`` (``add_options``, ``resolve_options``; ``parse_cli``
and ``parse_options`` put them together), and ``--help`` lists it with its docstring.

Why not plain argparse alone: it cannot read ``key=value`` items typed by a dataclass, nor say that
an option was given twice under its two spellings; it does the flags and ``--help`` here.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Generic, Literal, Mapping, NamedTuple, TypeVar, get_args, get_origin

from elasticmem.utils import configuration
from elasticmem.utils.configuration import ConfigError, build_dataclass, field_docs, format_help, parse_value, type_name

T = TypeVar("T")
O = TypeVar("O")

def command_name(default: str) -> str:
    """The name this process was started as when that is a console script (``elasticmem-train``),
    else ``default`` (``train.py``, ``python -m elasticmem.serve``): usage and error lines then name
    the command the user typed. Called in-process (tests, ``main(argv)``) it is ``default``."""
    name = Path(sys.argv[0]).name.removesuffix(".exe") if sys.argv and sys.argv[0] else ""  # .exe: Windows
    return name if name.startswith("elasticmem-") else default


# --------------------------------------------------------------------------- a command's own options


@dataclasses.dataclass(frozen=True)
class Flag:
    """How an option reads as a ``--flag``, where its field's name and type do not say it."""

    name: str | None = None
    """The flag; default ``--`` and the field's name in kebab case (``weight_decay``: ``--weight-decay``)."""
    sep: str | None = None
    """A list read from one argument split at ``sep`` (``--caps 8,16,32``); its dotted form takes the
    same text or a YAML list (``ladder.caps=8,16,32``, ``ladder.caps=[8,16,32]``)."""
    repeat: bool = False
    """A list read one item per flag, the flag repeated (``--split train --split val``). Other lists
    take one or more values after one flag (``--input A B``)."""
    positional: bool = False
    """A list read from the command's positional arguments that are not ``key=value`` (``pool DIR ...``)."""
    metavar: str | None = None
    """The value's name in ``--help`` (default: INT / FLOAT for numbers, else the field's name)."""


@dataclasses.dataclass(frozen=True)
class Options(Generic[O]):
    """A command's own options: the fields of the dataclass ``cls`` (attribute docstrings; a nested
    dataclass is a subsection), each both ``SECTION.FIELD=VALUE`` and a ``--flag``. A field with no
    default is required; the flag is an alias, and giving an option both ways is an error."""

    section: str
    """The dotted keys' first component (``serve``: ``serve.port``); not a config section's name."""
    cls: type[O]
    flags: Mapping[str, Flag | str | None] = dataclasses.field(default_factory=dict)
    """Field path (``limits.max_new_tokens``) -> its ``Flag`` or just the flag's name, where the
    defaults do not fit (a reused dataclass's flags kept as they were); None: not an option at all
    (the field keeps its default and the command sets it, e.g. from the config)."""


class _Option(NamedTuple):
    path: str  # under the section (``limits.max_queue``): the argparse dest
    key: str  # the dotted key (``serve.limits.max_queue``)
    tp: Any
    default: Any  # dataclasses.MISSING: required
    doc: str
    flag: Flag  # its name filled in
    group: str  # the (sub)section --help lists it under


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _option_list(spec: Options) -> list[_Option]:
    """Every option of ``spec``, subsections flattened, in declaration order."""

    def walk(cls: type, prefix: str) -> list[_Option]:
        hints, docs, out = typing.get_type_hints(cls), field_docs(cls), []
        for f in dataclasses.fields(cls):
            path = prefix + f.name
            how = spec.flags.get(path, Flag())
            if how is None:
                continue
            if dataclasses.is_dataclass(hints[f.name]):
                out += walk(hints[f.name], path + ".")
                continue
            flag = Flag(name=how) if isinstance(how, str) else how
            flag = dataclasses.replace(flag, name=flag.name or "--" + f.name.replace("_", "-"))
            out.append(_Option(path, f"{spec.section}.{path}", hints[f.name], _field_default(f),
                               docs.get(f.name, ""), flag, f"{spec.section}.{prefix}".rstrip(".")))
        return out

    return walk(spec.cls, "")


def option_keys(spec: Options) -> dict[str, str | None]:
    """Dotted key -> its flag (None for the positional one) of every option of ``spec``."""
    return {o.key: None if o.flag.positional else o.flag.name for o in _option_list(spec)}


def _nullable(tp: Any) -> tuple[Any, bool]:
    """(X, True) for ``X | None``, else (tp, False)."""
    if get_origin(tp) in (typing.Union, types.UnionType) and type(None) in get_args(tp):
        rest = [a for a in get_args(tp) if a is not type(None)]
        return (rest[0] if len(rest) == 1 else tp), True
    return tp, False


def _flag_type(tp: Any) -> Callable[[str], Any]:
    """argparse's ``type`` for a value of annotation ``tp``: the word none is None for ``int | None``
    and ``float | None`` (``--tenant-max-rows none``), never for strings (a path may be called none)."""
    base, nullable = _nullable(tp)
    if not nullable or base is str:
        return base

    def read(text: str) -> Any:
        return None if text.lower() in ("none", "null") else base(text)

    read.__name__ = base.__name__  # argparse says "invalid int value"
    return read


def _flag_kwargs(o: _Option) -> dict[str, Any]:
    """add_argument's keywords for the flag of ``o`` (action, type, nargs, choices, metavar)."""
    base, _ = _nullable(o.tp)
    if base is bool:  # a default-true switch gets its --no- form (--residual / --no-residual)
        return {"action": argparse.BooleanOptionalAction if o.default is True else "store_true"}
    metavar = o.flag.metavar or o.path.rsplit(".", 1)[-1].upper()
    if get_origin(base) is Literal:
        return {"choices": get_args(base), "metavar": o.flag.metavar}
    if base in (int, float):
        metavar = o.flag.metavar or base.__name__.upper()
    if get_origin(base) is not list:
        return {"type": _flag_type(o.tp), "metavar": metavar}
    item = _flag_type((get_args(base) or (str,))[0])
    if o.flag.sep:
        sep = o.flag.sep

        def split(text: str) -> list[Any]:
            return [item(x.strip()) for x in text.split(sep) if x.strip()]

        split.__name__ = f"{sep!r}-separated list"
        return {"type": split, "metavar": f"{metavar}[{sep}...]"}
    if o.flag.repeat:
        return {"action": "append", "type": item, "metavar": metavar}
    return {"nargs": "+", "type": item, "metavar": metavar}


def _flag_help(o: _Option) -> str:
    state = "required" if o.default is dataclasses.MISSING else f"default {o.default!r}"
    return f"{o.key} ({type_name(o.tp)}, {state}): {' '.join(o.doc.split())}".replace("%", "%%")


def _add_flag(group: Any, o: _Option) -> None:
    # not set unless given: resolve_options tells a flag given from one left out
    group.add_argument(o.flag.name, dest=o.path, default=argparse.SUPPRESS, help=_flag_help(o), **_flag_kwargs(o))


def _greedy(o: _Option) -> bool:
    """Whether the flag of ``o`` takes every value after it (a list flag without sep / repeat)."""
    return get_origin(_nullable(o.tp)[0]) is list and not (o.flag.sep or o.flag.repeat or o.flag.positional)


def _form(o: _Option) -> str:
    """How ``o`` is given other than by its dotted key, for messages: ``--out VALUE``, ``DIR ...``."""
    if o.flag.positional:
        return f"{o.flag.metavar or o.path.upper()} ..."
    return o.flag.name if _nullable(o.tp)[0] is bool else f"{o.flag.name} VALUE"


def _is_key_of(item: str, section: str) -> bool:
    key, eq, _ = item.partition("=")
    return bool(eq) and key.strip().split(".", 1)[0] == section


class _Positionals(argparse.Action):
    """The positional arguments: config overrides stay in ``overrides`` (``load`` reads them), the
    command's ``SECTION.key=value`` options go to ``option_overrides`` (``resolve_options`` reads
    them) and its other words to its positional option, when it has one."""

    def __init__(self, *args: Any, spec: Options | None = None, config: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spec, self.config = spec, config

    def __call__(self, parser: argparse.ArgumentParser, ns: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        section = self.spec.section if self.spec else None
        words = next((o for o in _option_list(self.spec) if o.flag.positional), None) if self.spec else None
        config, own, plain = [], [], []
        for v in values:
            if section and _is_key_of(v, section):
                own.append(v)
            elif words is not None and "=" not in v:
                plain.append(v)
            else:  # a word where no positional option takes it: load (or resolve_options) says what is wrong
                (config if self.config else own).append(v)
        ns.overrides, ns.option_overrides = config, own
        if plain and words is not None:
            setattr(ns, words.path, plain)


def add_options(parser: argparse.ArgumentParser, spec: Options) -> None:
    """Add a flag for each option of ``spec``; ``--help`` lists it under its dotted key, with its docstring."""
    groups: dict[str, Any] = {}
    for o in _option_list(spec):
        if o.flag.positional:
            continue
        if o.group not in groups:
            groups[o.group] = parser.add_argument_group(f"options {o.group}.KEY=VALUE (or their --flag VALUE)")
        _add_flag(groups[o.group], o)


def add_positionals(parser: argparse.ArgumentParser, spec: Options | None = None, config: bool = True,
                    metavar: str = "key=value", help: str | None = "dotted config overrides") -> None:
    """Add the positional arguments: ``key=value`` config overrides (only when ``config``) and the
    ``SECTION.key=value`` options of ``spec`` (and its positional option's words)."""
    parser.add_argument("overrides", nargs="*", metavar=metavar, help=help, action=_Positionals, spec=spec,
                        config=config)


def split_options(items: list[str], spec: Options) -> tuple[list[str], list[str]]:
    """(the ``SECTION.key=value`` items of ``spec``, the others), e.g. of what ``parse_known_args`` left."""
    return [a for a in items if _is_key_of(a, spec.section)], [a for a in items if not _is_key_of(a, spec.section)]


def resolve_options(parser: argparse.ArgumentParser, spec: Options[O], ns: argparse.Namespace,
                    dotted: list[str] | None = None) -> O:
    """``spec``'s options from the flags parsed into ``ns`` and the ``SECTION.key=value`` items
    (``dotted``; default: those among the positional arguments), typed and checked as config keys
    are. An unknown key, a bad value, an option given both ways or a required one missing exits 2
    with a message that names it."""

    def fail(message: str) -> typing.NoReturn:
        parser.exit(2, f"{parser.prog}: error: {message}\n")

    options = {o.path: o for o in _option_list(spec)}
    dotted = list(getattr(ns, "option_overrides", []) if dotted is None else dotted)
    values = {path: getattr(ns, path) for path in options if hasattr(ns, path)}
    for path, v in values.items():  # `--input A B prepare.out=C`: the flag's nargs="+" took C's option along
        if _greedy(options[path]):
            dotted += [x for x in v if isinstance(x, str) and _is_key_of(x, spec.section)]
            values[path] = [x for x in v if not (isinstance(x, str) and _is_key_of(x, spec.section))]
    given_as_flag = set(values)
    for item in dotted:
        key, eq, text = item.partition("=")
        key = key.strip()
        path = key.removeprefix(spec.section + ".")
        if not eq or path not in options:
            close = difflib.get_close_matches(key, [o.key for o in options.values()], n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            fail(f"unknown option key '{key}'{hint} (the options are {', '.join(o.key for o in options.values())})")
        o = options[path]
        if path in given_as_flag:
            fail(f"option '{key}' given twice, as {_form(o)} and as {key}=...: give it once")
        if o.flag.sep and not text.lstrip().startswith("["):  # the flag's form: 8,16,32
            values[path] = [parse_value(x.strip()) for x in text.split(o.flag.sep) if x.strip()]
        else:
            values[path] = parse_value(text)
    missing = [o for o in options.values() if o.default is dataclasses.MISSING and o.path not in values]
    if missing:
        fail("; ".join(f"option '{o.key}' is required: give {_form(o)} or {o.key}=VALUE" for o in missing))
    nested: dict[str, Any] = {}
    for path, v in values.items():
        *heads, leaf = path.split(".")
        node = nested
        for h in heads:
            node = node.setdefault(h, {})
        node[leaf] = v
    try:
        return build_dataclass(spec.cls, nested, spec.section + ".")
    except ConfigError as e:
        fail(str(e))


def parse_options(parser: argparse.ArgumentParser, spec: Options[O], argv: list[str] | None = None,
                  config: bool = False, metavar: str | None = None,
                  help: str | None = None) -> tuple[O, argparse.Namespace]:
    """A command with no config preset: its options from ``argv`` (flags and ``SECTION.key=value``),
    and the namespace (``overrides``: the config overrides, when ``config``)."""
    add_options(parser, spec)
    add_positionals(parser, spec, config=config, metavar=metavar or f"{spec.section}.KEY=VALUE",
                    help=help or "options in their dotted form (each also a --flag, listed below)")
    ns = parser.parse_intermixed_args(argv)  # options may come between the positional arguments
    return resolve_options(parser, spec, ns), ns


def _config_flag(cls: type, key: str, flag: str) -> _Option:
    """The config key ``key`` as an option of flag ``flag`` (its type, default and docstring)."""
    *heads, leaf = key.split(".")
    node = cls
    for h in heads:
        node = typing.get_type_hints(node)[h]
    f = {f.name: f for f in dataclasses.fields(node)}[leaf]
    return _Option(key, key, typing.get_type_hints(node)[leaf], _field_default(f), field_docs(node).get(leaf, ""),
                   Flag(flag), "config keys")


def parse_cli(
    cls: type[T],
    argv: list[str] | None = None,
    prog: str | None = None,
    description: str | None = None,
    options: Options | None = None,
    flags: Mapping[str, str] | None = None,
) -> tuple[T, argparse.Namespace]:
    """``--config PATH [key=value ...]``; ``--help`` lists every key with its docstring.

    ``options``: the command's own options (``SECTION.key=value`` or ``--flag``), resolved into
    ``args.options``. ``flags``: config key -> a flag that sets it too (``{"eval.limit": "--limit"}``).
    """
    parser = argparse.ArgumentParser(
        prog=prog,
        description=description,
        epilog="config keys (override any with key=value):\n" + format_help(cls),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML preset (see configs/)")
    aliases = {key: _config_flag(cls, key, flag) for key, flag in (flags or {}).items()}
    if aliases:
        group = parser.add_argument_group("config keys that have a flag too")
        for o in aliases.values():
            _add_flag(group, o)
    if options is not None:
        if options.section in {f.name for f in dataclasses.fields(cls)}:  # its keys would be taken for the config's
            raise ValueError(f"options section '{options.section}' is a config section too")
        add_options(parser, options)
    add_positionals(parser, options)
    args = parser.parse_intermixed_args(argv)  # options may come between the key=value overrides
    for key, o in aliases.items():  # a flag of a config key is one more override, given once
        if hasattr(args, key):
            if any(item.partition("=")[0].strip() == key for item in args.overrides):
                parser.exit(2, f"{parser.prog}: error: config key '{key}' given twice, as {o.flag.name} and as "
                               f"{key}=...: give it once\n")
            args.overrides.append(f"{key}={json.dumps(getattr(args, key))}")
    args.options = resolve_options(parser, options, args) if options is not None else None
    try:
        cfg = configuration.load(cls, args.config, args.overrides)  # looked up here: tests patch it
    except ConfigError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    return cfg, args
