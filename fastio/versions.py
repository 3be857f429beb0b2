"""What a peer reads, and what to write to it (``docs/PROTOCOL.md``, "Versions"):
:func:`encoder_for` a peer's :class:`~fastio.fabric_msgs.Heartbeat` (or
:class:`~fastio.IncompatiblePeer`); :data:`VERSION_1` for a peer not heard from yet."""

from __future__ import annotations

import functools
from typing import Any

from fastio.codec import Encoder
from fastio.errors import IncompatiblePeer
from fastio.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, READS, TokenEncoding

__all__ = ["STATED", "VERSION_1", "describe", "encoder_for", "pick"]

#: What this side states in its Heartbeats (keyword arguments of ``Heartbeat``).
STATED: dict[str, Any] = {
    "protocol": PROTOCOL_VERSION,
    "protocol_min": MIN_PROTOCOL_VERSION,
    "token_encodings": int(READS),
}

#: Writes version 1, which every version reads: for peers not heard from and messages
#: whose bytes are the same in both versions (controls, weight updates).
VERSION_1 = Encoder(version=1)

_T = TokenEncoding
# Best first: the forms this side writes, with the bits a reader needs for each.
_PREFERENCE = (
    (_T.REF, _T.REF | _T.COMPACT),
    (_T.COMPACT, _T.COMPACT),
    (_T.TOKENS, _T.TOKENS),
)


def describe(protocol: int, protocol_min: int, token_encodings: int) -> str:
    """``"protocol 2 (reads versions 1-2, token encodings TOKENS|COMPACT|REF)"``."""
    names = [t.name for t in TokenEncoding if token_encodings & t] or ["none"]
    extra = token_encodings & ~int(READS)
    if extra:
        names.append(f"0x{extra:x}")
    return (
        f"protocol {protocol} (reads versions {protocol_min}-{protocol}, "
        f"token encodings {'|'.join(n for n in names if n)})"
    )


def pick(protocol: int, protocol_min: int, token_encodings: int) -> tuple[int, TokenEncoding]:
    """The newest (version, token encoding) both sides know, for a peer that reads
    versions ``protocol_min`` .. ``protocol`` and ``token_encodings``; else
    :class:`~fastio.IncompatiblePeer`, naming both sides."""
    got = _pick(protocol, protocol_min, token_encodings)
    if isinstance(got, str):
        raise IncompatiblePeer(got)
    return got


@functools.lru_cache(maxsize=1024)  # peers state few distinct things; hostile ones many
def _pick(
    protocol: int, protocol_min: int, token_encodings: int
) -> tuple[int, TokenEncoding] | str:
    version = min(protocol, PROTOCOL_VERSION)
    theirs = describe(protocol, protocol_min, token_encodings)
    ours = describe(PROTOCOL_VERSION, MIN_PROTOCOL_VERSION, int(READS))
    if version < max(protocol_min, MIN_PROTOCOL_VERSION):
        newer = "the peer" if protocol_min > PROTOCOL_VERSION else "this side"
        return (
            f"no protocol version in common: the peer speaks {theirs}, this side speaks "
            f"{ours}; {newer} is newer: upgrade the other"
        )
    for form, needs in _PREFERENCE:
        if token_encodings & needs == needs and (form is _T.TOKENS or version >= 2):
            return version, form
    return f"no token encoding in common: the peer speaks {theirs}, this side speaks {ours}"


def encoder_for(hb: Any) -> Encoder:
    """The shared encoder for a peer, from its Heartbeat's versions (raises as :func:`pick`)."""
    version, tokens = pick(hb.protocol, hb.protocol_min, hb.token_encodings)
    return _encoder(version=version, tokens=tokens)


_encoder = functools.cache(Encoder)
