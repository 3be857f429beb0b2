"""Every socket of the fabric and the weights is made here, its options chosen once (each
and why: ``docs/PROTOCOL.md``, "Socket options"); CurveZMQ keys and the worker's ZAP handler."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from transport.addresses import check_address
from transport.pump import DEFAULT_PEER_QUEUE_LIMIT, SocketPump
from transport.zmqio import COPY_BELOW, recv_frames, send_frames, tune_allocator, tune_malloc

__all__ = [
    "DEFAULT_HWM", "DEFAULT_MAX_MESSAGE_SIZE", "DEFAULT_PEER_QUEUE_LIMIT", "FRAME_CAP",
    "CurveConfig", "SocketPump", "WorkerAuthenticator", "apply_curve_client",
    "apply_curve_server", "bind_all", "make_dealer", "make_monitor", "make_pair", "make_router",
    "make_socket", "recv_frames", "send_frames", "tune_allocator", "tune_malloc",
]  # fmt: skip

log = logging.getLogger("transport.sockets")

#: High-water mark (messages): reached only when a peer stops reading.
DEFAULT_HWM = 100_000
#: Default limit of one message (all frames) on the fabric: 1 GiB.
DEFAULT_MAX_MESSAGE_SIZE = 1 << 30


@dataclass(frozen=True)
class CurveConfig:
    """CurveZMQ keys, as certificate files written by ``zmq.auth.create_certificates``:
    ``secret_key_file``, this side's ``.key_secret`` certificate; ``server_public_key_file``
    (client and controller side), the worker's ``.key`` certificate;
    ``authorized_clients_dir`` (worker side), a directory of the client ``.key``
    certificates it admits (``None``: any client that knows the server key).

    >>> import zmq.auth, tempfile
    >>> pub, sec = zmq.auth.create_certificates(tempfile.mkdtemp(), "worker")
    >>> worker_side = CurveConfig(secret_key_file=sec)
    """

    secret_key_file: str
    server_public_key_file: str | None = None
    authorized_clients_dir: str | None = None


def _own_keys(curve: CurveConfig) -> tuple[bytes, bytes]:
    pub, sec = zmq.auth.load_certificate(curve.secret_key_file)
    if sec is None:
        raise ValueError(f"{curve.secret_key_file} holds no secret key")
    return pub, sec


def apply_curve_server(sock: zmq.Socket[Any], curve: CurveConfig | None) -> None:
    """Make ``sock`` a CURVE server (nothing when ``curve`` is ``None``)."""
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey = _own_keys(curve)
        sock.curve_server = True


def apply_curve_client(sock: zmq.Socket[Any], curve: CurveConfig | None) -> None:
    """Make ``sock`` a CURVE client of ``curve``'s server (nothing when ``None``)."""
    if curve is None:
        return
    if curve.server_public_key_file is None:
        raise ValueError("CurveConfig.server_public_key_file is needed to connect")
    sock.curve_publickey, sock.curve_secretkey = _own_keys(curve)
    sock.curve_serverkey = zmq.auth.load_certificate(curve.server_public_key_file)[0]


