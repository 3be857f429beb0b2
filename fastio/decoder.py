""":class:`Decoder`: frames ``[header, *buffers]`` into typed objects (zero-copy, trust and
threads: ``docs/concepts.md``, "The codec")."""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Sequence
from typing import Any, Literal, Union

import msgspec
import numpy as np

from fastio import _ext
from fastio._optional import install_hint
from fastio.errors import DecodeError
from fastio.protocol import DEFAULT_MAX_MESSAGE_SIZE, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION
from fastio.structs import message_types
from fastio.tokens import TokenArray

__all__ = ["Decoder"]

_VIEWS = (np.ndarray, memoryview)  # frames whose len() is not their size in bytes

#: The header's version as the decoders' msgspec types check it: any version read.
_VERSION: Any = Literal.__getitem__(tuple(range(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION + 1)))


class Decoder:
    """Decodes ``[header, *buffers]`` frames into typed objects.

    Parameters
    ----------
    type:
        The expected type; ``None``: any fastio message (:func:`~fastio.message_types`
        when the decoder is created).
    max_message_size:
        Larger frame totals raise :class:`~fastio.MessageTooLarge` before parsing.
    trusted:
        ``True`` skips the size limit: only for frames this program produced itself.
    device:
        Where decoded tensors go: ``None``/``"cpu"`` views the frame; e.g. ``"cuda:0"``
        copies onto that device.

    Examples
    --------
    >>> from fastio import Decoder, Encoder, LLMResponse
    >>> dec = Decoder(LLMResponse)
    >>> resp = dec.decode(Encoder().encode(LLMResponse(output_tokens=[1, 2])))
    >>> resp.output_tokens == [1, 2]
    True
    """

    def __init__(
        self,
        type: Any = None,
        *,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        device: Any = None,
        trusted: bool = False,
    ) -> None:
        if type is None:
            type = Union[message_types()]  # noqa: UP007
        self.type = type
        self.device = None if device is None or str(device) == "cpu" else device
        self._max_message_size = max_message_size
        self._trusted = bool(trusted)
        # Per-call states not in use; the first built here: a bad type fails now.
        self._idle: list[list[Any]] = [self._new_state()]
        # The hot path, a closure; the instance attribute shadows the method.
        self.decode = self._decode = self._make_decode()  # type: ignore[method-assign]

    @property
    def max_message_size(self) -> int:
        """The size limit of one message's frames, in bytes (not checked when trusted)."""
        return self._max_message_size

    @property
    def trusted(self) -> bool:
        """Whether the frames come from a trusted source (read-only)."""
        return self._trusted

    def decode(self, frames: Sequence[Any]) -> Any:
        """Decode a frame list (bytes, memoryview, bytearray or ``zmq.Frame`` items); bad
        input raises :class:`~fastio.DecodeError` (saying what is wrong), nothing else."""
        return self._decode(frames)

    def _msgspec_decoder(self, n_buffers: Any, state: list[Any]) -> Any:
        tp = self.type
        return msgspec.msgpack.Decoder(
            tuple[_VERSION, n_buffers, tp],  # type: ignore[valid-type]
            ext_hook=self._hook(state),
            dec_hook=_dec_hook,
        ).decode

    def _hook(self, state: list[Any]) -> Any:
        """The ``ext_hook`` of one msgspec decoder; ``state[0]``: its call's frame list."""
        dtypes, ref, frame, unpack = _ext.TOKEN_DTYPES, _ext.REF, _ext.FRAME, _ext.FRAME_REF.unpack
        frombuffer, wrap, other = np.frombuffer, TokenArray.wrap, self._ext_hook

        def ext_hook(code: int, payload: memoryview) -> Any:
            dtype = dtypes[code]
            if dtype is None:
                return other(code, payload, state[0])
            try:
                if code >= ref:  # in frame k, one byte: the frame is the array
                    (k,) = payload  # ValueError unless exactly one byte
                    if k:  # frame 0 is the header
                        return wrap(frombuffer(state[0][k], dtype))  # whole items or ValueError
                elif code < frame:  # inline: the payload is the elements
                    return wrap(frombuffer(payload, dtype))
                else:  # the 8-byte reference (frame index, element count)
                    k, count = unpack(payload)
                    if k:
                        arr = frombuffer(state[0][k], dtype)
                        if len(arr) == count:
                            return wrap(arr)
            except (ValueError, TypeError, IndexError, BufferError, struct.error):
                pass
            raise _ext.token_error(code, payload, state[0])

        return ext_hook

    def _new_state(self) -> list[Any]:
        """A per-call state ``[frames, decode]``."""
        state: list[Any] = [None, None]
        state[1] = self._msgspec_decoder(int, state)
        return state

    def _make_decode(self) -> Any:
        # One frame (all arrays inline): one stateless msgspec call.
        decode_one = self._msgspec_decoder(Literal[0], [(None,)])
        header_limit = sys.maxsize if self._trusted else self._max_message_size
        small_limit = min(header_limit, (1 << 30) - 1)
        limit = None if self._trusted else self._max_message_size
        pop, push, new_state = self._idle.pop, self._idle.append, self._new_state
        tp = self.type
        rejected = _ext.Rejected

        def decode(frames: Sequence[Any]) -> Any:
            try:
                count = len(frames)
                if count == 1:
                    header = frames[0]
                    size = len(header)
                    # Small ints compare on the interpreter's fast path.
                    if size > small_limit and size > header_limit:
                        raise rejected
                    return decode_one(header)[2]
                if count == 2:
                    f = frames[1]  # an encoder's array frame, in-process: len() counts items
                    size = len(frames[0]) + (f.nbytes if type(f) in _VIEWS else len(f))
                    if size > small_limit and size > header_limit:
                        raise rejected
                elif limit is not None:
                    total = 0
                    for f in frames:
                        total += f.nbytes if type(f) in _VIEWS else len(f)
                    if total > limit:
                        raise rejected
                try:
                    state = pop()
                except IndexError:  # all in use: other threads, a nested decode
                    state = new_state()
                state[0] = frames
                try:
                    msg = state[1](frames[0])
                finally:
                    state[0] = None
                    push(state)
                if msg[1] != count - 1:
                    raise rejected
                return msg[2]
            except Exception as exc:  # boundary: nothing else may escape for bad input
                raise _ext.diagnose(tp, limit, frames, exc) from exc

        return decode

    def _ext_hook(self, code: int, payload: memoryview, frames: Any) -> Any:
        if code == _ext.EXT_IMAGE:
            return self._image(payload, frames)
        if code not in (_ext.EXT_NDARRAY, _ext.EXT_TENSOR, _ext.EXT_TOKENS):
            raise DecodeError(
                f"unknown extension type code {code}; known: 1, 2, 3, 4, "
                "16-28, 32-44 and 48-60 (token arrays, but not bfloat16: 26, 42, 58)"
            )
        try:
            name, shape, slot = _ext.array_meta_decode(payload)
        except msgspec.DecodeError as exc:
            raise DecodeError(f"malformed array descriptor: {exc}") from exc
        if len(shape) > _ext.MAX_NDIM:
            raise DecodeError(f"array has {len(shape)} dimensions, at most {_ext.MAX_NDIM} allowed")
        if any(d < 0 for d in shape):
            raise DecodeError(f"negative dimension in array shape {list(shape)}")
        count = math.prod(shape)
        if code == _ext.EXT_TENSOR:
            return self._tensor(name, shape, count, slot, frames)
        dtype = _ext.NP_DTYPES.get(name)
        if dtype is None:
            raise DecodeError(
                f"unknown array dtype {name!r}; known: {sorted(_ext.NP_DTYPES)}"
                + (" (bfloat16 only as a tensor, ext code 2)" if name == "bfloat16" else "")
            )
        data = _data(slot, count * dtype.itemsize, lambda: f"array {name}{list(shape)}", frames)
        arr = np.frombuffer(data, dtype, count)
        if code == _ext.EXT_NDARRAY:
            return arr if len(shape) == 1 else arr.reshape(shape)
        if len(shape) != 1:
            raise DecodeError(f"token array must be 1-D, got shape {list(shape)}")
        return TokenArray.wrap(arr)

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
        dtypes = _ext.torch_tables()[1]
        entry = dtypes.get(name)
        if entry is None:
            raise DecodeError(f"unknown tensor dtype {name!r}; known: {sorted(dtypes)}")
        dtype, itemsize = entry
        data = _data(slot, count * itemsize, lambda: f"tensor {name}{list(shape)}", frames)
        if memoryview(data).readonly:
            # torch has no read-only tensors: a write would corrupt an immutable frame.
            data = bytearray(data)
        # Through numpy (cheaper than torch.frombuffer); bfloat16 as uint16 there.
        t = torch.from_numpy(
            np.frombuffer(data, _ext.NP_DTYPES.get(name, _ext.BF16_STORAGE), count).reshape(shape)
        )
        if dtype is not t.dtype:
            t = t.view(dtype)
        return t if self.device is None else t.to(self.device)

    def _image(self, payload: memoryview, frames: Any) -> Any:
        from PIL import Image

        try:
            mode, w, h, slot = _ext.image_meta_decode(payload)
        except msgspec.DecodeError as exc:
            raise DecodeError(f"malformed image descriptor: {exc}") from exc
        bpp = _ext.IMAGE_MODES.get(mode)
        if bpp is None:
            raise DecodeError(f"unsupported image mode {mode!r}; known: {sorted(_ext.IMAGE_MODES)}")
        if w < 0 or h < 0:
            raise DecodeError(f"invalid image size {w}x{h}")
        data = _data(slot, w * h * bpp, lambda: f"image {mode} {w}x{h}", frames)
        if w == 0 or h == 0:
            return Image.new(mode, (w, h))
        return Image.frombuffer(mode, (w, h), data, "raw", mode, 0, 1)


