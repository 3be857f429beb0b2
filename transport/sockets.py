"""Every socket of the fabric and the weights is made here, so its options are chosen
once; this module also re-exports the pump and the CURVE helpers.

``ZMQ_MAXMSGSIZE``
    Per *frame*: a larger frame disconnects its peer before it is buffered. A larger
    multi-frame *total* is refused by the decoder only after libzmq buffered it, so
    only trusted peers should reach a worker (loopback, or CURVE with
    ``authorized_clients_dir``).
High-water marks
    Worker ROUTERs set ``ZMQ_ROUTER_MANDATORY``: at the HWM a send raises ``EAGAIN``
    and the message waits in the pump's queue (never silently dropped); a send to a
    gone peer raises ``EHOSTUNREACH`` (counted undeliverable). DEALERs too block into
    the pump's queue.
``ZMQ_IMMEDIATE`` on DEALERs
    Nothing is queued in libzmq for a worker whose connection is down: the pump retries,
    so a restarted worker gets it; the client drops the queue of a worker it declares
    dead, and a new incarnation makes it re-send: never a duplicate answer.
Routing ids and ``ZMQ_ROUTER_HANDOVER``
    A client's DEALERs keep one routing id across reconnects, which worker ROUTERs let
    it take over: answers reach a client whose connection reset.
``linger``
    0 at close; :meth:`SocketPump.close` still hands libzmq what the pump holds.
``copy_threshold`` of ROUTERs and DEALERs
    :data:`transport.zmqio.COPY_BELOW`: smaller frames are copied at send, larger ones
    lent to libzmq (pyzmq's default threshold elsewhere, e.g. the weights' publisher).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import zmq

from transport.curve import CurveConfig, WorkerAuthenticator, apply_curve_client, apply_curve_server
from transport.pump import DEFAULT_PEER_QUEUE_LIMIT, SocketPump
from transport.zmqio import COPY_BELOW, recv_frames, send_frames, tune_allocator, tune_malloc

__all__ = [
    "DEFAULT_HWM",
    "DEFAULT_MAX_MESSAGE_SIZE",
    "DEFAULT_PEER_QUEUE_LIMIT",
    "CurveConfig",
    "SocketPump",
    "WorkerAuthenticator",
    "apply_curve_client",
    "apply_curve_server",
    "bind_all",
    "make_dealer",
    "make_monitor",
    "make_pair",
    "make_router",
    "make_socket",
    "recv_frames",
    "send_frames",
    "tune_allocator",
    "tune_malloc",
]

#: High-water mark (messages): reached only when a peer stops reading.
DEFAULT_HWM = 100_000

#: Default limit of one message (all frames) on the fabric: 1 GiB.
DEFAULT_MAX_MESSAGE_SIZE = 1 << 30


def make_socket(
    zctx: zmq.Context[Any],
    kind: int,
    *,
    hwm: int | None = DEFAULT_HWM,
    max_message_size: int | None = DEFAULT_MAX_MESSAGE_SIZE,
    curve: CurveConfig | None = None,
    curve_server: bool = False,
    options: Mapping[int, int | bytes] | None = None,
) -> zmq.Socket[Any]:
    """A socket of ``kind`` (``zmq.PUB``, ``zmq.SUB``, ``zmq.PUSH``, ...) with linger 0.

    ``hwm`` (``None``: libzmq's) and ``max_message_size`` (``ZMQ_MAXMSGSIZE``, per
    frame; ``None``: no limit); ``curve`` keys, as the server (binds) with
    ``curve_server``; further ``options`` are set in order before any bind or connect.

    Examples
    --------
    >>> zctx = zmq.Context()
    >>> sub = make_socket(zctx, zmq.SUB, options={zmq.SUBSCRIBE: b""})
    >>> sub.linger
    0
    >>> sub.close(); zctx.term()
    """
    sock: zmq.Socket[Any] = zctx.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        if hwm is not None:
            sock.setsockopt(zmq.SNDHWM, hwm)
            sock.setsockopt(zmq.RCVHWM, hwm)
        if max_message_size is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_size)
        for option, value in (options or {}).items():
            sock.setsockopt(option, value)
        (apply_curve_server if curve_server else apply_curve_client)(sock, curve)
    except BaseException:
        sock.close(linger=0)  # or terminating its context would wait for it forever
        raise
    return sock


def bind_all(sock: zmq.Socket[Any], addresses: str | list[str]) -> list[str]:
    """Bind ``sock`` to each address; returns the bound endpoints (``tcp://host:0``
    binds a free port and reports which). Closes the socket if a bind fails."""
    endpoints = []
    try:
        for address in [addresses] if isinstance(addresses, str) else addresses:
            if address.startswith("tcp://") and address.endswith(":0"):
                address = address[:-2] + ":*"
            sock.bind(address)
            endpoints.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    except BaseException:
        sock.close(linger=0)
        raise
    return endpoints


def make_pair(zctx: zmq.Context[Any], address: str) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
    """A PAIR bound at ``address`` (``inproc://``) and a PAIR connected to it: a wake-up
    line into a thread that polls sockets. Returns ``(reader, writer)``."""
    reader = make_socket(zctx, zmq.PAIR, hwm=None, max_message_size=None)
    bind_all(reader, address)
    writer = make_socket(zctx, zmq.PAIR, hwm=None, max_message_size=None)
    writer.connect(address)
    return reader, writer


def make_monitor(sock: zmq.Socket[Any], events: int) -> zmq.Socket[Any]:
    """A PAIR receiving ``sock``'s monitor events (a ``zmq.EVENT_*`` mask), linger 0;
    close it before ``sock``."""
    mon: zmq.Socket[Any] = sock.get_monitor_socket(events)
    mon.setsockopt(zmq.LINGER, 0)
    return mon


def make_router(
    ctx: zmq.Context[Any],
    bind: str | list[str],
    *,
    hwm: int = DEFAULT_HWM,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    curve: CurveConfig | None = None,
) -> tuple[zmq.Socket[Any], list[str]]:
    """A worker's ROUTER, bound to each address; returns it and the bound endpoints."""
    # TCP keepalive catches half-open connections on real networks.
    options: dict[int, int | bytes] = {
        zmq.ROUTER_MANDATORY: 1, zmq.ROUTER_HANDOVER: 1, zmq.TCP_KEEPALIVE: 1
    }  # fmt: skip
    sock = make_socket(
        ctx, zmq.ROUTER, hwm=hwm, max_message_size=max_message_size, curve=curve,
        curve_server=True, options=options,
    )  # fmt: skip
    sock.copy_threshold = COPY_BELOW
    return sock, bind_all(sock, bind)


def make_dealer(
    ctx: zmq.Context[Any],
    address: str,
    *,
    hwm: int = DEFAULT_HWM,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    curve: CurveConfig | None = None,
    reconnect_ivl_ms: int = 100,
    routing_id: bytes | None = None,
) -> zmq.Socket[Any]:
    """A client's or controller's DEALER connected to one worker; ``routing_id`` (unique
    per peer, not starting with a zero byte) is kept across reconnects."""
    options: dict[int, int | bytes] = {} if routing_id is None else {zmq.ROUTING_ID: routing_id}
    options.update({
        zmq.IMMEDIATE: 1,
        zmq.RECONNECT_IVL: reconnect_ivl_ms,
        zmq.RECONNECT_IVL_MAX: max(reconnect_ivl_ms, 1000),
        zmq.TCP_KEEPALIVE: 1,
    })  # fmt: skip
    sock = make_socket(
        ctx, zmq.DEALER, hwm=hwm, max_message_size=max_message_size, curve=curve,
        options=options,
    )  # fmt: skip
    sock.copy_threshold = COPY_BELOW
    sock.connect(address)
    return sock
