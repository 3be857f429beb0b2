""":class:`Encoder`: a message into frames ``[header, *buffers]`` (zero-copy and threads:
``docs/concepts.md``, "The codec")."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from fastio import _ext
from fastio.errors import EncodeError
from fastio.protocol import (
    DEFAULT_INLINE_THRESHOLD,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    TokenEncoding,
)
from fastio.tokens import TokenArray

__all__ = ["Encoder"]

_VERSIONS = range(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION + 1)
_WRITES = (TokenEncoding.TOKENS, TokenEncoding.COMPACT, TokenEncoding.REF)
#: Header prefixes ``93 <version> <n>`` of fewer than 128 buffers, by version.
_PREFIXES = {v: tuple(b"\x93" + bytes((v, n)) for n in range(128)) for v in _VERSIONS}


class _NeedsFrames(Exception):
    """An array met by the stateless encoder needs a frame of its own."""


class _NoFrames(list[Any]):
    def append(self, frame: Any) -> None:
        raise _NeedsFrames


_NO_FRAMES = _NoFrames([b""])


class Encoder:
    """Encodes fastio messages (and nested arrays, tensors, images) into frames.

    Parameters
    ----------
    inline_threshold:
        Arrays with fewer bytes than this travel inside the header; the others as their
        own zero-copy frame. ``0`` sends every array as a frame.
    version:
        The protocol version written in the header (``MIN_PROTOCOL_VERSION`` ..
        ``PROTOCOL_VERSION``): the version the reader speaks.
    tokens:
        How token arrays are written (:class:`~fastio.protocol.TokenEncoding`): by
        default ``REF`` at version 2, ``TOKENS`` at 1. :mod:`fastio.versions` picks both.

    Examples
    --------
    >>> import numpy as np
    >>> from fastio import Encoder, LLMResponse
    >>> enc = Encoder()
    >>> frames = enc.encode(LLMResponse(output_tokens=np.arange(4096, dtype=np.int32)))
    >>> len(frames)  # header + one buffer
    2
    """

    def __init__(
        self,
        *,
        inline_threshold: int = DEFAULT_INLINE_THRESHOLD,
        version: int = PROTOCOL_VERSION,
        tokens: TokenEncoding | None = None,
    ) -> None:
        if not isinstance(inline_threshold, int) or inline_threshold < 0:
            raise ValueError(f"inline_threshold must be an int >= 0, got {inline_threshold!r}")
        if version not in _VERSIONS:
            raise ValueError(
                f"version must be {MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}, got {version!r}"
            )
        if tokens is None:
            tokens = TokenEncoding.REF if version >= 2 else TokenEncoding.TOKENS
        if tokens not in _WRITES:
            raise ValueError(f"tokens must be one of {[t.name for t in _WRITES]}, got {tokens!r}")
        self._threshold = inline_threshold
        self._version = version
        self._tokens = TokenEncoding(tokens)
        self._idle: list[list[Any]] = []  # per-call states not in use
        # The hot path, a closure; the instance attribute shadows the method.
        self.encode = self._encode = self._make_encode()  # type: ignore[method-assign]

    @property
    def inline_threshold(self) -> int:
        """Arrays with fewer bytes travel inside the header (read-only)."""
        return self._threshold

    @property
    def version(self) -> int:
        """The protocol version written in every header (read-only)."""
        return self._version

    @property
    def tokens(self) -> TokenEncoding:
        """How token arrays are written (read-only)."""
        return self._tokens

    def encode(self, obj: Any) -> list[Any]:
        """Encode ``obj`` into ``[header, *buffers]``: ``bytes``, then the caller's memory
        (keep it unmodified until sent, e.g. ``send_multipart(frames, copy=False)``);
        :class:`~fastio.EncodeError` for what fastio cannot put on the wire."""
        return self._encode(obj)  # type: ignore[no-any-return]

    def _hook(self, state: list[Any]) -> Any:
        """The ``enc_hook`` of one msgspec encoder; ``state[1]``: its call's frame list."""
        threshold = self._threshold
        # TOKENS misses this table; COMPACT misses the 1-byte references (8-byte ones).
        codes = {} if self._tokens is TokenEncoding.TOKENS else _ext.INLINE_CODE
        refs = _ext.REFS if self._tokens is TokenEncoding.REF else [()] * len(_ext.REFS)
        ext, pack, make_ref = _ext.Ext, _ext.FRAME_REF.pack, _ext.ref
        other = self._enc_hook

        def hook(obj: Any) -> Any:
            if type(obj) is TokenArray:
                arr = obj._a
                code = codes.get(arr.dtype)
                if code is not None and arr.flags.c_contiguous:
                    if arr.nbytes < threshold:
                        return ext(code, arr)  # type: ignore[arg-type]  # a buffer
                    frames = state[1]
                    frames.append(arr)
                    k = len(frames) - 1
                    try:
                        ref = refs[code][k]
                    except IndexError:  # frame 256 and on, or COMPACT: the 8-byte reference
                        return ext(code + 16, pack(k, len(arr)))
                    return ref if ref is not None else make_ref(code, k)
            return other(obj, state[1], hook)

        return hook

    def _new_state(self) -> list[Any]:
        """A per-call state ``[encode, frames, buffer count of its last message]``."""
        state: list[Any] = [None, None, 0]
        state[0] = msgspec.msgpack.Encoder(enc_hook=self._hook(state)).encode
        return state

    def _make_encode(self) -> Any:
        pop, push, new_state = self._idle.pop, self._idle.append, self._new_state
        version = self._version
        prefixes = _PREFIXES[version]
        # The last message's buffer count (a guess shared by threads): 0 tries the
        # stateless encoder first, -1 says it failed last time.
        last = [0]
        stateless = msgspec.msgpack.Encoder(enc_hook=self._hook([None, _NO_FRAMES])).encode

        def encode(obj: Any) -> list[Any]:
            try:
                if not last[0]:  # every array inline: one stateless msgspec call
                    try:
                        return [stateless((version, 0, obj))]
                    except _NeedsFrames:
                        last[0] = -1
                try:
                    state = pop()
                except IndexError:  # every state is in use: other threads, a nested encode
                    state = new_state()
                frames: list[Any] = [b""]
                state[1] = frames
                guess = state[2]
                try:
                    # One call, the buffer count guessed (a stream's messages look
                    # alike); a wrong guess costs one copy of the header.
                    header = state[0]((version, guess, obj))
                finally:
                    state[1] = None
                    push(state)
            except EncodeError:
                raise
            except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
                raise EncodeError(f"cannot encode {type(obj).__name__}: {exc}") from exc
            n = len(frames) - 1
            if n != guess:  # the header starts 93 <version> <guess>, each one byte
                if n < 128:
                    header = prefixes[n] + header[3:]
                else:
                    header = b"\x93" + _ext.meta_encode(version) + _ext.meta_encode(n) + header[3:]
                state[2] = n if n < 128 else 1
            if last[0] != n:  # 0 turns the stateless path back on
                last[0] = n if n < 128 else 1
            frames[0] = header
            return frames

        return encode

    def _enc_hook(self, obj: Any, frames: list[Any], hook: Any) -> Any:
        if isinstance(obj, TokenArray):
            arr = obj._a
            if self._tokens is TokenEncoding.TOKENS:
                return self._array_ext(arr, _ext.EXT_TOKENS, frames)
            if arr.dtype not in _ext.INLINE_CODE:
                arr, _ = _ext.normalise_dtype(arr)
            # One copy of a strided view (the wire form is packed), then the fast path.
            return hook(TokenArray.wrap(np.ascontiguousarray(arr)))
        if isinstance(obj, np.ndarray):
            return self._array_ext(np.asarray(obj), _ext.EXT_NDARRAY, frames)
        if isinstance(obj, np.generic):
            return obj.item()
        if _ext.is_tensor(obj) or _ext.is_pil_image(obj):
            if frames is _NO_FRAMES:  # converted before the size is known
                raise _NeedsFrames
            code, meta, raw = _tensor(obj) if _ext.is_tensor(obj) else _image(obj)
            return _ext.Ext(code, _ext.meta_encode((*meta, self._slot(raw, frames))))
        name = getattr(obj, "name_or_path", None)
        if isinstance(name, str):  # tokenizers and processors: never live objects
            return name
        tp = type(obj)
        raise EncodeError(f"fastio cannot encode objects of type {tp.__module__}.{tp.__qualname__}")

    def _slot(self, arr: np.ndarray[Any, Any], frames: list[Any]) -> int | bytes:
        """Inline bytes for a small C-contiguous array, else the index of its frame."""
        nbytes = arr.nbytes
        if nbytes < self._threshold:
            return arr.tobytes()
        frames.append(memoryview(arr).cast("B") if nbytes else _ext.EMPTY)  # type: ignore[arg-type]
        return len(frames) - 1

    def _array_ext(
        self, arr: np.ndarray[Any, Any], code: int, frames: list[Any]
    ) -> msgspec.msgpack.Ext:
        name = _ext.WIRE_NAMES.get(arr.dtype)
        if name is None:
            arr, name = _ext.normalise_dtype(arr)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)  # one copy: the wire form is C order
        return _ext.Ext(code, _ext.meta_encode((name, arr.shape, self._slot(arr, frames))))


