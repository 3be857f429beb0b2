"""The one normaliser of config Structs (:func:`configure`, :func:`parse_options`: a bad
key or value is one line that names it), the constraint aliases they share, and
:func:`resolve_entry`."""

from __future__ import annotations

import pkgutil
import re
import typing
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

__all__ = [
    "NonEmptyStr", "NonNegative", "NonNegativeSeconds", "Port", "Positive", "Seconds",
    "UnknownOption", "configure", "parse_options", "resolve_entry",
]  # fmt: skip

T = TypeVar("T", bound=msgspec.Struct)

#: An int >= 1 (counts, sizes).
Positive = Annotated[int, Meta(ge=1)]
#: An int >= 0.
NonNegative = Annotated[int, Meta(ge=0)]
#: A duration in seconds, > 0.
Seconds = Annotated[float, Meta(gt=0)]
#: A duration in seconds, >= 0 (0: none, off).
NonNegativeSeconds = Annotated[float, Meta(ge=0)]
#: A TCP port, 0 (any free one) to 65535.
Port = Annotated[int, Meta(ge=0, le=65535)]
#: A string that is not empty.
NonEmptyStr = Annotated[str, Meta(min_length=1)]

# Words a shell user writes, beside msgspec's own (1/0, true/false).
_BOOL_WORDS = {"yes": "true", "on": "true", "no": "false", "off": "false"}
_KINDS = {
    "bool": "a boolean (1/0, true/false, yes/no, on/off)",
    "float": "a number",
    "int": "an integer",
    "str": "a string",
}


def parse_options(opts: Mapping[str, Any], type_: type[T], what: str, *, prefix: str = "") -> T:
    """``opts`` (strings, or values of the field types) as a ``type_`` instance.

    Strings become the fields' types (``"1"``, ``"0.5"``, ``"on"``); an empty value means
    the default; only keys starting with ``prefix`` are read. ``type_`` is a Struct with
    ``kw_only=True`` (and ``forbid_unknown_fields=True`` to refuse unknown keys); ``what``
    names an option in the ``ValueError`` (``"weights plugin option"``).

    >>> class Opts(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    ...     poll: float = 0.05
    >>> parse_options({"poll": "0.5"}, Opts, "plugin option").poll
    0.5
    """
    given = {k: v for k, v in opts.items() if k.startswith(prefix) and v != ""}
    return _convert(given, type_, what)


def _convert(given: Mapping[str, Any], type_: type[T], what: str) -> T:
    fields = {f.encode_name: f for f in msgspec.structs.fields(type_)}
    words = {
        k: _BOOL_WORDS.get(v.strip().lower(), v)
        for k, v in given.items()
        if isinstance(v, str) and k in fields and _is_bool(fields[k].type)
    }
    given = {**given, **words}
    try:
        return msgspec.convert(given, type_, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(_message(str(exc), given, fields, what)) from None


class UnknownOption(TypeError, ValueError):
    """A key the config Struct does not have (a ``TypeError`` and a ``ValueError``)."""


def configure(type_: type[T], config: T | None, settings: Mapping[str, Any], what: str) -> T:
    """``config`` (default: ``type_()``) with ``settings`` (field name -> value, strings
    allowed) applied and checked, as a new ``type_``. A ``TypeError`` if ``config`` is not
    a ``type_`` or a key is unknown (:class:`UnknownOption`), a ``ValueError`` for a bad
    value."""
    if config is not None and not isinstance(config, type_):
        raise TypeError(f"config must be a {type_.__name__}, got {type(config).__name__}")
    known = type_.__struct_fields__
    unknown = [k for k in settings if k not in known]
    if unknown:
        raise UnknownOption(f"unknown {what} {unknown[0]!r}; known: {', '.join(known)}")
    given = msgspec.structs.asdict(config) if config is not None else {}
    return _convert({**given, **settings}, type_, what)


def resolve_entry(spec: str, what: str) -> Any:
    """The object ``spec`` (``module:attribute``) names, or a ``ValueError`` naming
    ``what`` and ``spec``."""
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"{what} {spec!r}: expected module:name")
    try:
        return pkgutil.resolve_name(spec)
    except ImportError as exc:
        raise ValueError(f"{what} {spec!r}: cannot import {module}: {exc}") from exc
    except AttributeError as exc:
        raise ValueError(f"{what} {spec!r}: {module} has no {name!r}") from exc


def _is_bool(tp: Any) -> bool:
    return tp is bool or bool in typing.get_args(tp)


def _message(error: str, given: Mapping[str, Any], fields: Mapping[str, Any], what: str) -> str:
    if m := re.fullmatch(r"Object contains unknown field `(.*)`", error):
        return f"unknown {what} {m[1]!r}; known: {', '.join(fields)}"
    if m := re.fullmatch(r"Object missing required field `(.*)`", error):
        return f"{what} {m[1]!r} is required"
    m = re.fullmatch(r"(.*) - at `\$\.([^`.\[]+)`", error)
    if m is None:  # a shape msgspec did not promise
        return f"{what}: {error}"
    problem, key = m[1], m[2]
    choices = _choices(fields[key].type)
    if choices:
        expected = "one of " + ", ".join(choices)
    elif e := re.fullmatch(r"Expected `([^`]*)`(.*?)(?:, got `[^`]*`)?", problem):
        kind = e[1].removesuffix(" | null")
        expected = _KINDS.get(kind, kind) + e[2]
    else:
        expected = problem
    return f"{what} {key}={given[key]!r}: expected {expected}"


def _choices(tp: Any) -> list[str]:
    if typing.get_origin(tp) is typing.Literal:
        return [str(c) for c in typing.get_args(tp)]
    return [c for arg in typing.get_args(tp) for c in _choices(arg)]
