"""Decode error messages: what is wrong with a rejected message, with the field path
(``LLMRequest.gconfig.max_new_tokens``) of a value msgspec refused. Off the hot path:
:meth:`fastio.Decoder.decode` calls these only for a message that failed."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from fastio._ext import _FRAME, _FRAME_REF, _INLINE, _TOKEN_CODES
from fastio._header import _buffer
from fastio.errors import DecodeError

_any_decoder = msgspec.msgpack.Decoder(ext_hook=lambda code, data: None)


class _Rejected(Exception):
    """Raised on the decode hot path for a message :meth:`Decoder._diagnose` explains."""


def _frame_error(what: str, k: int, frames: Any) -> DecodeError:
    return DecodeError(
        f"{what} refers to frame {k}, but the message has "
        + (f"frames 1..{len(frames) - 1}" if len(frames) > 1 else "no buffer frames")
    )


def _token_error(code: int, payload: memoryview, frames: Any) -> DecodeError:
    """What is wrong with a token-array extension value that failed to decode."""
    dtype, form = _TOKEN_CODES[code]
    if form == _INLINE:
        return DecodeError(
            f"token array of {dtype.name} needs a multiple of {dtype.itemsize} bytes of "
            f"data, got {len(payload)}"
        )
    if form == _FRAME:
        if len(payload) != _FRAME_REF.size:
            return DecodeError(f"token array frame reference must be 8 bytes, got {len(payload)}")
        k, count = _FRAME_REF.unpack(payload)
    else:
        if len(payload) != 1:
            return DecodeError(
                f"compact token array frame reference must be 1 byte, got {len(payload)}"
            )
        k, count = payload[0], -1
    if not 0 < k < len(frames):
        return _frame_error("token array", k, frames)
    try:
        got = _buffer(frames[k]).nbytes
    except DecodeError as err:  # not bytes-like, not contiguous
        return err
    if count < 0:
        return DecodeError(
            f"token array of {dtype.name} in frame {k} needs a multiple of {dtype.itemsize} "
            f"bytes of data, got {got}"
        )
    return DecodeError(
        f"token array {dtype.name}[{count}] needs {count * dtype.itemsize} bytes of data, got {got}"
    )


_PATH = re.compile(r" - at `\$((?:\[\d+\])*)(.*)`$")
_INDEX = re.compile(r"\[(\d+)\]")


def _body_error(tp: Any, header: Any, exc: Exception) -> str:
    """msgspec's message with the path made relative to the body (``$[2]`` of the
    header tuple is ``$``) and the field names it stands for (``array_like`` Structs
    only number their fields), e.g. ``Expected `int` >= 1 - at `$[3][2]`
    (LLMRequest.gconfig.max_new_tokens)``."""
    text = str(exc)
    m = _PATH.search(text)
    if m is None:
        return text
    idx = [int(i) for i in _INDEX.findall(m.group(1))]
    if not idx or idx[0] != 2:
        return text
    idx = idx[1:]
    rest = m.group(2)
    where = "$" + "".join(f"[{i}]" for i in idx) + rest
    try:
        names = _field_names(tp, _any_decoder.decode(_buffer(header))[2], idx)
    except Exception:  # naming is best effort: the path above is exact
        names = ""
    return text[: m.start()] + f" - at `{where}`" + (f" ({names}{rest})" if names else "")


def _field_names(tp: Any, value: Any, idx: list[int]) -> str:
    """Dotted field names along ``idx`` in the raw decoded ``value`` of type ``tp``."""
    import msgspec.inspect as mi

    info: Any = mi.type_info(tp)
    parts: list[str] = []
    for i in idx:
        while isinstance(info, mi.UnionType):  # pick the Struct the tag names
            tag = value[0] if isinstance(value, list) and value else None
            structs = [t for t in info.types if isinstance(t, mi.StructType) and t.tag == tag]
            if not structs:
                return ".".join(parts)
            info = structs[0]
        if isinstance(info, mi.StructType):
            if not parts:
                parts.append(info.cls.__name__)
            if i == 0:
                parts.append("(tag)")
                return ".".join(parts)
            field = info.fields[i - 1]
            parts.append(field.name)
            info = field.type
        elif isinstance(info, (mi.ListType, mi.TupleType, mi.VarTupleType)):
            parts[-1:] = [f"{parts[-1] if parts else ''}[{i}]"]
            info = info.item_type if not isinstance(info, mi.TupleType) else info.item_types[i]
        else:
            return ".".join(parts)
        value = value[i] if isinstance(value, list) and i < len(value) else None
    return ".".join(parts)
