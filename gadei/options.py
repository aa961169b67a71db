"""Options declared once: each is a field of the dataclass of the part that uses it, and that
field says everything about it (default, what it does, its allowed values). The command-line
flags and their `--help`, a job file's keys and their checks are made from those declarations
(`add_arguments`, `from_args`, `check`), and so is their record in a region's header
(`to_header`, `from_header`), so an option is written in one place:

    @dataclass(frozen=True)
    class Options:
        lr: float = option(0.01, "learning rate", low=0, low_open=True, high=10)

Types come from the field's annotation (int, float, bool, str, or one of them or None; a list
or dict, whose flag takes JSON, with `allowed` saying what it holds and `check` checking it). A
field declared with `flag=False` has no command-line flag; one with `job=False` is not a job-file
key (the part's docstring says why). `to_argv` writes an instance's values as the flags
`add_arguments` makes, so one process hands its options to another through the declarations.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import json
import math
import types
import typing
from typing import Any, Callable


def option(default: Any, help: str, *, choices: tuple | None = None, low: float | None = None,
           high: float | None = None, low_open: bool = False, high_open: bool = False, flag: bool = True,
           job: bool = True, metavar: str | None = None, check: Callable[[Any], Any] | None = None,
           shown: str | None = None, modes: tuple[str, ...] | None = None, auto: bool = False,
           allowed: str | None = None) -> Any:
    """A dataclass field that declares an option.

    Args:
        default: the value when none is given.
        help: what the option does, for `--help` and the docs (one sentence, no default).
        choices: the allowed values.
        low, high: the allowed range (inclusive unless `low_open`/`high_open`).
        flag: whether the command line has it (`--name-with-dashes`).
        job: whether a job file has it (a key of the part's section).
        metavar: the value's name in `--help`.
        check: a function of the value that returns it (or a normalised one) or raises
            ValueError saying what is allowed, for what ranges and choices cannot say.
        shown: the default as `--help` says it, where the value does not say it well.
        allowed: what is allowed, in words, where the type and range do not say it.
        auto: None is the part's own choice, written "auto" in a job file (the default).
        modes: the training modes that use the option (None: all); a value other than the
            default in another mode is refused (`RuleOptions.check`), and `gadei status`
            shows it only in these.
    """
    meta = dict(help=help, choices=choices, low=low, high=high, low_open=low_open, high_open=high_open, flag=flag,
                job=job, metavar=metavar, check=check, shown=shown, modes=modes,
                auto=auto, allowed=allowed)
    if isinstance(default, (list, dict)):  # each instance its own copy
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata={"option": meta})
    return dataclasses.field(default=default, metadata={"option": meta})


def same_as(cls, name: str) -> Any:
    """A field that is option `name` of `cls` under another name in another part: its default,
    help and allowed values are that declaration's (declared there, once)."""
    f = next(f for f in declared(cls) if f.name == name)
    return dataclasses.field(default=f.default, metadata=f.metadata)


def default_of(f: dataclasses.Field) -> Any:
    """A declared field's default value (a list or dict option's is made by a factory)."""
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def declared(cls) -> list[dataclasses.Field]:
    """The fields of dataclass `cls` declared with `option`."""
    return [f for f in dataclasses.fields(cls) if "option" in f.metadata]


def used_in(cls, name: str, mode: str) -> bool:
    """Whether option `name` of `cls` is used in training mode `mode`."""
    modes = next(f for f in declared(cls) if f.name == name).metadata["option"]["modes"]
    return modes is None or mode in modes


def job_keys(cls) -> list[str]:
    """The job-file keys `cls` declares: its own first, then those it inherits."""
    keys = [f.name for f in declared(cls) if f.metadata["option"]["job"]]
    own = cls.__dict__.get("__annotations__", {})
    return [k for k in keys if k in own] + [k for k in keys if k not in own]


_JSON = (list, dict)  # the kinds whose flag takes a JSON value
_WHAT = {int: "an integer", float: "a number", str: "a string", list: "a JSON list", dict: "a JSON object"}


def _types(cls, f: dataclasses.Field) -> tuple[type, bool]:
    """(the field's value type, whether None is allowed); list[...] and dict[...] are list and dict."""
    hint = typing.get_type_hints(cls)[f.name]
    args = typing.get_args(hint)
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) != 1:
            raise TypeError(f"{cls.__name__}.{f.name}: an option has one type (or it or None), not {hint}")
        hint, optional = kinds[0], type(None) in args
    kind = typing.get_origin(hint) or hint
    if kind in _JSON and not f.metadata["option"]["allowed"]:
        raise TypeError(f"{cls.__name__}.{f.name}: a {kind.__name__} option says what it holds (allowed=...)")
    return kind, optional


