"""Extension values of the wire format: dtype and extension-code tables, payload helpers.

Shared by the encoder (:mod:`fastio._ext_encode`), the decoder (:mod:`fastio._ext_decode`)
and the JSON hook (:mod:`fastio.jsonhook`). ``docs/PROTOCOL.md``, "Extension types", is
the specification of these payloads.
"""

from __future__ import annotations

import struct
import sys
from typing import Any

import msgspec
import numpy as np

from fastio.errors import EncodeError
from fastio.protocol import DTYPE_NAMES, ExtCode

#: Maximum number of dimensions of a decoded array (numpy's own limit).
_MAX_NDIM = 64

_EXT_NDARRAY = int(ExtCode.NDARRAY)
_EXT_TENSOR = int(ExtCode.TENSOR)
_EXT_IMAGE = int(ExtCode.IMAGE)
_EXT_TOKENS = int(ExtCode.TOKENS)
_ARRAY_CODES = frozenset((_EXT_NDARRAY, _EXT_TENSOR, _EXT_TOKENS))

if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts in CI
    raise ImportError("fastio supports little-endian hosts only")

# Wire dtype name -> little-endian numpy dtype. bfloat16 has no numpy dtype: it only
# travels as a torch tensor. These are numpy's own dtype instances (native order is
# little-endian here), the ones arrays made the usual way carry: a dict lookup of such
# an array's dtype then matches by identity, without numpy's dtype comparison.
_NP_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name) for name in DTYPE_NAMES if name != "bfloat16"
}
# numpy dtype -> wire name, for the dtypes that need no conversion. Keyed by dtype
# object: ``arr.dtype.name`` builds a string per call, a dict lookup does not.
_WIRE_NAMES: dict[np.dtype[Any], str] = {dt: name for name, dt in _NP_DTYPES.items()}


_meta_encode = msgspec.msgpack.Encoder().encode
# Inline data decodes straight into a bytearray: the private writable copy the docstring
# of fastio.codec promises, made by msgspec itself (no second copy).
_array_meta_decode = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...], int | bytearray]).decode
_image_meta = msgspec.msgpack.Decoder(tuple[str, int, int, int | bytearray])
_Ext = msgspec.msgpack.Ext

# Token arrays: ext code -> (numpy dtype, payload form: _INLINE, _FRAME or _REF).
_TOKENS_INLINE = int(ExtCode.TOKENS_INLINE)
_TOKENS_FRAME = int(ExtCode.TOKENS_FRAME)
_TOKENS_REF = int(ExtCode.TOKENS_REF)
_INLINE, _FRAME, _REF = 0, 1, 2
_TOKEN_CODES: dict[int, tuple[np.dtype[Any], int]] = {}
_INLINE_DTYPES: dict[int, np.dtype[Any]] = {}  # inline ext code -> dtype
_FRAME_DTYPES: dict[int, np.dtype[Any]] = {}  # frame ext code (8-byte payload) -> dtype
_REF_DTYPES: dict[int, np.dtype[Any]] = {}  # compact frame ext code (1 byte) -> dtype
_INLINE_CODE: dict[np.dtype[Any], int] = {}  # dtype -> inline ext code
_FRAME_CODE: dict[np.dtype[Any], int] = {}  # dtype -> frame ext code
_FRAME_REF = struct.Struct("<II")  # frame index, element count
for _d, _name in enumerate(DTYPE_NAMES):
    if _name in _NP_DTYPES:
        _TOKEN_CODES[_TOKENS_INLINE + _d] = (_NP_DTYPES[_name], _INLINE)
        _INLINE_DTYPES[_TOKENS_INLINE + _d] = _NP_DTYPES[_name]
        _FRAME_DTYPES[_TOKENS_FRAME + _d] = _NP_DTYPES[_name]
        _TOKEN_CODES[_TOKENS_FRAME + _d] = (_NP_DTYPES[_name], _FRAME)
        _REF_DTYPES[_TOKENS_REF + _d] = _NP_DTYPES[_name]
        _TOKEN_CODES[_TOKENS_REF + _d] = (_NP_DTYPES[_name], _REF)