class WorkerAuthenticator:
    """A worker's ZAP handler (``zmq.auth``'s thread; start it before binding): admits
    the keys of ``authorized_clients_dir`` (any when ``None``), counts refusals."""

    def __init__(self, zctx: zmq.Context[Any], curve: CurveConfig) -> None:
        self.denied = 0  # written by the authenticator's thread only
        self._allowed: set[bytes] | None = None
        if curve.authorized_clients_dir is not None:
            d = Path(curve.authorized_clients_dir)
            if not d.is_dir():
                raise ValueError(f"authorized_clients_dir {d} is not a directory")
            self._allowed = set(zmq.auth.load_certificates(str(d)))
        self._auth = ThreadAuthenticator(zctx, log=logging.getLogger("transport.auth"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """``zmq.auth``'s hook: is ``key`` (z85 public key) admitted?"""
        if self._allowed is None or key in self._allowed:
            return True
        self.denied += 1
        log.warning("refused CURVE client key %s (not in authorized_clients_dir)", key[:12])
        return False

    def stop(self) -> None:
        """Stop the authenticator thread."""
        self._auth.stop()


#: libzmq drops a frame over this many times a socket's ``max_message_size`` (silently, with
#: the connection); a larger message under it reaches the decoder, which answers it
#: ``TOO_LARGE`` / :class:`fastio.MessageTooLarge`.
FRAME_CAP = 2


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

    ``hwm`` (``None``: libzmq's) and ``max_message_size`` (the decoder's limit: libzmq
    drops a frame over :data:`FRAME_CAP` times it, with its connection, and the decoder
    answers a message under that it refuses; ``None``: no limit); ``curve`` keys, as the
    server (binds) with
    ``curve_server``; further ``options`` are set in order before any bind or connect.

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
            sock.setsockopt(zmq.MAXMSGSIZE, min(FRAME_CAP * max_message_size, 2**63 - 1))
        for option, value in (options or {}).items():
            sock.setsockopt(option, value)
        (apply_curve_server if curve_server else apply_curve_client)(sock, curve)
    except BaseException:
        sock.close(linger=0)  # or terminating its context would wait for it forever
        raise
    return sock


def bind_all(sock: zmq.Socket[Any], addresses: str | list[str]) -> list[str]:
    """Bind ``sock`` to each address; returns the bound endpoints (``tcp://host:0``
    binds a free port and reports which). Closes the socket if a bind fails (``BadAddress``
    for an address that cannot be bound)."""
    endpoints = []
    try:
        for address in [addresses] if isinstance(addresses, str) else addresses:
            check_address(address, bind=True)
            if address.startswith("tcp://") and address.endswith(":0"):
                address = address[:-2] + ":*"
            sock.bind(address)
            endpoints.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    except BaseException:
        sock.close(linger=0)
        raise
    return endpoints


def make_pair(zctx: zmq.Context[Any], address: str) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
    """``(reader, writer)``: PAIRs bound and connected at ``address`` (``inproc://``)."""
    reader = make_socket(zctx, zmq.PAIR, hwm=None, max_message_size=None)
    bind_all(reader, address)
    writer = make_socket(zctx, zmq.PAIR, hwm=None, max_message_size=None)
    writer.connect(address)
    return reader, writer


def make_monitor(sock: zmq.Socket[Any], events: int) -> zmq.Socket[Any]:
    """A PAIR receiving ``sock``'s monitor events (``zmq.EVENT_*`` mask); close it first."""
    mon: zmq.Socket[Any] = sock.get_monitor_socket(events)
    mon.setsockopt(zmq.LINGER, 0)
    return mon


def make_router(
    zctx: zmq.Context[Any],
    bind: str | list[str],
    *,
    hwm: int = DEFAULT_HWM,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    curve: CurveConfig | None = None,
) -> tuple[zmq.Socket[Any], list[str]]:
    """A worker's ROUTER, bound to each address; returns it and the bound endpoints."""
    options: dict[int, int | bytes] = {zmq.ROUTER_MANDATORY: 1, zmq.ROUTER_HANDOVER: 1}
    options[zmq.TCP_KEEPALIVE] = 1  # catches half-open connections
    sock = make_socket(
        zctx, zmq.ROUTER, hwm=hwm, max_message_size=max_message_size, curve=curve,
        curve_server=True, options=options,
    )  # fmt: skip
    sock.copy_threshold = COPY_BELOW
    return sock, bind_all(sock, bind)


def make_dealer(
    zctx: zmq.Context[Any],
    address: str,
    *,
    hwm: int = DEFAULT_HWM,
    max_message_size: int | None = DEFAULT_MAX_MESSAGE_SIZE,
    curve: CurveConfig | None = None,
    reconnect_ivl_ms: int = 100,
    routing_id: bytes | None = None,
) -> zmq.Socket[Any]:
    """A client's or controller's DEALER connected to one worker; ``routing_id`` (unique
    per peer, not starting with a zero byte) is kept across reconnects."""
    options: dict[int, int | bytes] = {zmq.IMMEDIATE: 1, zmq.TCP_KEEPALIVE: 1}
    options[zmq.RECONNECT_IVL] = reconnect_ivl_ms
    options[zmq.RECONNECT_IVL_MAX] = max(reconnect_ivl_ms, 1000)
    if routing_id is not None:
        options[zmq.ROUTING_ID] = routing_id
    sock = make_socket(
        zctx, zmq.DEALER, hwm=hwm, max_message_size=max_message_size, curve=curve,
        options=options,
    )  # fmt: skip
    sock.copy_threshold = COPY_BELOW
    sock.connect(address)
    return sock
