"""Extension values of the wire format: dtype and extension-code tables, payload helpers.

Shared by the encoder, the decoder and the JSON hook; ``docs/PROTOCOL.md``, "Extension
types", specifies the payloads.
"""

from __future__ import annotations

import struct
import sys
from typing import Any

import msgspec
import numpy as np

from fastio.errors import EncodeError
from fastio.protocol import DTYPE_NAMES, ExtCode

if sys.byteorder != "little":  # pragma: no cover - no big-endian hosts in CI
    raise ImportError("fastio supports little-endian hosts only")

_EXT_NDARRAY = int(ExtCode.NDARRAY)
_EXT_TENSOR = int(ExtCode.TENSOR)
_EXT_IMAGE = int(ExtCode.IMAGE)
_EXT_TOKENS = int(ExtCode.TOKENS)
_INLINE = int(ExtCode.TOKENS_INLINE)
_FRAME = int(ExtCode.TOKENS_FRAME)
_REF = int(ExtCode.TOKENS_REF)

# Wire dtype name -> little-endian numpy dtype (bfloat16 travels only as a tensor).
# numpy's own dtype instances: a lookup of a usual array's dtype matches by identity.
_NP_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name) for name in DTYPE_NAMES if name != "bfloat16"
}
# numpy dtype -> wire name, for the dtypes that need no conversion.
_WIRE_NAMES: dict[np.dtype[Any], str] = {dt: name for name, dt in _NP_DTYPES.items()}

_Ext = msgspec.msgpack.Ext
_meta_encode = msgspec.msgpack.Encoder().encode
# Inline data decodes straight into a bytearray: the private writable copy that the
# codec promises for small arrays, made by msgspec itself.
_array_meta_decode = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...], int | bytearray]).decode
_image_meta_decode = msgspec.msgpack.Decoder(tuple[str, int, int, int | bytearray]).decode

#: dtype of a token-array ext code (inline ``16 + d``, frame ``32 + d``, compact frame
#: reference ``48 + d``), else None. A list of 256 so that the decoder's hook looks a
#: code up with one subscript; negative codes index the upper half, all None.
_TOKEN_DTYPES: list[np.dtype[Any] | None] = [None] * 256
for _d, _name in enumerate(DTYPE_NAMES):
    if _name in _NP_DTYPES:
        for _base in (_INLINE, _FRAME, _REF):
            _TOKEN_DTYPES[_base + _d] = _NP_DTYPES[_name]
#: dtype -> inline ext code of token arrays.
_INLINE_CODE = {dt: _INLINE + DTYPE_NAMES.index(name) for dt, name in _WIRE_NAMES.items()}
_FRAME_REF = struct.Struct("<II")  # frame index, element count

#: Compact references to frame ``k`` (1-255) of a token array of inline code ``code``:
#: ``_REFS[code][k]``, made on first use and shared (Ext values are never mutated), so
#: the encoder's hot path allocates nothing for a reference.
_REFS: list[list[Any]] = [[None] * 256 for _ in range(_INLINE + len(DTYPE_NAMES))]


def _ref(code: int, k: int) -> Any:
    ref = _REFS[code][k] = _Ext(code + _REF - _INLINE, bytes((k,)))
    return ref


_EMPTY = memoryview(b"")
_BF16_STORAGE = np.dtype("<u2")
_MAX_NDIM = 64  # numpy's own limit

# Bytes per pixel of the PIL modes carried as raw pixels; others convert first.
_IMAGE_MODES = {
    **{"L": 1, "LA": 2, "I;16": 2, "RGB": 3, "YCbCr": 3},
    **{"RGBA": 4, "CMYK": 4, "I": 4, "F": 4},
}

# torch is optional and slow to import: its tables are built on first use.
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
    """Byte-swap ``arr`` or map an equal dtype to its wire name; EncodeError otherwise."""
    dt = arr.dtype
    if dt.byteorder == ">" and dt.newbyteorder("<") in _WIRE_NAMES:
        arr = arr.astype(dt.newbyteorder("<"))
        return arr, _WIRE_NAMES[arr.dtype]
    for known, name in _WIRE_NAMES.items():
        if dt == known:  # equal dtypes that hash differently (with metadata) still map
            return arr.view(known), name
    raise EncodeError(
        f"unsupported array dtype {dt}; supported: {sorted(_NP_DTYPES)} "
        "(and bfloat16 as a torch tensor)"
    )
