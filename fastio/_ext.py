"""Extension values of the wire format (``docs/PROTOCOL.md``): dtype and ext-code
tables and payload helpers of the encoder, the decoder and the JSON hook."""

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

EXT_NDARRAY = int(ExtCode.NDARRAY)
EXT_TENSOR = int(ExtCode.TENSOR)
EXT_IMAGE = int(ExtCode.IMAGE)
EXT_TOKENS = int(ExtCode.TOKENS)
INLINE = int(ExtCode.TOKENS_INLINE)
FRAME = int(ExtCode.TOKENS_FRAME)
REF = int(ExtCode.TOKENS_REF)

# Wire dtype name -> numpy's own dtype instance (bfloat16 only as a tensor).
NP_DTYPES: dict[str, np.dtype[Any]] = {
    name: np.dtype(name) for name in DTYPE_NAMES if name != "bfloat16"
}
# numpy dtype -> wire name, for the dtypes that need no conversion.
WIRE_NAMES: dict[np.dtype[Any], str] = {dt: name for name, dt in NP_DTYPES.items()}

Ext = msgspec.msgpack.Ext
meta_encode = msgspec.msgpack.Encoder().encode
# Inline data decodes into a bytearray: the private copy promised for small arrays.
array_meta_decode = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...], int | bytearray]).decode
image_meta_decode = msgspec.msgpack.Decoder(tuple[str, int, int, int | bytearray]).decode

#: dtype of a token-array ext code, else None; 256 entries (negative codes: None).
TOKEN_DTYPES: list[np.dtype[Any] | None] = [None] * 256
for _d, _name in enumerate(DTYPE_NAMES):
    if _name in NP_DTYPES:
        for _base in (INLINE, FRAME, REF):
            TOKEN_DTYPES[_base + _d] = NP_DTYPES[_name]
#: dtype -> inline ext code of token arrays.
INLINE_CODE = {dt: INLINE + DTYPE_NAMES.index(name) for dt, name in WIRE_NAMES.items()}
FRAME_REF = struct.Struct("<II")  # frame index, element count

#: ``REFS[code][k]``: the shared compact reference to frame ``k`` (made on first use),
#: so the encoder's hot path allocates nothing for it.
REFS: list[list[Any]] = [[None] * 256 for _ in range(INLINE + len(DTYPE_NAMES))]


def ref(code: int, k: int) -> Any:
    ref = REFS[code][k] = Ext(code + REF - INLINE, bytes((k,)))
    return ref


EMPTY = memoryview(b"")
BF16_STORAGE = np.dtype("<u2")
MAX_NDIM = 64  # numpy's own limit

# Bytes per pixel of the PIL modes carried as raw pixels; others convert first.
IMAGE_MODES = {
    **{"L": 1, "LA": 2, "I;16": 2, "RGB": 3, "YCbCr": 3},
    **{"RGBA": 4, "CMYK": 4, "I": 4, "F": 4},
}

# torch is optional and slow to import: its tables are built on first use.
torch_names: dict[Any, str] = {}  # torch.dtype -> wire name
torch_dtypes: dict[str, tuple[Any, int]] = {}  # wire name -> (torch.dtype, itemsize)


def torch_tables() -> None:
    import torch

    for name in DTYPE_NAMES:
        dt = getattr(torch, name, None)
        if name in ("uint16", "uint32", "uint64") or dt is None:  # lack most kernels
            continue
        torch_dtypes[name] = (dt, torch.empty((), dtype=dt).element_size())
        torch_names[dt] = name


def is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def is_pil_image(obj: Any) -> bool:
    pil = sys.modules.get("PIL.Image")
    return pil is not None and isinstance(obj, pil.Image)


def normalise_dtype(arr: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], str]:
    """Byte-swap ``arr`` or map an equal dtype to its wire name; EncodeError otherwise."""
    dt = arr.dtype
    if dt.byteorder == ">" and dt.newbyteorder("<") in WIRE_NAMES:
        arr = arr.astype(dt.newbyteorder("<"))
        return arr, WIRE_NAMES[arr.dtype]
    for known, name in WIRE_NAMES.items():
        if dt == known:  # equal dtypes that hash differently (with metadata) still map
            return arr.view(known), name
    raise EncodeError(
        f"unsupported array dtype {dt}; supported: {sorted(NP_DTYPES)} "
        "(and bfloat16 as a torch tensor)"
    )