def _tensor(t: Any) -> tuple[int, tuple[Any, ...], np.ndarray[Any, Any]]:
    """A tensor's ext code, descriptor ``(dtype, shape)`` and bytes on the host."""
    import torch  # imported already: ``t`` is a tensor

    names, dtypes = _ext.torch_tables()
    name = names.get(t.dtype)
    if name is None:
        raise EncodeError(f"unsupported tensor dtype {t.dtype}; supported: {sorted(dtypes)}")
    # Device memory cannot be a frame: one copy through host memory. bfloat16 has no
    # numpy dtype: its bytes (view() needs >= 1 dim).
    t = t.detach().cpu().contiguous()
    data = t.numpy() if name in _ext.NP_DTYPES else t.reshape(-1).view(torch.uint8).numpy()
    return _ext.EXT_TENSOR, (name, tuple(t.shape)), data


def _image(img: Any) -> tuple[int, tuple[Any, ...], np.ndarray[Any, Any]]:
    """An image's ext code, descriptor ``(mode, width, height)`` and pixels."""
    if img.mode not in _ext.IMAGE_MODES:  # palette, bilevel: as decoded pixels
        if img.mode == "1":
            img = img.convert("L")
        elif img.mode == "P" and "transparency" not in img.info:
            img = img.convert("RGB")
        else:
            img = img.convert("RGBA" if img.mode in ("P", "PA", "La", "RGBa") else "RGB")
    data = np.frombuffer(img.tobytes(), np.uint8)  # PIL has no pixel buffer: one copy
    return _ext.EXT_IMAGE, (img.mode, *img.size), data
