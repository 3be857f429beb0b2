"""Misuse and broken environments get one clear line, and the process keeps serving:
empty prompts, host names that do not resolve, plugin options without a plugin, a
request the engine refuses, a dict gconfig, a wildcard publisher.

Host names are resolved in a mount namespace whose ``/etc/resolv.conf`` names only a
loopback resolver (nothing listens there), so no lookup leaves the machine."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

import fastio
from fastio import LLMRequest
from fastio import fabric_msgs as fm
from transport import (
    ClientConfig,
    FabricClient,
    RemoteError,
    SyncFabricClient,
    WorkerConfig,
    WorkerServer,
    echo_handler,
)

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    pp = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), pp]) if pp else str(ROOT))


@pytest.fixture(scope="module")
def loopback_dns(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A resolv.conf naming a loopback resolver; skips where namespaces are not ours."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) for a private mount namespace")
    conf = tmp_path_factory.mktemp("dns") / "resolv.conf"
    conf.write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount --bind {conf} /etc/resolv.conf"],
        capture_output=True,
        timeout=30,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.decode().strip()}")
    return conf


def _run_offline(conf: Path, code: str, hostname: str = "") -> subprocess.CompletedProcess[str]:
    """Run ``code`` with host names resolved by ``conf`` only (and a host name of its own)."""
    setup = f"mount --bind {conf} /etc/resolv.conf"
    flags = ["-m"]
    if hostname:
        flags.append("-u")
        setup += f" && hostname {hostname}"
    return subprocess.run(
        ["unshare", *flags, "sh", "-c", f'{setup} && exec "$0" -c "$1"', sys.executable, code],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


# -- empty prompts ---------------------------------------------------------------------
def test_worker_refuses_an_empty_prompt_and_keeps_serving() -> None:
    async def main() -> list[Any]:
        server = WorkerServer(echo_handler, WorkerConfig(bind="tcp://127.0.0.1:0"))
        (endpoint,) = await server.start()
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            got: list[Any] = []
            for id, ids in ((1, []), (2, [4, 5])):
                s.send_multipart(fastio.encode(fm.Submit(id=id, request=LLMRequest(input_ids=ids))))
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and len(got) < id:
                    if await asyncio.to_thread(s.poll, 100):
                        frames = s.recv_multipart()
                        got += [
                            fastio.decode(p, type=fm.WORKER_TO_CLIENT) for p in fm.split(frames)
                        ]
            return got
        finally:
            ctx.destroy(linger=0)
            await server.close()

    refused, answered = asyncio.run(main())
    assert isinstance(refused, fm.Error) and refused.id == 1
    assert refused.code == fm.ErrorCode.BAD_REQUEST and "empty prompt" in refused.message
    assert isinstance(answered, fm.Result) and answered.output_tokens.tolist() == [4, 5]


def test_client_refuses_an_empty_prompt_before_sending() -> None:
    async def main() -> tuple[BaseException | None, list[int], dict[str, int]]:
        server = WorkerServer(echo_handler, WorkerConfig(bind="tcp://127.0.0.1:0"))
        endpoints = await server.start()
        try:
            async with FabricClient(endpoints, ClientConfig(stream=False)) as client:
                fut = client.agenerate(LLMRequest(rid="empty"))
                err = await asyncio.wait_for(asyncio.gather(fut, return_exceptions=True), 10)
                ok = await asyncio.wait_for(client.agenerate(LLMRequest(input_ids=[3])), 30)
            return err[0], ok.output_tokens.tolist(), dict(server.counters)
        finally:
            await server.close()

    err, tokens, counters = asyncio.run(main())
    assert isinstance(err, ValueError) and "empty prompt" in str(err)
    assert tokens == [3]
    assert counters["received"] == 1 and counters["bad_messages"] == 0  # never sent


# -- host names that do not resolve ----------------------------------------------------
def test_client_names_an_unresolvable_worker_host(loopback_dns: Path) -> None:
    code = textwrap.dedent(
        """
        import asyncio
        from fastio import LLMRequest
        from transport import ClientConfig, FabricClient, NoWorkerAvailable

        async def main():
            cfg = ClientConfig(connect_timeout=2.0)
            async with FabricClient(["tcp://trainer-nowhere:5600"], cfg) as client:
                try:
                    await asyncio.wait_for(client.agenerate(LLMRequest(input_ids=[1])), 30)
                except NoWorkerAvailable as exc:
                    print("RAISED", exc)

        asyncio.run(main())
        """
    )
    out = _run_offline(loopback_dns, code)
    assert out.returncode == 0, out.stderr
    (raised,) = [ln for ln in out.stdout.splitlines() if ln.startswith("RAISED")]
    assert "never answered: cannot resolve host 'trainer-nowhere'" in raised
    assert "attempts refused" not in raised
    warnings = [ln for ln in out.stderr.splitlines() if ln.startswith("worker tcp://")]
    assert len(warnings) == 1 and "cannot resolve host 'trainer-nowhere'" in warnings[0]


def test_subscriber_names_an_unresolvable_publisher_host(loopback_dns: Path) -> None:
    pytest.importorskip("torch")
    code = textwrap.dedent(
        """
        import logging, threading, torch
        from transport.weights import WeightSubscriber

        seen = threading.Event()

        class Catch(logging.Handler):
            def emit(self, record):
                print(record.levelname, record.getMessage(), flush=True)
                seen.set()

        logging.getLogger("transport.weights").addHandler(Catch())
        sub = WeightSubscriber("tcp://trainer-nowhere:5600", {"w": torch.zeros(2)}, worker_id="w0")
        sub.start()
        print("WARNED", seen.wait(30), flush=True)
        sub.close()
        """
    )
    out = _run_offline(loopback_dns, code)
    assert out.returncode == 0, out.stderr
    assert "WARNED True" in out.stdout, out.stdout
    lines = [ln for ln in out.stdout.splitlines() if "cannot resolve host" in ln]
    assert lines and lines[0].startswith("WARNING weight subscriber w0, publisher tcp://")
    assert "'trainer-nowhere'" in lines[0]


def test_from_param_specs_raises_when_the_host_name_does_not_resolve(loopback_dns: Path) -> None:
    code = textwrap.dedent(
        """
        import fastio
        mode = fastio.AllocationMode.from_str("sglang.d1p1t1+d1p1t1")
        specs = [fastio.ParamSpec(name="w", shape=(2,), dtype="float32")]
        try:
            meta = fastio.WeightUpdateMeta.from_param_specs(mode, specs)
        except OSError as exc:
            print("RAISED", exc)
        else:
            print("ADDRESS", meta.nccl_master_address)
        meta = fastio.WeightUpdateMeta.from_param_specs(mode, specs, master_address="10.1.2.3")
        print("EXPLICIT", meta.nccl_master_address)
        """
    )
    out = _run_offline(loopback_dns, code, hostname="fastio-no-such-host")
    assert out.returncode == 0, out.stderr
    assert "RAISED cannot find this host's address: its name 'fastio-no-such-host'" in out.stdout
    assert "EXPLICIT 10.1.2.3" in out.stdout


# -- the worker CLI and the engine -----------------------------------------------------
def test_plugin_opt_without_plugin_is_refused() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "transport.worker",
            "--bind",
            "tcp://127.0.0.1:0",
            "--engine",
            "echo",
            "--plugin-opt",
            "weights_endpoint=tcp://127.0.0.1:5600",
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    (line,) = out.stderr.strip().splitlines()
    assert "--plugin-opt weights_endpoint given without --plugin" in line


@pytest.mark.slow
def test_a_request_the_engine_refuses_is_one_warning_line() -> None:
    pytest.importorskip("torch")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transport.worker",
            "--bind",
            "tcp://127.0.0.1:0",
            "--engine",
            "reference",
            "--vocab-size",
            "16",
            "--engine-opt",
            "token_interval=0",
        ],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        address = json.loads(line)["ready"][0]
        g = fastio.GenerationHyperparameters(max_new_tokens=2)
        with SyncFabricClient([address]) as client:
            for _ in range(3):
                with pytest.raises(RemoteError, match=r"must lie in \[0, 16\)"):
                    client.generate(LLMRequest(input_ids=[1, 99], gconfig=g), timeout=30)
            ok = client.generate(LLMRequest(input_ids=[1, 2], gconfig=g), timeout=30)
        assert len(ok.output_tokens) == 2
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    refused = [ln for ln in lines if "refused by the engine" in ln]
    assert len(refused) == 3 and all(" WARNING " in ln for ln in refused), lines
    assert not any("Traceback" in ln or " ERROR " in ln for ln in lines), lines


# -- a dict gconfig --------------------------------------------------------------------
def test_dict_gconfig_is_converted_or_refused_with_a_hint() -> None:
    req = LLMRequest(input_ids=[1], gconfig={"max_new_tokens": 4, "greedy": True})  # type: ignore[arg-type]
    assert type(req.gconfig) is fastio.GenerationHyperparameters
    assert (req.gconfig.max_new_tokens, req.gconfig.greedy, req.gconfig.top_p) == (4, True, 1.0)
    back = fastio.decode(fastio.encode(req))
    assert back.gconfig.max_new_tokens == 4
    with pytest.raises(TypeError, match=r"no field 'max_tokens'.*GenerationHyperparameters"):
        LLMRequest(input_ids=[1], gconfig={"max_tokens": 4})  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"max_new_tokens.*pass a fastio\.GenerationHyperparameters"
    ):
        LLMRequest(input_ids=[1], gconfig={"max_new_tokens": "4"})  # type: ignore[arg-type]


# -- a publisher bound to every interface ----------------------------------------------
def test_subscriber_reaches_a_wildcard_publishers_pub_at_the_routers_host() -> None:
    pytest.importorskip("torch")
    import torch

    from transport.weights import WeightPublisher, WeightSubscriber

    pub = WeightPublisher("tcp://*:*", shm=False, heartbeat_interval=0.1)
    try:
        port = pub.endpoint.rsplit(":", 1)[1]
        assert pub.pub_endpoint.startswith("tcp://0.0.0.0:")
        target = {"w": torch.zeros(8)}
        # Reached at 127.0.0.2: the PUB must be looked for there, not at 0.0.0.0.
        with WeightSubscriber(f"tcp://127.0.0.2:{port}", target, heartbeat_interval=0.1) as sub:
            pub.wait_for_workers(1, 30)
            result = pub.publish_and_wait({"w": torch.full((8,), 2.0)}, 1, timeout=30)
            assert result.ok and float(target["w"][0]) == 2.0
            pub_port = pub.pub_endpoint.rsplit(":", 1)[1]
            assert sub._pub_endpoint == f"tcp://127.0.0.2:{pub_port}"
    finally:
        pub.close()
