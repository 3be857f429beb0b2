""":class:`WireStruct`, the base of every fastio message, the registry of message types,
and the conversion of token fields.

Struct options, chosen once for every wire type:

``array_like=True``
    A Struct is a msgpack array of its fields, tag first: no field names on the wire.
    Schema evolution *appends* fields with defaults: older readers ignore trailing
    fields, newer ones fill missing ones from defaults (``docs/PROTOCOL.md``).
``gc=False``
    Thousands of requests are alive at once in a rollout; untracked, they do not slow
    the cyclic collector. Safe because the types hold no cycles (keep ``metadata`` so).
``tag=int(MsgKind.*)``, ``tag_field="__kind__"``
    An integer tag per type lets one receiver decode whatever arrives
    (``decode(frames, type=None)``); set on the base so every subclass is tagged.
not ``frozen``, not ``forbid_unknown_fields``
    Rollout code mutates requests and responses, and old readers must accept newer
    peers' appended fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from fastio.tokens import TokenArray

__all__ = ["WireStruct", "message_types"]

#: Bumped whenever a WireStruct subclass is defined, so the codec knows when the union
#: of message types (``decode(frames, type=None)``) must be rebuilt.
_registry_generation = 0


class WireStruct(msgspec.Struct, array_like=True, gc=False, tag_field="__kind__"):
    """Base of every fastio wire type (see :mod:`fastio.structs` for the options).

    Subclass it with ``tag=<unused MsgKind value>`` to define a new message type; the
    codec's ``type=None`` union picks it up automatically.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        global _registry_generation
        super().__init_subclass__(**kwargs)
        _registry_generation += 1


def message_types() -> tuple[type[WireStruct], ...]:
    """Every message type ``decode(frames, type=None)`` accepts right now.

    These are the :class:`WireStruct` subclasses with an integer tag defined in the
    ``fastio`` package, in tag order. Subclasses defined elsewhere (applications,
    tests) are left out, so they never collide with a wire tag; decode them by passing
    their type explicitly.
    """
    found: dict[int, type[WireStruct]] = {}
    stack: list[type[Any]] = [WireStruct]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        tag = cls.__struct_config__.tag
        if (
            isinstance(tag, int)
            and not isinstance(tag, bool)
            and cls.__module__.split(".", 1)[0] == "fastio"
        ):
            other = found.get(tag)
            if other is not None and other is not cls:
                raise TypeError(f"{cls.__qualname__} and {other.__qualname__} share tag {tag}")
            found[tag] = cls
    return tuple(found[k] for k in sorted(found))


class _CheckedMeta(msgspec.StructMeta):
    """Metaclass of the types with construction-time checks: ``cls(...)`` runs
    ``cls._check_new(obj)`` after msgspec's ``__init__``. Decoding never calls it
    (msgspec checks typed fields and constraints itself), so checks run once."""

    _check_new: Any

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        obj = super().__call__(*args, **kwargs)
        cls._check_new(obj)
        return obj


if TYPE_CHECKING:
    _Tokens = TokenArray
else:
    # msgspec sees token fields as Any so that it never calls the per-field dec_hook on
    # the hot path: the codec decodes token encodings straight into TokenArray, and
    # __post_init__ (which msgspec runs on decode too) converts or rejects anything else.
    _Tokens = Any

_TA = TokenArray
# The fast path of the token-field checks: a set lookup of the array's dtype. Other
# dtypes of the right kind (byte order, metadata) take the full check, which accepts them.
_INT_DTYPES = frozenset(
    np.dtype(n) for n in ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")
)
_NUM_DTYPES = _INT_DTYPES | {np.dtype(n) for n in ("float16", "float32", "float64")}


def _tokens(value: Any, dtype: Any, field: str) -> TokenArray:
    """A token field's value as a TokenArray: lists convert to ``dtype`` when every value
    fits exactly; a float among token ids or an id beyond the dtype's range raises
    instead of being truncated."""
    if isinstance(value, TokenArray):
        return value
    if isinstance(value, np.ndarray) or type(value).__module__ == "torch":
        return TokenArray(value)
    if not isinstance(value, (list, tuple, range)):
        raise TypeError(
            f"{field} takes a list, tuple, numpy array or TokenArray of numbers, "
            f"got {type(value).__name__}"
        )
    target = np.dtype(dtype)
    if len(value) == 0:
        return TokenArray._wrap(np.empty(0, target))
    try:
        arr = np.asarray(value)
    except ValueError as exc:  # ragged nesting
        raise ValueError(f"{field} must be a flat sequence of numbers") from exc
    kind = arr.dtype.kind
    if kind == "O" and arr.ndim == 1 and all(type(x) is int for x in value):
        raise OverflowError(
            f"{field}: integers beyond 64 bits cannot be stored or sent (int64, and uint64 "
            "for values in [2**63, 2**64), are the widest)"
        )
    if kind not in "biuf":
        raise TypeError(f"{field} holds numbers, got {arr.dtype} values")
    if arr.ndim != 1:
        raise ValueError(f"{field} must be a flat sequence of numbers, got shape {arr.shape}")
    if target.kind in "iu" and kind == "f":
        raise TypeError(f"{field} holds integers, got floats")
    if target.kind in "iu" and kind in "iu":
        info = np.iinfo(target)
        if arr.min() < info.min or arr.max() > info.max:
            # Wider ids are kept, as the seed's lists kept any int: numpy already chose
            # int64 (or uint64 for values >= 2**63).
            target = arr.dtype
    t = TokenArray._wrap(arr.astype(target, copy=False))
    t._excl = True
    return t


def _int_tokens(value: Any, dtype: Any, field: str) -> TokenArray:
    """A token field of integers (ids, versions): a float or bool array raises."""
    t = value if type(value) is TokenArray else _tokens(value, dtype, field)
    if t._a.dtype.kind not in "iu":
        raise TypeError(f"{field} holds integers, got an array of {t._a.dtype}")
    return t


def _float_tokens(value: Any, dtype: Any, field: str) -> TokenArray:
    """A token field of numbers (logprobs, latencies): a bool array raises."""
    t = value if type(value) is TokenArray else _tokens(value, dtype, field)
    if t._a.dtype.kind not in "fiu":
        raise TypeError(f"{field} holds numbers, got an array of {t._a.dtype}")
    return t
