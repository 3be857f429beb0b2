"""CurveZMQ encryption and client authentication from key files."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq.auth

from fastio import LLMRequest
from tests.transport.conftest import WorkerProc
from transport import ClientConfig, CurveConfig, FabricClient, FabricController, RequestTimeout


def test_curve_admits_authorized_keys_only(
    spawn: Callable[..., WorkerProc], tmp_path: Path
) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    server_pub, server_sec = zmq.auth.create_certificates(str(keys), "server")
    client_pub, client_sec = zmq.auth.create_certificates(str(keys), "client")
    _, rogue_sec = zmq.auth.create_certificates(str(keys), "rogue")
    zmq.auth.create_certificates(str(allowed), "placeholder")  # a directory with other keys too
    (allowed / "client.key").write_bytes(Path(client_pub).read_bytes())
    w = spawn(
        "--bind", "tcp://127.0.0.1:0", "--engine", "echo",
        "--curve-secret", server_sec, "--curve-clients", str(allowed),
    )  # fmt: skip
    good = CurveConfig(secret_key_file=client_sec, server_public_key_file=server_pub)
    rogue = CurveConfig(secret_key_file=rogue_sec, server_public_key_file=server_pub)

    async def main() -> None:
        # A long liveness: a late pong must not make it re-send (received == 1 below).
        cfg = ClientConfig(heartbeat_interval=0.05, heartbeat_liveness=200, curve=good)
        async with FabricClient([w.address], cfg) as client:
            assert (await client.agenerate(LLMRequest(input_ids=[1, 2]))).output_tokens == [1, 2]
        for curve in (rogue, None):  # wrong key, and no encryption at all
            cfg = ClientConfig(heartbeat_interval=0.05, curve=curve)
            async with FabricClient([w.address], cfg) as client:
                with pytest.raises(RequestTimeout):
                    await client.agenerate(LLMRequest(input_ids=[3]), timeout=0.5)
                assert not client.workers[0].alive  # not even a heartbeat got through

    asyncio.run(main())
    with FabricController([w.address], curve=good) as ctl:
        st = ctl.health(timeout=5)[w.address]
    assert st.counters["auth_denied"] >= 1  # the rogue key, refused by the authenticator
    assert st.counters["handshake_failed"] >= 2  # ... and the peer without CURVE too
    assert st.counters["received"] == 1  # only the authorized request reached the handler