for _dt, _name in _WIRE_NAMES.items():
    _INLINE_CODE[_dt] = _TOKENS_INLINE + DTYPE_NAMES.index(_name)
    _FRAME_CODE[_dt] = _TOKENS_FRAME + DTYPE_NAMES.index(_name)


def _by_code(table: dict[int, np.dtype[Any]]) -> list[np.dtype[Any] | None]:
    """``table`` as a list indexed by ext code (256 entries: msgpack codes are int8, and
    a negative code indexes the upper half, which is all None): the decoder's hooks
    look dtypes up with one list subscript instead of a ``dict.get`` call."""
    out: list[np.dtype[Any] | None] = [None] * 256
    for code, dtype in table.items():
        out[code] = dtype
    return out


_INLINE_BY_CODE = _by_code(_INLINE_DTYPES)
_FRAME_BY_CODE = _by_code(_FRAME_DTYPES)
_REF_BY_CODE = _by_code(_REF_DTYPES)

#: The compact frame references a token array in frame ``k`` (1-255) is written as:
#: ``_REFS[inline_code][k]``, an ``Ext(inline_code + 32, bytes([k]))`` made on first use
#: and shared from then on (Ext values are never mutated): the encoder's hot path
#: allocates nothing for a reference.
_REFS: list[list[Any]] = [[None] * 256 for _ in range(_TOKENS_INLINE + len(DTYPE_NAMES))]


def _ref(code: int, k: int) -> Any:
    """The compact reference to frame ``k`` (1-255) of a token array whose inline
    code is ``code``, or the 8-byte form (code + 16) for a larger ``k``."""
    if k > 255:
        raise IndexError(k)
    ref = _REFS[code][k] = msgspec.msgpack.Ext(code + _TOKENS_REF - _TOKENS_INLINE, bytes((k,)))
    return ref


_EMPTY = memoryview(b"")
_BF16_STORAGE = np.dtype("<u2")

# Bytes per pixel of the PIL modes carried as raw pixels; others convert first.
_IMAGE_MODES = {
    "L": 1,
    "LA": 2,
    "RGB": 3,
    "RGBA": 4,
    "CMYK": 4,
    "YCbCr": 3,
    "I": 4,
    "F": 4,
    "I;16": 2,
}

# torch is optional (the ``torch`` extra) and slow to import: import it only when a
# tensor is actually encoded (then torch is already in sys.modules) or decoded.
_torch_names: dict[Any, str] = {}  # torch.dtype -> wire name
_torch_dtypes: dict[str, tuple[Any, int]] = {}  # wire name -> (torch.dtype, itemsize)


def _torch_tables() -> None:
    import torch

    for name in DTYPE_NAMES:
        dt = getattr(torch, name, None)
        if name in ("uint16", "uint32", "uint64") or dt is None:
            # torch's unsigned wide types lack most kernels (view, copy): not supported.
            continue
        _torch_dtypes[name] = (dt, torch.empty((), dtype=dt).element_size())
        _torch_names[dt] = name


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _is_pil_image(obj: Any) -> bool:
    pil = sys.modules.get("PIL.Image")
    return pil is not None and isinstance(obj, pil.Image)


def _normalise_dtype(arr: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], str]:
    """Slow path of :meth:`Encoder._array_ext`: byte-swap or reject the dtype."""
    dt = arr.dtype
    if dt.byteorder == ">" and dt.newbyteorder("<") in _WIRE_NAMES:
        arr = arr.astype(dt.newbyteorder("<"))
        return arr, _WIRE_NAMES[arr.dtype]
    for known, name in _WIRE_NAMES.items():
        # Equal dtypes that hash differently (e.g. with metadata) still map.
        if dt == known:
            return arr.view(known), name
    raise EncodeError(
        f"unsupported array dtype {dt}; supported: {sorted(_NP_DTYPES)} "
        "(and bfloat16 as a torch tensor)"
    )