def allowed(cls, name: str) -> str:
    """What option `name` of `cls` allows, in words (the end of an error message)."""
    f = next(f for f in declared(cls) if f.name == name)
    meta = f.metadata["option"]
    kind, _ = _types(cls, f)
    if meta["allowed"]:
        return meta["allowed"]
    if meta["choices"]:
        return ", ".join(map(str, meta["choices"]))
    if kind is bool:
        return 'true, false or "auto"' if meta["auto"] else "true or false"
    what = _WHAT[kind]
    low, high = meta["low"], meta["high"]
    if kind is int and low is not None and high is not None:
        return f"{low + meta['low_open']:,} to {high - meta['high_open']:,}"
    parts = []
    if low is not None:
        parts.append(f"{'above' if meta['low_open'] else 'from'} {low:g}")
    if high is not None:
        parts.append(f"{'below' if meta['high_open'] else 'up to'} {high:g}")
    return " ".join([what, ", ".join(parts)]) if parts else what


def check(cls, name: str, value: Any) -> Any:
    """`value` checked against option `name` of `cls` (an int is taken for a float): the value,
    or the one its `check` makes of it.

    Raises:
        ValueError: the value's type, range or choice is not allowed; the message says what is
            (without the option's name: the caller knows where the value came from).
    """
    f = next((f for f in declared(cls) if f.name == name), None)
    if f is None:
        raise KeyError(f"{cls.__name__} has no option {name!r}")
    meta = f.metadata["option"]
    kind, optional = _types(cls, f)
    if value is None and optional or meta["auto"] and value == "auto":
        return None
    ok = (isinstance(value, bool) if kind is bool else
          isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
          isinstance(value, int) and not isinstance(value, bool) if kind is int else isinstance(value, kind))
    if not ok:
        words = allowed(cls, name)
        if meta["allowed"]:
            raise ValueError(f"is {_json_name(value) if kind in _JSON else _type_name(value)}; allowed: {words}")
        what = 'true, false or "auto"' if meta["auto"] else "true or false" if kind is bool else _WHAT[kind]
        raise ValueError(f"is {_type_name(value)}; allowed: {what}" + ("" if words.startswith(what) else f" ({words})"))
    if kind is float:
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"is out of range; allowed: {allowed(cls, name)}")
    if meta["choices"] and value not in meta["choices"]:
        close = difflib.get_close_matches(str(value), list(map(str, meta["choices"])), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"is not one of the choices{hint}; allowed: {allowed(cls, name)}")
    low, high = meta["low"], meta["high"]
    if low is not None and (value <= low if meta["low_open"] else value < low):
        raise ValueError(f"is out of range; allowed: {allowed(cls, name)}")
    if high is not None and (value >= high if meta["high_open"] else value > high):
        raise ValueError(f"is out of range; allowed: {allowed(cls, name)}")
    if meta["check"] is not None:
        try:
            value = meta["check"](value)
        except ValueError as err:  # its own words: "'gpu' is not a device; allowed: ..."
            raise ValueError(f": {err}") from None
    return value


def said(what: str, err: ValueError) -> str:
    """`what` (`lr = 11`) followed by `check`'s words for it (`is out of range; ...` or `: ...`)."""
    text = str(err)
    return f"{what}{text}" if text.startswith(":") else f"{what} {text}"


def check_all(instance) -> None:
    """Check every declared option of a dataclass `instance`.

    Raises:
        ValueError: naming the first option whose value is not allowed.
    """
    cls = type(instance)
    for f in declared(cls):
        try:
            check(cls, f.name, getattr(instance, f.name))
        except ValueError as err:
            raise ValueError(said(f"{f.name} = {getattr(instance, f.name)!r}", err)) from None


def _type_name(value) -> str:
    return {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "a list",
            dict: "a table", type(None): "nothing"}.get(type(value), type(value).__name__)


