"""Every ZeroMQ socket of the library is made by ``transport/sockets.py`` (its options
chosen in one place), and the weights' sockets keep the options they were designed with."""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

import transport
from transport import sockets
from transport.sockets import FRAME_CAP, make_monitor, make_pair

PACKAGE = Path(transport.__file__).parent
#: Calls that make a ZeroMQ socket (``ctx.socket``, ``zmq.Socket(...)``,
#: ``Socket.shadow``) or a monitor (``sock.monitor``, ``sock.get_monitor_socket``).
_MAKERS = {"socket", "Socket", "shadow", "monitor", "get_monitor_socket"}


def socket_calls(source: str) -> list[int]:
    """Lines of ``source`` that make a ZeroMQ socket; the standard library's
    ``socket.socket(...)`` (a plain TCP socket) is not one."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "Socket":
            lines.append(node.lineno)
        elif isinstance(func, ast.Attribute) and func.attr in _MAKERS:
            stdlib = isinstance(func.value, ast.Name) and func.value.id == "socket"
            if not (stdlib and func.attr == "socket"):
                lines.append(node.lineno)
    return sorted(lines)


def test_the_check_finds_socket_making_calls() -> None:
    src = """
import socket
import zmq
a = ctx.socket(zmq.PAIR)
b = self._zctx.socket(zmq.SUB)
c = sock.get_monitor_socket(zmq.EVENT_ALL)
d = zmq.Socket(ctx, zmq.PUSH)
e = zmq.asyncio.Socket.shadow(addr)
f = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
g = w.poll_monitor()
h = Socket(ctx, zmq.DEALER)
"""
    assert socket_calls(src) == [4, 5, 6, 7, 8, 11]


def test_no_module_but_sockets_py_makes_a_socket() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(sockets.__file__):
            continue
        found += [f"{path.relative_to(PACKAGE.parent)}:{n}" for n in socket_calls(path.read_text())]
    assert found == [], "make these sockets with transport.sockets: " + ", ".join(found)


def test_pair_and_monitor() -> None:
    zctx = zmq.Context()
    try:
        reader, writer = make_pair(zctx, "inproc://test-socket-factory-pair")
        writer.send(b"wake")
        assert reader.poll(5000) and reader.recv() == b"wake"
        assert reader.linger == writer.linger == 0
        router = sockets.make_socket(zctx, zmq.ROUTER)
        mon = make_monitor(router, zmq.EVENT_LISTENING)
        assert mon.linger == 0
        sockets.bind_all(router, "tcp://127.0.0.1:0")
        assert mon.poll(5000)
        event = recv_monitor_message(mon)
        assert event["event"] == zmq.EVENT_LISTENING
        for sock in (mon, router, reader, writer):
            sock.close()
    finally:
        zctx.term()


_OPTIONS = (zmq.TYPE, zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM, zmq.MAXMSGSIZE, zmq.AFFINITY)


def _recording(
    monkeypatch: Any, module: Any, made: threading.Event | None = None
) -> list[dict[int, int]]:
    """Wrap ``module.make_socket`` to read each new socket's options in its maker's
    thread (``made`` is set after each)."""
    options: list[dict[int, int]] = []
    real = module.make_socket

    def make_socket(*args: Any, **kwargs: Any) -> zmq.Socket[Any]:
        sock: zmq.Socket[Any] = real(*args, **kwargs)
        options.append({opt: int(sock.getsockopt(opt)) for opt in _OPTIONS})
        if made is not None:
            made.set()
        return sock

    monkeypatch.setattr(module, "make_socket", make_socket)
    return options


def test_weight_sockets_keep_their_options(monkeypatch: Any) -> None:
    torch = pytest.importorskip("torch")
    from transport.weights import WeightPublisher, WeightSubscriber
    from transport.weights import publisher as pub_mod
    from transport.weights import subscriber as sub_mod

    made_sub = threading.Event()
    pub_made = _recording(monkeypatch, pub_mod)
    sub_made = _recording(monkeypatch, sub_mod, made_sub)
    pub = WeightPublisher("tcp://127.0.0.1:0")
    with pub, WeightSubscriber(pub.endpoint, torch.nn.Linear(2, 2), worker_id="w-opts"):
        assert made_sub.wait(10)  # the SUB is made in the subscriber's thread
    router, pub_sock = pub_made
    # The ROUTER on the private context's I/O threads 1 and 2, the PUB on thread 0;
    # the PUB keeps libzmq's receive HWM and no size limit (it receives subscriptions).
    assert router == {
        zmq.TYPE: zmq.ROUTER, zmq.LINGER: 0, zmq.SNDHWM: 10_000, zmq.RCVHWM: 10_000,
        zmq.MAXMSGSIZE: FRAME_CAP * 4 << 20, zmq.AFFINITY: 0b110,
    }  # fmt: skip
    assert pub_sock == {
        zmq.TYPE: zmq.PUB, zmq.LINGER: 0, zmq.SNDHWM: 10_000, zmq.RCVHWM: 1000,
        zmq.MAXMSGSIZE: -1, zmq.AFFINITY: 1,
    }  # fmt: skip
    assert sub_made == [
        {zmq.TYPE: zmq.SUB, zmq.LINGER: 0, zmq.SNDHWM: 1000, zmq.RCVHWM: 1000,
         zmq.MAXMSGSIZE: FRAME_CAP * 64 << 20, zmq.AFFINITY: 0}
    ]  # fmt: skip
