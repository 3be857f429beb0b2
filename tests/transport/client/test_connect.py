"""Failing fast when no worker is there, refused CURVE keys, bad addresses, and the
client's metrics endpoint."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq.auth

from fastio import FastioError, LLMRequest
from tests.transport.conftest import WorkerProc
from transport import (
    BadAddress,
    ClientConfig,
    CurveConfig,
    FabricClient,
    FabricController,
    NoWorkerAvailable,
    SyncFabricClient,
    TransportError,
    WorkerConfig,
    WorkerServer,
    echo_handler,
)
from transport.addresses import check_address

QUICK = ClientConfig(heartbeat_interval=0.05, connect_timeout=0.5, request_timeout=60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_no_worker_fails_fast_naming_the_address(caplog: pytest.LogCaptureFixture) -> None:
    address = f"tcp://127.0.0.1:{_free_port()}"  # nobody listens there

    async def main() -> None:
        async with FabricClient([address], QUICK) as client:
            t0 = time.monotonic()
            with pytest.raises(NoWorkerAvailable) as raised:
                await client.agenerate(LLMRequest(input_ids=[1]))
            assert time.monotonic() - t0 < 10  # not the hour of request_timeout
            err = raised.value
            assert address in str(err) and err.seen[address].startswith("never answered")
            # Past connect_timeout, a new call fails at once.
            t0 = time.monotonic()
            with pytest.raises(NoWorkerAvailable):
                await client.agenerate(LLMRequest(input_ids=[2]))
            assert time.monotonic() - t0 < 0.5
            assert not client.workers[0].alive and client.stats["no_worker"] == 2

    with caplog.at_level(logging.WARNING, logger="transport.client"):
        asyncio.run(main())
    warned = [r for r in caplog.records if "no generation worker" in r.getMessage()]
    assert len(warned) == 1  # logged once, not per call


def test_no_worker_is_warned_about_once_without_any_call(
    caplog: pytest.LogCaptureFixture,
) -> None:
    address = f"tcp://127.0.0.1:{_free_port()}"

    async def main() -> None:
        async with FabricClient([address], QUICK) as client:
            await asyncio.sleep(1.2)  # the time under test: connect_timeout (0.5 s) passes
            assert client.workers[0].seen.startswith("never answered")

    with caplog.at_level(logging.WARNING, logger="transport.client"):
        asyncio.run(main())
    warned = [r for r in caplog.records if "no generation worker" in r.getMessage()]
    assert len(warned) == 1 and address in warned[0].getMessage()


@pytest.mark.slow
def test_refused_curve_key_is_named(spawn: Callable[..., WorkerProc], tmp_path: Path) -> None:
    keys, allowed = tmp_path / "keys", tmp_path / "allowed"
    keys.mkdir()
    allowed.mkdir()
    server_pub, server_sec = zmq.auth.create_certificates(str(keys), "server")
    client_pub, _ = zmq.auth.create_certificates(str(keys), "client")
    _, rogue_sec = zmq.auth.create_certificates(str(keys), "rogue")
    (allowed / "client.key").write_bytes(Path(client_pub).read_bytes())
    w = spawn(
        "--bind", "tcp://127.0.0.1:0", "--engine", "echo",
        "--curve-secret", server_sec, "--curve-clients", str(allowed),
    )  # fmt: skip
    rogue = CurveConfig(secret_key_file=rogue_sec, server_public_key_file=server_pub)

    async def main() -> None:
        cfg = ClientConfig(heartbeat_interval=0.05, connect_timeout=1.0, curve=rogue)
        async with FabricClient([w.address], cfg) as client:
            with pytest.raises(NoWorkerAvailable) as raised:
                await client.agenerate(LLMRequest(input_ids=[3]))
            seen = raised.value.seen[w.address]
            assert "refused the CURVE handshake" in seen, seen
            assert "HANDSHAKE_FAILED_AUTH" in seen and "refused the CURVE" in str(raised.value)
        cfg = ClientConfig(heartbeat_interval=0.05, connect_timeout=1.0)  # no CURVE at all
        async with FabricClient([w.address], cfg) as client:
            with pytest.raises(NoWorkerAvailable) as raised:
                await client.agenerate(LLMRequest(input_ids=[4]))
            seen = raised.value.seen[w.address]
            assert "refused the ZMTP (it may expect CURVE) handshake" in seen, seen

    asyncio.run(main())


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1:5555", "has no scheme"),
        ("localhost", "has no scheme"),
        ("tcp://127.0.0.1", "needs a port"),
        ("tcp://127.0.0.1:99999", "not a number in 1-65535"),
        ("tcp://127.0.0.1:http", "not a number in 1-65535"),
        ("tcp://*:5555", "a client needs a host"),
        ("udp://127.0.0.1:5555", "transport 'udp' is not supported"),
        ("ipc://", "names no endpoint"),
    ],
)
def test_bad_addresses_are_rejected_up_front(address: str, why: str) -> None:
    with pytest.raises(BadAddress, match=why) as raised:
        FabricClient([address])
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, TransportError)
    assert isinstance(raised.value, FastioError)

    async def main() -> None:
        async with FabricClient([], QUICK) as client:
            with pytest.raises(BadAddress, match=why):
                client.add_worker(address)
            assert client.workers == []

    asyncio.run(main())
    with pytest.raises(BadAddress, match=why):
        SyncFabricClient([address])
    with pytest.raises(BadAddress, match=why):
        FabricController([address])


def test_metrics_endpoint_counts_the_client(spawn: Callable[..., WorkerProc]) -> None:
    pytest.importorskip("prometheus_client")
    w = spawn("--bind", "tcp://127.0.0.1:0", "--engine", "echo")

    async def main() -> str:
        cfg = ClientConfig(heartbeat_interval=0.05, metrics_port=0)
        async with FabricClient([w.address], cfg) as client:
            assert (await client.agenerate(LLMRequest(input_ids=[1]))).output_tokens == [1]
            assert client.metrics_port
            url = f"http://127.0.0.1:{client.metrics_port}/metrics"
            return await asyncio.to_thread(
                lambda: urllib.request.urlopen(url, timeout=10).read().decode()
            )

    text = asyncio.run(main())
    assert "fastio_client_latency_seconds_count" in text
    assert "fastio_client_resends_total" in text and "fastio_client_worker_deaths_total" in text


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1:5555", "has no scheme"),
        ("tcp://127.0.0.1:99999", "not a number in 0-65535"),
        ("udp://127.0.0.1:5555", "transport 'udp' is not supported"),
    ],
)
def test_bad_bind_addresses_are_rejected_before_binding(address: str, why: str) -> None:
    from transport.weights import WeightPublisher  # the weights extra

    with pytest.raises(BadAddress, match=f"bind address {address!r}.*{why}"):
        WeightPublisher(address)
    server = WorkerServer(echo_handler, WorkerConfig(bind=address))
    with pytest.raises(BadAddress, match=why):
        asyncio.run(server.start())
    # Port 0 or *, and host *, bind.
    assert check_address("tcp://*:0", bind=True) == "tcp://*:0"
    assert check_address("tcp://127.0.0.1:*", bind=True) == "tcp://127.0.0.1:*"