def _json_name(value) -> str:
    return {dict: "a JSON object", list: "a JSON list"}.get(type(value)) or _type_name(value)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def as_flag(name: str, value: Any) -> str:
    """Option `name` set to `value` as a command line gives it: `--every 2`, `--float16`."""
    if isinstance(value, bool):
        return flag(name) if value else "--no-" + name.replace("_", "-")
    return f"{flag(name)} {value:g}" if isinstance(value, float) else f"{flag(name)} {value}"


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls, *,
                  skip: tuple[str, ...] = (), only: tuple[str, ...] | None = None,
                  exclusive: tuple[tuple[str, ...], ...] = ()) -> None:
    """A flag for each option of `cls` that has one (`--name-with-dashes`), its help and default
    from the declaration; a flag's value is checked as a job file's is ("auto" taken for an
    `auto` option). `skip`: options left out; `only`: just these; `exclusive`: sets of options
    given one at a time, each a mutually exclusive group where its first option is declared (the
    usage shows `[--a N | --b S]`, and argparse refuses two of them)."""
    groups: dict[tuple[str, ...], argparse._MutuallyExclusiveGroup] = {}
    for f in declared(cls):
        meta = f.metadata["option"]
        if not meta["flag"] or f.name in skip or only is not None and f.name not in only:
            continue
        names = next((names for names in exclusive if f.name in names), None)
        if names is not None:
            if names not in groups:
                groups[names] = parser.add_mutually_exclusive_group()
            parser_of_this = groups[names]
        else:
            parser_of_this = parser
        kind, optional = _types(cls, f)
        value = default_of(f)
        default = meta["shown"] or ("auto" if value is None and meta["auto"] else "none" if value in (None, "", [], {})
                                    else "on" if value is True else "off" if value is False else
                                    f"{value:g}" if kind is float else json.dumps(value) if kind in _JSON else
                                    str(value))
        text = f"{meta['help']} (default {default})"
        if kind is bool:
            parser_of_this.add_argument(flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                        default=f.default, help=text)
            continue
        parser_of_this.add_argument(flag(f.name), dest=f.name, type=_parser(cls, f.name, kind), default=value,
                                    choices=meta["choices"], metavar=meta["metavar"] or ("JSON" if kind in _JSON
                                                                                         else None), help=text)


def _parser(cls, name: str, kind: type) -> Callable[[str], Any]:
    meta = next(f for f in declared(cls) if f.name == name).metadata["option"]

    def parse(text: str):
        if text == "auto" and meta["auto"]:
            return None
        try:
            value = json.loads(text) if kind in _JSON else kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {_WHAT[kind]}; allowed: "
                                             f"{allowed(cls, name)}") from None
        try:
            return check(cls, name, value)
        except ValueError as err:
            raise argparse.ArgumentTypeError(said(text, err)) from None

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def to_argv(instance) -> list[str]:
    """The flags of a dataclass `instance`'s options, as `add_arguments` makes them and
    `from_args` reads them back into an equal instance: one `--name=VALUE` (`--name`,
    `--no-name` for a bool) for each value other than its declared default; a float as
    `repr` writes it (exact), a list or dict as JSON.

    Raises:
        ValueError: a value no flag can say (None where the option's default is not).
    """
    cls = type(instance)
    argv = []
    for f in declared(cls):
        meta = f.metadata["option"]
        value = getattr(instance, f.name)
        if not meta["flag"] or value == default_of(f):
            continue
        kind, _ = _types(cls, f)
        if kind is bool and value is not None:
            argv.append(flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif value is None:
            if not meta["auto"] or kind is bool:
                raise ValueError(f"{cls.__name__}.{f.name} = None: no flag says it (its default is {default_of(f)!r})")
            argv.append(f"{flag(f.name)}=auto")
        else:
            text = json.dumps(value) if kind in _JSON else repr(float(value)) if kind is float else str(value)
            argv.append(f"{flag(f.name)}={text}")
    return argv


def from_args(cls, args: argparse.Namespace, **more):
    """An instance of `cls` from the flags `add_arguments` made (and `more` fields)."""
    values = {f.name: getattr(args, f.name) for f in declared(cls) if hasattr(args, f.name)}
    return cls(**values, **more)


def to_header(header, instance) -> None:
    """Record `instance`'s options in a region header (its creator does this before it
    publishes the region), each in the header field of its name: a choice as its index in the
    choices, a flag as 0 or 1 (`from_header` reads them)."""
    for f in declared(type(instance)):
        value, choices = getattr(instance, f.name), f.metadata["option"]["choices"]
        header.set(f.name, choices.index(value) if choices else int(value) if isinstance(value, bool) else value)


def from_header(cls, header):
    """The `cls` options a region header records (`to_header`). A choice's code outside its
    table is shown as `code N`: a reader of a corrupt header (gadei status) still shows the rest."""
    values = {}
    for f in declared(cls):
        code, choices = header.get(f.name), f.metadata["option"]["choices"]
        if choices:
            values[f.name] = choices[code] if code < len(choices) else f"code {code}"
        else:
            values[f.name] = bool(code) if f.type in (bool, "bool") else code
    return cls(**values)
