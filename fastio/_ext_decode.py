"""How :class:`fastio.Decoder` reads numpy arrays, torch tensors, PIL images and token
arrays from extension values (all but the compact token-array hot path, which lives in
``Decoder._new_state``), and the ``dec_hook`` that turns arrays and lists into
``TokenArray`` fields."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import numpy as np

from fastio._ext import (
    _ARRAY_CODES,
    _BF16_STORAGE,
    _EXT_IMAGE,
    _EXT_NDARRAY,
    _EXT_TENSOR,
    _EXT_TOKENS,
    _IMAGE_MODES,
    _MAX_NDIM,
    _NP_DTYPES,
    _array_meta_decode,
    _image_meta,
    _torch_dtypes,
    _torch_tables,
)
from fastio._optional import install_hint
from fastio.errors import DecodeError
from fastio.tokens import TokenArray


class _ExtDecoderMixin:
    """The extension-value readers of :class:`fastio.Decoder` (its base class)."""

    device: Any

    # -- hooks -----------------------------------------------------------------------
    def _data(self, slot: int | bytearray, nbytes: int, what: Any, frames: Any) -> Any:
        """The bytes an extension value refers to; ``what()`` describes it for errors."""
        if type(slot) is int:
            if not 0 < slot < len(frames):
                raise DecodeError(
                    f"{what()} refers to frame {slot}, but the message has "
                    + (f"frames 1..{len(frames) - 1}" if len(frames) > 1 else "no buffer frames")
                )
            data: Any = frames[slot]
            got = data.nbytes if type(data) is memoryview else len(data)
        else:
            got = len(slot)  # type: ignore[arg-type]
            # Inline data: already a private writable copy (a bytearray from msgspec).
            data = slot
        if got != nbytes:
            raise DecodeError(f"{what()} needs {nbytes} bytes of data, got {got}")
        return data

    def _ext_hook(self, code: int, payload: memoryview, frames: Any) -> Any:
        """Extension values other than the compact token arrays (codes 1-4)."""
        if code in _ARRAY_CODES:
            try:
                name, shape, slot = _array_meta_decode(payload)
            except msgspec.DecodeError as exc:
                raise DecodeError(f"malformed array descriptor: {exc}") from exc
            if len(shape) == 1 and code != _EXT_TENSOR:
                # Fast path, every token array: a valid 1-D array, in its own frame (large)
                # or inline in the header (small: ``slot`` is already a private bytearray).
                np_dtype = _NP_DTYPES.get(name)
                count = shape[0]
                if np_dtype is not None and count >= 0:
                    data: Any = slot
                    if type(slot) is int:
                        data = frames[slot] if 0 < slot < len(frames) else None
                        size = (
                            -1
                            if data is None
                            else data.nbytes
                            if type(data) is memoryview
                            else len(data)
                        )
                    else:
                        size = len(slot)  # type: ignore[arg-type]
                    if size == count * np_dtype.itemsize:
                        arr = np.frombuffer(data, np_dtype, count)
                        if code == _EXT_NDARRAY:
                            return arr
                        return TokenArray._wrap(arr)
            arr = self._array(code, name, shape, slot, frames)
            if code != _EXT_TOKENS:
                return arr
            if arr.ndim != 1:
                raise DecodeError(f"token array must be 1-D, got shape {list(arr.shape)}")
            return TokenArray._wrap(arr)
        if code == _EXT_IMAGE:
            return self._image(payload, frames)
        raise DecodeError(
            f"unknown extension type code {code}; known: 1, 2, 3, 4, "
            "16-28, 32-44 and 48-60 (token arrays, but not bfloat16: 26, 42, 58)"
        )

    def _array(
        self, code: int, name: str, shape: tuple[int, ...], slot: int | bytearray, frames: Any
    ) -> Any:
        """Checks and builds any array or tensor (the fast path's fallback)."""
        if len(shape) > _MAX_NDIM:
            raise DecodeError(f"array has {len(shape)} dimensions, at most {_MAX_NDIM} allowed")
        for d in shape:
            if d < 0:
                raise DecodeError(f"negative dimension in array shape {list(shape)}")
        count = math.prod(shape)
        if code == _EXT_TENSOR:
            return self._tensor(name, shape, count, slot, frames)
        dtype = _NP_DTYPES.get(name)
        if dtype is None:
            raise DecodeError(
                f"unknown array dtype {name!r}; known: {sorted(_NP_DTYPES)}"
                + (" (bfloat16 only as a tensor, ext code 2)" if name == "bfloat16" else "")
            )
        data = self._data(
            slot, count * dtype.itemsize, lambda: f"array {name}{list(shape)}", frames
        )
        arr = np.frombuffer(data, dtype, count)
        return arr if len(shape) == 1 else arr.reshape(shape)

    def _tensor(
        self, name: str, shape: tuple[int, ...], count: int, slot: int | bytearray, frames: Any
    ) -> Any:
        try:
            import torch
        except ImportError as exc:
            raise DecodeError(
                f"a torch tensor {name}{list(shape)} arrived and torch is not installed: "
                f"{install_hint('torch')}"
            ) from exc
        if not _torch_dtypes:
            _torch_tables()
        entry = _torch_dtypes.get(name)
        if entry is None:
            raise DecodeError(f"unknown tensor dtype {name!r}; known: {sorted(_torch_dtypes)}")
        dtype, itemsize = entry
        data = self._data(slot, count * itemsize, lambda: f"tensor {name}{list(shape)}", frames)
        if memoryview(data).readonly:
            data = bytearray(data)  # see the module docstring: torch cannot be read-only
        # Through numpy: cheaper per call than torch.frombuffer + reshape. bfloat16
        # is viewed as uint16 there and reinterpreted by torch.
        np_dtype = _NP_DTYPES.get(name, _BF16_STORAGE)
        t = torch.from_numpy(np.frombuffer(data, np_dtype, count).reshape(shape))
        if dtype is not t.dtype:
            t = t.view(dtype)
        if self.device is not None:
            t = t.to(self.device)
        return t

    def _image(self, payload: memoryview, frames: Any) -> Any:
        from PIL import Image

        try:
            mode, w, h, slot = _image_meta.decode(payload)
        except msgspec.DecodeError as exc:
            raise DecodeError(f"malformed image descriptor: {exc}") from exc
        bpp = _IMAGE_MODES.get(mode)
        if bpp is None:
            raise DecodeError(f"unsupported image mode {mode!r}; known: {sorted(_IMAGE_MODES)}")
        if w < 0 or h < 0:
            raise DecodeError(f"invalid image size {w}x{h}")
        data = self._data(slot, w * h * bpp, lambda: f"image {mode} {w}x{h}", frames)
        if w == 0 or h == 0:
            return Image.new(mode, (w, h))
        return Image.frombuffer(mode, (w, h), data, "raw", mode, 0, 1)


def _dec_hook(tp: Any, obj: Any) -> Any:
    if tp is TokenArray:
        if type(obj) is TokenArray:
            return obj
        if type(obj) is np.ndarray:
            if obj.ndim != 1:
                raise ValueError(f"token array must be 1-D, got shape {obj.shape}")
            return TokenArray._wrap(obj)
        if type(obj) is list:
            # Peers in other languages may send plain msgpack arrays of numbers.
            for x in obj:
                if type(x) is not int and type(x) is not float:
                    raise ValueError(f"token array must hold only numbers, got {type(x).__name__}")
            return TokenArray(obj)
        raise TypeError(f"expected an array, got {type(obj).__name__}")
    if isinstance(tp, type) and isinstance(obj, tp):
        return obj
    raise TypeError(f"expected {getattr(tp, '__name__', tp)}, got {type(obj).__name__}")
