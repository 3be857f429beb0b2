"""What a peer reads, and what to write to it.

A fabric peer states in every :class:`~fastio.fabric_msgs.Heartbeat` the protocol
versions it reads (``protocol_min`` .. ``protocol``) and the token encodings it decodes
(``token_encodings``, bits of :class:`~fastio.protocol.TokenEncoding`). Peers of
version 1 state nothing: the fields' defaults (versions 1..1, ext 4 only) describe
exactly what every one of them reads. :func:`encoder_for` turns such a statement
into the :class:`~fastio.Encoder` to write to that peer with, or raises
:class:`~fastio.IncompatiblePeer` naming both sides' versions.

Pings (and the Error refusing a peer) carry no token arrays and are written at
version 1 (:data:`VERSION_1`), which every version reads: two peers can always tell
each other what they read.

>>> from fastio import fabric_msgs as fm
>>> encoder_for(fm.Heartbeat()).version  # a version-1 peer: ext 4 at version 1
1
>>> enc = encoder_for(fm.Heartbeat(**STATED))
>>> enc.version, enc.tokens.name
(2, 'REF')
"""

from __future__ import annotations

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

#: Writes version 1 (token arrays as ext 4), which every version reads: for messages
#: to a peer not heard from (pings, replies before its first ping, version refusals)
#: and for messages that carry no token arrays and no capability exchange (controls,
#: weight updates), whose bytes are the same in both versions.
VERSION_1 = Encoder(version=1)

_T = TokenEncoding
# Best first: the forms this side writes, with the bits a reader needs for each.
_PREFERENCE = (
    (_T.REF, _T.REF | _T.COMPACT),
    (_T.COMPACT, _T.COMPACT),
    (_T.TOKENS, _T.TOKENS),
)
_encoders: dict[tuple[int, int], Encoder] = {}
_picked: dict[tuple[int, int, int], tuple[int, TokenEncoding] | str] = {}


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


def _ours() -> str:
    return describe(PROTOCOL_VERSION, MIN_PROTOCOL_VERSION, int(READS))


def pick(protocol: int, protocol_min: int, token_encodings: int) -> tuple[int, TokenEncoding]:
    """The (version, token encoding) to write to a peer that reads versions
    ``protocol_min`` .. ``protocol`` and the token encodings ``token_encodings``: the
    newest of each that both sides know.

    Raises
    ------
    IncompatiblePeer
        No version, or no token encoding, in common; the message names both sides.
    """
    key = (protocol, protocol_min, token_encodings)
    got = _picked.get(key)
    if got is None:
        got = _pick(*key)
        if len(_picked) < 1024:  # peers state few distinct things; hostile ones many
            _picked[key] = got
    if isinstance(got, str):
        raise IncompatiblePeer(got)
    return got


def _pick(
    protocol: int, protocol_min: int, token_encodings: int
) -> tuple[int, TokenEncoding] | str:
    version = min(protocol, PROTOCOL_VERSION)
    theirs = describe(protocol, protocol_min, token_encodings)
    if version < max(protocol_min, MIN_PROTOCOL_VERSION):
        newer = "the peer" if protocol_min > PROTOCOL_VERSION else "this side"
        return (
            f"no protocol version in common: the peer speaks {theirs}, this side speaks "
            f"{_ours()}; {newer} is newer: upgrade the other"
        )
    for form, needs in _PREFERENCE:
        if token_encodings & needs == needs and (form is _T.TOKENS or version >= 2):
            return version, form
    return f"no token encoding in common: the peer speaks {theirs}, this side speaks {_ours()}"


def encoder_for(hb: Any) -> Encoder:
    """The encoder for a peer, from the versions its Heartbeat states (shared per
    version and encoding; an :class:`~fastio.Encoder` may be shared by threads).

    Raises
    ------
    IncompatiblePeer
        See :func:`pick`.
    """
    key = pick(hb.protocol, hb.protocol_min, hb.token_encodings)
    enc = _encoders.get(key)
    if enc is None:
        enc = _encoders[key] = Encoder(version=key[0], tokens=key[1])
    return enc
