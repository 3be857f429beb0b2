"""The base of every fastio message (its Struct options: ``docs/concepts.md``, "The
codec"), the registry of message types, and the conversion of token fields."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from fastio.protocol import DTYPE_NAMES
from fastio.tokens import TokenArray, _weak

__all__ = ["WireStruct", "message_types"]

#: Bumped by every new WireStruct subclass: the codec's ``type=None`` union is rebuilt.
_registry_generation = 0


class WireStruct(msgspec.Struct, array_like=True, gc=False, tag_field="__kind__"):
    """Base of every fastio wire type: subclass it with ``tag=<unused MsgKind value>``;
    the codec's ``type=None`` union picks the new type up."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        global _registry_generation
        super().__init_subclass__(**kwargs)
        _registry_generation += 1


def message_types() -> tuple[type[WireStruct], ...]:
    """Every message type ``decode(frames, type=None)`` accepts now: the tagged
    :class:`WireStruct` subclasses of the ``fastio`` package, in tag order (others,
    never colliding with a wire tag, decode by their type given explicitly)."""
    found: dict[int, type[WireStruct]] = {}
    stack: list[type[Any]] = [WireStruct]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        tag = cls.__struct_config__.tag
        if isinstance(tag, int) and not isinstance(tag, bool) and cls.__module__[:7] == "fastio.":
            other = found.setdefault(tag, cls)
            if other is not cls:
                raise TypeError(f"{cls.__qualname__} and {other.__qualname__} share tag {tag}")
    return tuple(found[k] for k in sorted(found))


class _CheckedMeta(msgspec.StructMeta):
    """``cls(...)`` runs ``cls._check_new(obj)`` after ``__init__`` (decoding does not)."""

    _check_new: Any

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        obj = super().__call__(*args, **kwargs)
        cls._check_new(obj)
        return obj


if TYPE_CHECKING:
    _Tokens = TokenArray
else:
    # Any to msgspec (no dec_hook on the hot path): __post_init__ checks the rest.
    _Tokens = Any

_TA = TokenArray
# The fast path of the token-field checks; other equal dtypes take the full check.
_NUM_DTYPES = frozenset(np.dtype(n) for n in DTYPE_NAMES if n not in ("bool", "bfloat16"))
_INT_DTYPES = frozenset(d for d in _NUM_DTYPES if d.kind in "iu")


def _tokens(value: Any, dtype: Any, field: str) -> TokenArray:
    """A token field's value as a TokenArray: lists in ``dtype`` (``int32`` for ids and
    versions, ``float64`` for logprobs and latencies) when every value fits exactly, else
    wider; floats among ids, and bool arrays, raise."""
    target = np.dtype(dtype)
    if isinstance(value, TokenArray):
        t = value
    elif isinstance(value, np.ndarray) or type(value).__module__ == "torch":
        t = TokenArray(value)
    elif isinstance(value, (list, tuple, range)):
        t = TokenArray.wrap(_weak(value, target, field), owned=True)
    else:
        raise TypeError(
            f"{field} takes a list, tuple, numpy array or TokenArray of numbers, "
            f"got {type(value).__name__}"
        )
    ints = target.kind in "iu"
    if t.dtype.kind not in ("iu" if ints else "fiu"):
        got = "floats" if isinstance(value, (list, tuple, range)) else f"an array of {t.dtype}"
        raise TypeError(f"{field} holds {'integers' if ints else 'numbers'}, got {got}")
    return t
