"""Recorded bytes of earlier releases (``wire_vectors/``, see its README) against
today's codec: every one decodes, today's encoder writes each older form byte for
byte when asked, and what it writes to a peer that states nothing (a version-1 peer)
is ext 4 at version 1, the one form every version-1 reader reads, at any size."""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest

import fastio
from fastio import Encoder, IncompatiblePeer, TokenArray, UnsupportedVersion, versions
from fastio import fabric_msgs as fm
from fastio.protocol import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION, READS, TokenEncoding
from tests.helpers import ERA_READS, ERAS, ext_codes, load, record

#: The encoder settings that wrote each directory (its release's defaults).
ERA_ENCODERS: dict[str, dict[str, Any]] = {
    "ext4": {"version": 1, "tokens": TokenEncoding.TOKENS, "inline_threshold": 256},
    "compact": {"version": 1, "tokens": TokenEncoding.COMPACT},
    "ref": {"version": 1, "tokens": TokenEncoding.REF},
}
MESSAGES = record.messages()


def same(a: Any, b: Any) -> bool:
    """Structs equal field by field; token arrays equal in dtype and elements."""
    if isinstance(a, TokenArray) or isinstance(b, TokenArray):
        x, y = np.asarray(a), np.asarray(b)
        return x.dtype == y.dtype and np.array_equal(x, y)
    if isinstance(a, msgspec.Struct):
        if type(a) is not type(b):
            return False
        return all(same(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__)
    return bool(a == b)


@pytest.mark.parametrize("name", sorted(MESSAGES))
@pytest.mark.parametrize("era", ERAS)
def test_recorded_bytes_decode_today(era: str, name: str) -> None:
    frames = load(era, name)
    got = fastio.decode(frames)
    assert same(got, MESSAGES[name]), (era, name, got)
    # Into the type a worker or a client expects, as they decode them.
    union = fm.CLIENT_TO_WORKER if name in ("ping", "cancel") or "submit" in name else None
    if union is not None:
        assert same(fastio.Decoder(union).decode(frames), MESSAGES[name])


def test_recorded_large_arrays_use_each_era_s_frame_form() -> None:
    """The vectors hold what they claim: 3000 int32 tokens (12000 bytes) in a frame as
    ext 4, 32 + 5 and 48 + 5."""
    for era, code in (("ext4", 4), ("compact", 37), ("ref", 53)):
        frames = load(era, "submit_large")
        assert len(frames) == 2 and len(frames[1]) == 12000
        version, codes = ext_codes(frames)
        assert version == 1 and code in codes


@pytest.mark.parametrize("era", ERAS)
def test_encoder_writes_each_older_form_byte_for_byte(era: str) -> None:
    enc = Encoder(**ERA_ENCODERS[era])
    for name, msg in MESSAGES.items():
        if isinstance(msg, fm.Heartbeat):
            continue  # it has gained fields since (appended, with defaults)
        mine = [record.frame_bytes(f) for f in enc.encode(msg)]
        assert mine == load(era, name), (era, name)


def test_heartbeat_gained_only_trailing_fields() -> None:
    """Today's ping is an old one with three fields appended, which old readers skip."""
    old = load("ext4", "ping")[0]
    new = versions.VERSION_1.encode(fm.Heartbeat(sent_at=1.5, **versions.STATED))[0]
    assert old[:3] == new[:3] == b"\x93\x01\x00"  # version 1, no buffers
    assert old[3] == 0x9A and new[3] == 0x9D  # array of 10 -> 13
    assert new[4:].startswith(old[4:])
    assert msgpack.unpackb(new)[2][10:] == [PROTOCOL_VERSION, MIN_PROTOCOL_VERSION, int(READS)]


@pytest.mark.parametrize("era", ERAS)
@pytest.mark.parametrize("name", ["result_small", "result_large", "stream_large", "submit_large"])
def test_what_a_silent_peer_gets_every_old_release_reads(era: str, name: str) -> None:
    """An old peer's pong states nothing: it is written ext 4 at version 1, which every
    release of version 1 reads, small or large (no size-dependent failure)."""
    pong = fastio.decode(load(era, "pong"))
    enc = versions.encoder_for(pong)
    assert (enc.version, enc.tokens) == (1, TokenEncoding.TOKENS)
    frames = enc.encode(MESSAGES[name])
    version, codes = ext_codes(frames)
    assert version == 1 and codes <= ERA_READS["ext4"] and codes <= ERA_READS[era]
    assert same(fastio.decode(frames), MESSAGES[name])


def test_a_peer_of_this_version_gets_the_fastest_form() -> None:
    enc = versions.encoder_for(fm.Heartbeat(**versions.STATED))
    assert (enc.version, enc.tokens) == (PROTOCOL_VERSION, TokenEncoding.REF)
    version, codes = ext_codes(enc.encode(MESSAGES["result_large"]))
    assert version == 2 and 53 in codes


@pytest.mark.parametrize(
    ("stated", "expect"),
    [
        ((2, 1, 7), (2, TokenEncoding.REF)),
        ((3, 1, 7), (2, TokenEncoding.REF)),  # a newer peer that still reads 2
        ((2, 2, 2), (2, TokenEncoding.COMPACT)),  # no REF: 32 + d in frames
        ((2, 1, 4), None),  # REF alone: its inline form (16 + d) is COMPACT's
        ((2, 1, 1), (2, TokenEncoding.TOKENS)),
        ((1, 1, 7), (1, TokenEncoding.TOKENS)),  # version 1 writes ext 4 only
        ((1, 1, 1), (1, TokenEncoding.TOKENS)),
        ((4, 3, 7), None),  # a newer major version
        ((2, 1, 0), None),  # reads no token encoding we write
        ((2, 1, 8), None),  # only a future encoding
    ],
)
def test_pick(stated: tuple[int, int, int], expect: Any) -> None:
    if expect is None:
        with pytest.raises(IncompatiblePeer) as info:
            versions.pick(*stated)
        text = str(info.value)
        # Both sides named: the peer's versions and ours.
        assert f"protocol {stated[0]} (reads versions {stated[1]}-{stated[0]}" in text
        assert f"protocol {PROTOCOL_VERSION} (reads versions {MIN_PROTOCOL_VERSION}-" in text
    else:
        assert versions.pick(*stated) == expect


def test_newer_major_version_says_who_to_upgrade() -> None:
    with pytest.raises(IncompatiblePeer, match="the peer is newer: upgrade the other"):
        versions.pick(4, 3, 7)


def test_decoder_reads_versions_1_and_2_and_names_both_otherwise() -> None:
    body = msgspec.msgpack.encode([12, 1, 2, 3])
    for v in (1, 2):
        assert fastio.decode([bytes([0x93, v, 0]) + body]) == fastio.RolloutStat(1, 2, 3)
    for v in (0, 3, 127):
        with pytest.raises(
            UnsupportedVersion, match=f"version {v}; this decoder reads versions 1-2"
        ):
            fastio.decode([bytes([0x93, v, 0]) + body])


def test_encoder_rejects_unknown_versions_and_forms() -> None:
    for bad in ({"version": 0}, {"version": 3}, {"tokens": READS}, {"tokens": 8}):
        with pytest.raises(ValueError):
            Encoder(**bad)
    assert Encoder().version == PROTOCOL_VERSION and Encoder().tokens is TokenEncoding.REF
    assert Encoder(version=1).tokens is TokenEncoding.TOKENS


def test_protocol_doc_version_examples_are_exact() -> None:
    """The ping and the version-1 Submit of docs/PROTOCOL.md ("Example bytes")."""
    from fastio import GenerationHyperparameters, LLMRequest

    ping = versions.VERSION_1.encode(fm.Heartbeat(sent_at=1.5, **versions.STATED))
    assert ping == [
        bytes.fromhex("930100 9d18 cb3ff8000000000000 a0a000c200 0000cb0000000000000000 020107")
    ]
    req = LLMRequest(
        rid="r1",
        input_ids=np.array([1, 2, 3], np.int32),
        gconfig=GenerationHyperparameters(max_new_tokens=4),
    )
    old = versions.encoder_for(fm.Heartbeat()).encode(fm.Submit(id=7, request=req))
    assert old[0].startswith(
        bytes.fromhex("930100951407 9602a27231")
        + bytes.fromhex("c71704 93 a5")
        + b"int32"
        + bytes.fromhex("9103 c40c 010000000200000003000000")
    )
