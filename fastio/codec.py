"""Multi-frame msgpack codec: a message becomes ``[header, *buffers]`` and back.

The header is plain msgpack: ``[protocol_version, n_buffers, body]``. ``body`` is the
object, with numpy arrays, torch tensors, ``TokenArray`` and PIL images written as
msgpack extension values (:class:`~fastio.protocol.ExtCode`). An array of at least
``inline_threshold`` bytes is not copied into the header: its extension value names a
frame index and the array's own memory is that frame. ``docs/PROTOCOL.md`` is the full
specification.

Zero-copy contract
------------------
*Encoding*: the buffer frames returned by :meth:`Encoder.encode` are the caller's memory,
not copies: a token array's frame is its numpy array itself (no memoryview is made on
the hot path), any other array's or tensor's a 1-D byte memoryview. Every frame has the
buffer protocol; ``memoryview(frame).nbytes`` is its size in bytes. Do not mutate those arrays until the send has completed (pyzmq:
``send_multipart(frames, copy=False, track=True)`` and wait on the tracker).
``TokenArray.append``/``extend`` never write into the part of memory already encoded.
Copies happen only where the wire form differs from the memory: non-contiguous or
big-endian arrays, CUDA tensors (through host memory) and PIL images (no buffer API).

*Decoding*: decoded arrays are views of the received frames, no copies. They stay valid
as long as the array lives (it keeps the frame alive). They are writable when the frame
is writable (``zmq.Frame``, ``bytearray``), read-only when it is ``bytes``. Token arrays
below the inline threshold travel inside the header and decode as views of it too;
other arrays below it decode as small private (writable) copies. ``TokenArray`` growth
and item assignment never write into a received frame (they copy first). Torch tensors
over a read-only frame are copied, because torch has no read-only tensors and a write
would corrupt an immutable ``bytes`` object.

Token arrays travel in compact extension codes whose code is the dtype (protocol
version 2, the default), or as ext 4 from ``Encoder(version=1)`` for peers of version 1
(:mod:`fastio.versions` picks per peer): ``docs/PROTOCOL.md``, "Extension types" and
"Versions".

Trust
-----
A :class:`Decoder` validates where data enters, in one pass. msgspec checks every
typed field and its constraints (sampling parameters, stop reasons) during the decode
itself, in C; the types' ``__post_init__`` checks what msgspec cannot type (token
fields are ``Any`` to it, for speed: one type and one kind check each). The Python
checks of construction (``GenerationHyperparameters(...)``) never run on decode.

``Decoder(trusted=False)``, the default and the only right choice for anything read
from a socket, also checks the frame list: that together the frames stay under
``max_message_size`` (a message of one frame: its length; of two: two ``len()``;
more: one pass), before parsing. The frames the header refers to must be bytes-like (the
parse checks them). ``len()`` is the size in bytes of what a socket delivers (``bytes``,
``zmq.Frame``) and of bytes-like frames; an :class:`Encoder`'s token-array frames are
numpy arrays, whose ``len()`` counts elements, so frames passed straight from an
encoder to a decoder in one process are held to a limit up to 8 times looser (they are
this program's own frames).
``trusted=True`` skips the size limit for frames this program produced itself (a
queue between its own threads, a file it wrote); every other check stays. The frame
count the header announces is checked either way (for one or two frames msgspec
checks it, as part of the header's type).

Threads
-------
Per-call state (the list of buffers being built, the frames being read) is never kept
on the instance between calls, so one ``Encoder``/``Decoder`` may be shared by threads
and used re-entrantly. Messages of one frame need none: they go through one stateless
msgspec encoder/decoder (msgspec keeps its own per-call state on the C stack).
Messages with buffer frames take a per-call state (a msgspec encoder or decoder whose
hook reads that call's frame list) from a list of idle ones, with ``list.pop`` and
``list.append`` (atomic), and make a new one when every state is in use.

Where the code lives
--------------------
This module holds :class:`Encoder` and :class:`Decoder` (their per-call hot paths),
:func:`encode`, :func:`decode` and :func:`message_types`. The rest, by concern:

- ``fastio._ext``: dtype and extension-code tables, torch/PIL detection;
- ``fastio._ext_encode`` / ``fastio._ext_decode``: how arrays, tensors, images and token
  arrays become extension values and back (base classes of ``Encoder``/``Decoder``);
- ``fastio._header``: header prefixes, frame byte views, the general header parse;
- ``fastio._decode_errors``: error messages for rejected messages, with field paths;
- ``fastio.jsonhook``: :func:`enc_hook` for msgspec's JSON encoder and ``to_builtins``.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from typing import Any, Literal, Union

import msgspec
import numpy as np

from fastio import io_struct as _s
from fastio._decode_errors import _body_error, _Rejected, _token_error
from fastio._ext import (
    _FRAME_BY_CODE,
    _FRAME_REF,
    _INLINE_BY_CODE,
    _INLINE_CODE,
    _REF_BY_CODE,
    _REFS,
    _TOKEN_CODES,
    _Ext,
    _is_pil_image,
    _is_tensor,
    _ref,
)
from fastio._ext_decode import _dec_hook, _ExtDecoderMixin
from fastio._ext_encode import _ExtEncoderMixin
from fastio._header import (
    _READ_VERSIONS,
    _SMALL_PREFIXES,
    _buffer,
    _header_prefix,
    _parse_header,
    _unsupported,
)
from fastio.errors import DecodeError, EncodeError, FrameError, MessageTooLarge
from fastio.jsonhook import enc_hook
from fastio.protocol import (
    DEFAULT_INLINE_THRESHOLD,
    DEFAULT_MAX_MESSAGE_SIZE,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    TokenEncoding,
)
from fastio.tokens import TokenArray

__all__ = [
    "MESSAGE_TYPES",
    "Decoder",
    "Encoder",
    "Frame",
    "Message",
    "decode",
    "enc_hook",
    "encode",
    "message_types",
]

#: The seed's message types (each a tagged :class:`~fastio.WireStruct`).
MESSAGE_TYPES: tuple[type[_s.WireStruct], ...] = (
    _s.GenerationHyperparameters,
    _s.LLMRequest,
    _s.LLMResponse,
    _s.VLMRequest,
    _s.VLMResponse,
    _s.FinetuneSpec,
    _s.AllocationMode,
    _s.ParamSpec,
    _s.WeightUpdateMeta,
    _s.SaverConfig,
    _s.SaveLoadMeta,
    _s.RolloutStat,
)
#: Static type of a decoded seed message.
Message = Union[MESSAGE_TYPES]  # type: ignore[valid-type]  # noqa: UP007

#: Anything the decoder accepts as one frame: bytes-like objects or ``zmq.Frame``.
Frame = Any

_new_object = object.__new__

#: The header's version as the decoders' msgspec types check it: any version read.
_VERSION_TYPE: Any = Literal.__getitem__(_READ_VERSIONS)
#: The token encodings an Encoder can write.
_WRITES = (TokenEncoding.TOKENS, TokenEncoding.COMPACT, TokenEncoding.REF)


class _NeedsFrames(Exception):
    """Raised by the stateless encoder for an array that needs a frame of its own."""


class _NoFrames(list[Any]):
    """The frame list of the stateless encoder: adding a frame raises."""

    def append(self, frame: Any) -> None:
        raise _NeedsFrames


_NO_FRAMES = _NoFrames([b""])


class Encoder(_ExtEncoderMixin):
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
        How token arrays are written, one :class:`~fastio.protocol.TokenEncoding`: by
        default ``REF`` at version 2 and ``TOKENS`` (ext 4, which every version-1 reader
        reads) at version 1. :mod:`fastio.versions` picks both for a peer from what it
        states it reads.

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
        if version not in _READ_VERSIONS:
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
        # Idle per-call states (see "Threads" in the module docstring): a call pops one,
        # or makes one when none is idle, and puts it back when done.
        self._idle: list[list[Any]] = []
        # The hot path, a closure over the encoder's state, called directly by
        # ``enc.encode(obj)`` (the instance attribute shadows the method).
        self.encode = self._encode = self._hot_encode()  # type: ignore[method-assign]

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

    def _new_state(self) -> list[Any]:
        """A per-call state ``[encode, frames, n_guess]``: a msgspec encoder whose hook
        appends buffers to ``frames``, the frame list of the call that holds the state,
        and the buffer count of the last message this state encoded."""
        state: list[Any] = [None, None, 0]
        threshold = self._threshold
        inline_code = _INLINE_CODE
        ext = _Ext
        pack = _FRAME_REF.pack
        refs = _REFS
        make_ref = _ref
        other = self._enc_hook
        if self._tokens is not TokenEncoding.REF:
            # Older forms, for older peers: the general path (_tokens_ext) writes them.
            state[0] = msgspec.msgpack.Encoder(enc_hook=lambda obj: other(obj, state[1])).encode
            return state

        def hook(obj: Any) -> Any:
            # The hot path, every token array of every message, inlined. The array
            # itself is the payload (inline) or the frame: no memoryview to make.
            if type(obj) is TokenArray:
                arr = obj._a
                code = inline_code.get(arr.dtype)
                if code is not None and arr.flags.c_contiguous:
                    if arr.nbytes < threshold:
                        # The elements are the payload: msgspec copies them into
                        # the header.
                        return ext(code, arr)  # type: ignore[arg-type]  # a buffer
                    frames = state[1]
                    frames.append(arr)
                    k = len(frames) - 1
                    try:
                        ref = refs[code][k]  # shared, made once (see fastio._ext._REFS)
                    except IndexError:  # frame 256 and on: the 8-byte reference
                        return ext(code + 16, pack(k, len(arr)))
                    return ref if ref is not None else make_ref(code, k)
            return other(obj, state[1])

        state[0] = msgspec.msgpack.Encoder(enc_hook=hook).encode
        return state

    def _hot_encode(self) -> Any:
        pop = self._idle.pop
        push = self._idle.append
        new_state = self._new_state
        version = self._version
        prefixes = _SMALL_PREFIXES[version]
        # The buffer count of the last message, shared by the threads (a guess): 0
        # means try the stateless encoder first, -1 that it failed last time.
        last = [0]
        stateless = msgspec.msgpack.Encoder(enc_hook=self._inline_hook()).encode

        def encode(obj: Any) -> list[Any]:
            if not last[0]:
                # Every array inline (every small message): one stateless msgspec call,
                # no per-call state. An array that needs a frame of its own stops it.
                try:
                    return [stateless((version, 0, obj))]
                except _NeedsFrames:
                    last[0] = -1
                except EncodeError:
                    raise
                except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
                    raise EncodeError(f"cannot encode {type(obj).__name__}: {exc}") from exc
            try:
                state = pop()
            except IndexError:  # every state is in use: other threads, a nested encode
                state = new_state()
            frames: list[Any] = [b""]
            state[1] = frames
            guess = state[2]
            try:
                # The whole header in one msgspec call, its buffer count guessed: the
                # count of this state's last message (messages of one stream look
                # alike). A wrong guess costs one copy of the header, to fix the count.
                header = state[0]((version, guess, obj))
            except EncodeError:
                raise
            except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
                raise EncodeError(f"cannot encode {type(obj).__name__}: {exc}") from exc
            finally:
                state[1] = None
                push(state)
            n = len(frames) - 1
            if n != guess:
                # A guess is below 128, one byte: the header starts 93 <version> <guess>.
                header = (prefixes[n] if n < 128 else _header_prefix(n, version)) + header[3:]
                # (The state may be in use again by now: these are guesses.)
                state[2] = n if n < 128 else 1
            if last[0] != n:
                # Also when the guess was right: a message that took this path and
                # needed no frame after all (a small tensor) turns the stateless path
                # back on for the next.
                last[0] = n if n < 128 else 1
            frames[0] = header
            return frames

        return encode

    def _inline_hook(self) -> Any:
        """The hook of the stateless encoder: arrays inline, or :class:`_NeedsFrames`."""
        threshold = self._threshold
        inline_code = _INLINE_CODE if self._tokens is TokenEncoding.REF else {}
        ext = _Ext
        other = self._enc_hook

        def hook(obj: Any) -> Any:
            # (Other token encodings miss inline_code: _tokens_ext writes them.)
            if type(obj) is TokenArray:
                arr = obj._a
                code = inline_code.get(arr.dtype)
                if code is not None and arr.nbytes < threshold and arr.flags.c_contiguous:
                    return ext(code, arr)  # type: ignore[arg-type]  # a buffer
            elif _is_tensor(obj) or _is_pil_image(obj):
                # They are converted (device to host, pixels) before the size is known.
                raise _NeedsFrames
            return other(obj, _NO_FRAMES)

        return hook

    def encode(self, obj: Any) -> list[Any]:
        """Encode ``obj`` into ``[header, *buffers]``.

        The header is ``bytes``; buffers are the caller's memory: a token array's numpy
        array itself, 1-D byte memoryviews of other arrays and tensors (see the module
        docstring for how long they must stay unmodified; ``memoryview(f).nbytes`` is a
        frame's size). Send them with ``socket.send_multipart(frames, copy=False)``.

        Raises
        ------
        EncodeError
            For objects fastio cannot put on the wire (unsupported types or dtypes).
        """
        return self._encode(obj)  # type: ignore[no-any-return]


class Decoder(_ExtDecoderMixin):
    """Decodes ``[header, *buffers]`` frames into typed objects.

    Parameters
    ----------
    type:
        The expected type. ``None`` accepts any fastio message: a tagged union of every
        :class:`~fastio.WireStruct` subclass with an integer tag defined when the
        decoder is created (the seed types and those of ``fastio.fabric_msgs`` and
        ``fastio.weight_msgs``).
    max_message_size:
        Frames adding up to more bytes raise :class:`~fastio.MessageTooLarge` before
        anything is parsed (sizes by ``len()``: bytes for bytes-like frames and what a
        socket delivers; see "Trust" in the module docstring).
    trusted:
        ``True`` skips the checks of the frame list before parsing (see "Trust" in the
        module docstring); only for frames this program produced itself. Anything read
        from a socket is untrusted, the default.
    device:
        Where decoded torch tensors go: ``None``/``"cpu"`` views the frame without a
        copy; e.g. ``"cuda:0"`` copies onto that device.

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
            types = message_types()
            type = Union[types]  # noqa: UP007
        self.type = type
        self.device = None if device is None or str(device) == "cpu" else device
        self._max_message_size = max_message_size
        self._trusted = bool(trusted)
        # The size limit the decode checks, None when trusted (one attribute read).
        self._limit = None if trusted else max_message_size
        # A header alone: the size limit is its own length (no frame-list pass).
        self._header_limit = sys.maxsize if trusted else max_message_size
        # Messages of one frame (every message whose arrays are all inline) decode with
        # one stateless msgspec call: the header's version and buffer count (0) are part
        # of the type, and nothing refers to a buffer frame.
        self._decode_one = msgspec.msgpack.Decoder(
            tuple[_VERSION_TYPE, Literal[0], type],  # type: ignore[valid-type]
            ext_hook=self._header_only_hook(),
            dec_hook=_dec_hook,
        ).decode
        # Idle per-call states of messages with buffer frames (see "Threads" in the
        # module docstring). The first is built here so that a type msgspec cannot
        # decode fails at construction.
        self._idle: list[list[Any]] = [self._new_state()]
        # The hot path, a closure over the decoder's state, called directly by
        # ``dec.decode(frames)`` (the instance attribute shadows the method).
        self.decode = self._decode = self._hot_decode()  # type: ignore[method-assign]

    @property
    def max_message_size(self) -> int:
        """The size limit of one message's frames, in bytes (not checked when trusted)."""
        return self._max_message_size

    @property
    def trusted(self) -> bool:
        """Whether the frames come from a trusted source (see "Trust" in the module
        docstring); read-only."""
        return self._trusted

    def _header_only_hook(self) -> Any:
        """The ext hook of one-frame messages: inline token arrays on the fast path;
        a reference to a buffer frame is an error (there are none)."""
        inline = _INLINE_BY_CODE
        frombuffer = np.frombuffer
        new = _new_object
        other = self._ext_hook
        no_buffers = (None,)

        def ext_hook(code: int, payload: memoryview) -> Any:
            dtype = inline[code]
            if dtype is not None:
                try:
                    arr = frombuffer(payload, dtype)  # ValueError unless whole items
                except ValueError:
                    raise _token_error(code, payload, no_buffers) from None
                tokens = new(TokenArray)  # TokenArray._wrap, inlined; _buf, _excl unset
                tokens._a = arr
                return tokens
            if code in _TOKEN_CODES:  # a token array in a buffer frame: there is none
                raise _token_error(code, payload, no_buffers)
            return other(code, payload, no_buffers)

        return ext_hook

    def _new_state(self) -> list[Any]:
        """A per-call state ``[frames, decode, decode_two]``: msgspec decoders whose ext
        hook reads buffer frames from ``frames``, the frame list of the call that holds
        the state; ``decode_two`` is for messages of exactly two frames (its type says
        one buffer, so msgspec checks the count)."""
        state: list[Any] = [None, None, None]
        # dtype by ext code, None for other codes (list subscripts: see fastio._ext).
        frame_dtypes = _FRAME_BY_CODE
        ref_dtypes = _REF_BY_CODE
        inline = _INLINE_BY_CODE
        frombuffer = np.frombuffer
        unpack = _FRAME_REF.unpack
        new = _new_object
        other = self._ext_hook

        def ext_hook(code: int, payload: memoryview) -> Any:
            dtype = ref_dtypes[code]
            if dtype is not None:
                # A token array in frame k (one byte): the frame is the array.
                # Malformed values fall through to the error below (try is free).
                try:
                    (k,) = payload  # ValueError unless exactly one byte
                    if k:  # frame 0 is the header
                        tokens = new(TokenArray)  # TokenArray._wrap, inlined
                        tokens._a = frombuffer(state[0][k], dtype)  # ValueError unless whole items
                        return tokens
                except (ValueError, TypeError, IndexError, BufferError):
                    pass
                raise _token_error(code, payload, state[0])
            dtype = inline[code]
            if dtype is not None:
                try:
                    arr = frombuffer(payload, dtype)
                except ValueError:
                    raise _token_error(code, payload, state[0]) from None
                tokens = new(TokenArray)
                tokens._a = arr
                return tokens
            dtype = frame_dtypes[code]
            if dtype is not None:
                # The 8-byte reference (frame index, element count): frames from 256 on.
                try:
                    k, count = unpack(payload)
                    if k:
                        arr = frombuffer(state[0][k], dtype)
                        if len(arr) == count:
                            tokens = new(TokenArray)
                            tokens._a = arr
                            return tokens
                except (ValueError, TypeError, IndexError, BufferError, struct.error):
                    pass
                raise _token_error(code, payload, state[0])
            return other(code, payload, state[0])

        tp = self.type
        state[1] = msgspec.msgpack.Decoder(
            tuple[_VERSION_TYPE, int, tp],  # type: ignore[valid-type]
            ext_hook=ext_hook,
            dec_hook=_dec_hook,
        ).decode
        state[2] = msgspec.msgpack.Decoder(
            tuple[_VERSION_TYPE, Literal[1], tp],  # type: ignore[valid-type]
            ext_hook=ext_hook,
            dec_hook=_dec_hook,
        ).decode
        return state

    def _hot_decode(self) -> Any:
        decode_one = self._decode_one
        header_limit = self._header_limit
        small_limit = min(header_limit, (1 << 30) - 1)
        limit = self._limit
        pop = self._idle.pop
        push = self._idle.append
        new_state = self._new_state
        diagnose = self._diagnose
        rejected = _Rejected

        def decode(frames: Sequence[Frame]) -> Any:
            try:
                count = len(frames)
                if count == 1:
                    # Every message whose arrays are all inline: one stateless call.
                    header = frames[0]
                    size = len(header)
                    # Two compares: the first between small ints (the common case, the
                    # interpreter's fast path), the second only for big messages.
                    if size > small_limit and size > header_limit:
                        raise rejected
                    return decode_one(header)[2]
                if count == 2:
                    # One buffer frame: the sizes are two len() (the header limit is
                    # the frame limit, or sys.maxsize when trusted).
                    size = len(frames[0]) + len(frames[1])
                    if size > small_limit and size > header_limit:
                        raise rejected
                    try:
                        state = pop()
                    except IndexError:  # all in use: other threads, a nested decode
                        state = new_state()
                    state[0] = frames
                    try:
                        return state[2](frames[0])[2]
                    finally:
                        state[0] = None
                        push(state)
                if limit is not None:
                    # Frames stay as they are: np.frombuffer reads any of them directly.
                    # len() is the size in bytes of bytes, bytearray, zmq.Frame and byte
                    # memoryviews.
                    total = 0
                    for f in frames:
                        total += len(f)
                    if total > limit:
                        raise rejected
                try:
                    state = pop()
                except IndexError:
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
                # Everything about a bad message, in the order a reader checks it, is
                # worked out here, off the hot path.
                raise diagnose(frames, exc) from exc

        return decode

    def decode(self, frames: Sequence[Frame]) -> Any:
        """Decode a frame list (bytes, memoryview, bytearray or ``zmq.Frame`` items).

        Raises
        ------
        DecodeError
            Saying what is wrong with the frames (for a value that breaks a field's
            constraint: the field's path and the rule); never any other exception for
            bad input.
        """
        return self._decode(frames)

    def _diagnose(self, frames: Any, exc: Exception) -> DecodeError:
        """The error for frames that failed to decode, checked in the order of the
        protocol: the frame list, each frame, the size limit, the header, the frame
        count, then the body's own error."""
        tf = type(frames)
        if (tf is not list and tf is not tuple) or not frames:
            return FrameError("expected a non-empty list of frames [header, *buffers]")
        try:
            total = sum(_buffer(f).nbytes for f in frames)
        except DecodeError as err:
            return err
        limit = self._limit
        if limit is not None and total > limit:
            return MessageTooLarge(f"message of {total} bytes exceeds the limit of {limit} bytes")
        try:
            h = _buffer(frames[0])
            if len(h) > 3 and h[0] == 0x93 and h[2] < 0x80 and h[1] < 0x80:
                # What our encoder writes: no general parse needed.
                if h[1] not in _READ_VERSIONS:
                    raise _unsupported(h[1])
                n_buffers = h[2]
            else:
                try:
                    n_buffers, _ = _parse_header(h)
                except RecursionError:
                    raise FrameError("malformed header: nested too deeply") from None
            if n_buffers != len(frames) - 1:
                raise FrameError(
                    f"wrong frame count: header announces {n_buffers} buffers, "
                    f"got {len(frames) - 1}"
                )
        except DecodeError as err:
            return err
        if isinstance(exc, DecodeError):
            return exc
        if isinstance(exc, _Rejected):  # pragma: no cover - the header checks above caught it
            return FrameError("malformed header")
        if isinstance(exc, msgspec.DecodeError):
            return DecodeError(f"invalid message body: {_body_error(self.type, frames[0], exc)}")
        return DecodeError(f"invalid message body: {type(exc).__name__}: {exc}")


def message_types() -> tuple[type[_s.WireStruct], ...]:
    """Every message type ``decode(frames, type=None)`` accepts right now.

    These are the :class:`~fastio.WireStruct` subclasses with an integer tag defined in
    the ``fastio`` package, in tag order: the seed types and the fabric and
    weight-update messages. Subclasses defined elsewhere (applications, tests) are
    left out, so they can never collide with a wire tag; decode them by passing their
    type explicitly.
    """
    found: dict[int, type[_s.WireStruct]] = {}
    stack: list[type[Any]] = [_s.WireStruct]
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


_default_encoder = Encoder()
_default_decoders: dict[Any, Decoder] = {}


def encode(obj: Any) -> list[Any]:
    """Encode ``obj`` into frames ``[header, *buffers]`` with a shared default
    :class:`Encoder` (see it for the zero-copy contract).

    >>> from fastio import LLMRequest, decode, encode
    >>> frames = encode(LLMRequest(input_ids=[1, 2, 3]))
    >>> decode(frames).input_ids
    TokenArray([1, 2, 3], dtype=int32)
    """
    return _default_encoder.encode(obj)


def decode(frames: Sequence[Frame], type: Any = None) -> Any:
    """Decode frames into ``type`` (``None``: whichever fastio message arrived).

    Raises :class:`~fastio.DecodeError` for any malformed input.
    """
    # type=None's union grows when message modules are imported: key it by registry size.
    key = (None, _s._registry_generation) if type is None else type
    dec = _default_decoders.get(key)
    if dec is None:
        try:
            dec = _default_decoders[key] = Decoder(type)
        except TypeError as exc:
            raise TypeError(f"fastio cannot decode into {type!r}: {exc}") from exc
    return dec.decode(frames)