def _data(slot: int | bytearray, nbytes: int, what: Any, frames: Any) -> Any:
    """The bytes of frame ``slot`` or the inline bytearray; ``what()`` names it in errors."""
    if type(slot) is int:
        if not 0 < slot < len(frames):
            raise _ext.frame_error(what(), slot, frames)
        data: Any = frames[slot]
        got = data.nbytes if type(data) is memoryview else len(data)
    else:
        data = slot
        got = len(data)
    if got != nbytes:
        raise DecodeError(f"{what()} needs {nbytes} bytes of data, got {got}")
    return data


def _dec_hook(tp: Any, obj: Any) -> Any:
    if tp is TokenArray:
        if type(obj) is TokenArray:
            return obj
        if type(obj) is np.ndarray:
            if obj.ndim != 1:
                raise ValueError(f"token array must be 1-D, got shape {obj.shape}")
            return TokenArray.wrap(obj)
        if type(obj) is list:  # peers in other languages: plain arrays of numbers
            for x in obj:
                if type(x) is not int and type(x) is not float:
                    raise ValueError(f"token array must hold only numbers, got {type(x).__name__}")
            return TokenArray(obj)
        raise TypeError(f"expected an array, got {type(obj).__name__}")
    if isinstance(tp, type) and isinstance(obj, tp):
        return obj
    raise TypeError(f"expected {getattr(tp, '__name__', tp)}, got {type(obj).__name__}")
