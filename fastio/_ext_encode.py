"""How :class:`fastio.Encoder` writes numpy arrays, torch tensors, PIL images and token
arrays as extension values (all but the inlined token-array hot path, which lives in
``Encoder._new_state``)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from fastio._ext import (
    _EMPTY,
    _EXT_IMAGE,
    _EXT_NDARRAY,
    _EXT_TENSOR,
    _EXT_TOKENS,
    _FRAME_REF,
    _IMAGE_MODES,
    _INLINE_CODE,
    _NP_DTYPES,
    _REFS,
    _WIRE_NAMES,
    _Ext,
    _is_pil_image,
    _is_tensor,
    _meta_encode,
    _normalise_dtype,
    _ref,
    _torch_dtypes,
    _torch_names,
    _torch_tables,
)
from fastio.errors import EncodeError
from fastio.protocol import TokenEncoding
from fastio.tokens import TokenArray


class _ExtEncoderMixin:
    """The extension-value writers of :class:`fastio.Encoder` (its base class)."""

    _threshold: int
    _tokens: TokenEncoding

    # -- hooks -----------------------------------------------------------------------
    def _enc_hook(self, obj: Any, frames: list[Any]) -> Any:
        """Everything but the hot path: other arrays, tensors, images, live objects."""
        tp = type(obj)
        if tp is TokenArray:
            return self._tokens_ext(obj._a, frames)
        if tp is np.ndarray:
            return self._array_ext(obj, _EXT_NDARRAY, frames)
        if isinstance(obj, TokenArray):
            return self._tokens_ext(obj._a, frames)
        if isinstance(obj, np.ndarray):
            return self._array_ext(np.asarray(obj), _EXT_NDARRAY, frames)
        if isinstance(obj, np.generic):
            return obj.item()
        if _is_tensor(obj):
            return self._tensor_ext(obj, frames)
        if _is_pil_image(obj):
            return self._image_ext(obj, frames)
        name = getattr(obj, "name_or_path", None)
        if isinstance(name, str):
            # Tokenizers and processors (SaveLoadMeta) never travel as live objects:
            # they travel as the name/path the receiver loads them from.
            return name
        raise EncodeError(f"fastio cannot encode objects of type {tp.__module__}.{tp.__qualname__}")

    def _tokens_ext(self, arr: np.ndarray[Any, Any], frames: list[Any]) -> msgspec.msgpack.Ext:
        """Slow path of token arrays: a dtype to normalise or a strided view, and the
        older token encodings (ext 4, and 32 + d for every frame) for older peers."""
        tokens = self._tokens
        if tokens is TokenEncoding.TOKENS:
            return self._array_ext(arr, _EXT_TOKENS, frames)
        if arr.dtype not in _INLINE_CODE:
            arr, _ = _normalise_dtype(arr)
        arr = np.ascontiguousarray(arr)  # one copy: the wire form is packed
        code = _INLINE_CODE[arr.dtype]
        if arr.nbytes < self._threshold:
            return _Ext(code, arr.tobytes())
        frames.append(arr.data.cast("B"))
        k = len(frames) - 1
        if k > 255 or tokens is TokenEncoding.COMPACT:
            # The 8-byte reference (frame index, element count); the compact one holds
            # the index in one byte.
            return _Ext(code + 16, _FRAME_REF.pack(k, arr.shape[0]))
        return _REFS[code][k] or _ref(code, k)  # type: ignore[no-any-return]

    def _slot(self, arr: np.ndarray[Any, Any], frames: list[Any]) -> int | bytes:
        """Inline bytes for a small C-contiguous array, else the index of its frame."""
        nbytes = arr.nbytes
        if nbytes < self._threshold:
            return arr.tobytes()
        # 1-D unsigned-byte views so that len(frame) is its size in bytes.
        frames.append(memoryview(arr).cast("B") if nbytes else _EMPTY)  # type: ignore[arg-type]
        return len(frames) - 1

    def _array_ext(
        self, arr: np.ndarray[Any, Any], code: int, frames: list[Any]
    ) -> msgspec.msgpack.Ext:
        name = _WIRE_NAMES.get(arr.dtype)
        if name is None:
            arr, name = _normalise_dtype(arr)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)  # one copy: the wire form is C order
        # _slot inlined: this is the per-array hot path of every message.
        nbytes = arr.nbytes
        if nbytes < self._threshold:
            return _Ext(code, _meta_encode((name, arr.shape, arr.tobytes())))
        frames.append(memoryview(arr).cast("B") if nbytes else _EMPTY)  # type: ignore[arg-type]
        return _Ext(code, _meta_encode((name, arr.shape, len(frames) - 1)))

    def _tensor_ext(self, t: Any, frames: list[Any]) -> msgspec.msgpack.Ext:
        if not _torch_names:
            _torch_tables()
        name = _torch_names.get(t.dtype)
        if name is None:
            raise EncodeError(
                f"unsupported tensor dtype {t.dtype}; supported: {sorted(_torch_dtypes)}"
            )
        if t.requires_grad:
            t = t.detach()
        if not t.is_cpu:
            # Device memory cannot be a frame: one copy through host memory.
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        shape = tuple(t.shape)
        if name in _NP_DTYPES:
            raw = t.numpy()
        else:
            # bfloat16 has no numpy dtype: ship its bytes. view() needs >= 1 dim.
            import torch

            raw = t.reshape(-1).view(torch.uint8).numpy()
        return _Ext(_EXT_TENSOR, _meta_encode((name, shape, self._slot(raw, frames))))

    def _image_ext(self, img: Any, frames: list[Any]) -> msgspec.msgpack.Ext:
        if img.mode not in _IMAGE_MODES:
            # Palette and bilevel images travel as their decoded pixels.
            if img.mode == "1":
                img = img.convert("L")
            elif img.mode == "P" and "transparency" not in img.info:
                img = img.convert("RGB")
            else:
                img = img.convert("RGBA" if img.mode in ("P", "PA", "La", "RGBa") else "RGB")
        # PIL exposes no buffer of its pixels: one copy, on the encode side only.
        data = np.frombuffer(img.tobytes(), np.uint8)
        w, h = img.size
        return _Ext(_EXT_IMAGE, _meta_encode((img.mode, w, h, self._slot(data, frames))))
