"""CurveZMQ for fabric and weight sockets (optional, off by default): keys from
``zmq.auth`` certificate files, and the worker-side ZAP handler that admits only the
keys of ``authorized_clients_dir`` and logs and counts every refusal."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

__all__ = ["CurveConfig", "WorkerAuthenticator", "apply_curve_client", "apply_curve_server"]

log = logging.getLogger("transport.sockets")


@dataclass(frozen=True)
class CurveConfig:
    """CurveZMQ keys, as certificate files written by ``zmq.auth.create_certificates``.

    Parameters
    ----------
    secret_key_file:
        This side's ``.key_secret`` certificate (holds its public and secret key).
    server_public_key_file:
        Client and controller side: the worker's ``.key`` (public) certificate.
    authorized_clients_dir:
        Worker side: a directory of client ``.key`` certificates that may connect.
        ``None`` encrypts but admits any client that knows the server key.

    Examples
    --------
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
    """Make ``sock`` a CURVE server (nothing when ``curve`` is ``None``); before binding."""
    if curve is None:
        return
    sock.curve_publickey, sock.curve_secretkey = _own_keys(curve)
    sock.curve_server = True


def apply_curve_client(sock: zmq.Socket[Any], curve: CurveConfig | None) -> None:
    """Make ``sock`` a CURVE client of ``curve``'s server (nothing when ``None``); before
    connecting."""
    if curve is None:
        return
    if curve.server_public_key_file is None:
        raise ValueError("CurveConfig.server_public_key_file is needed to connect")
    pub, sec = _own_keys(curve)
    server_pub, _ = zmq.auth.load_certificate(curve.server_public_key_file)
    sock.curve_secretkey = sec
    sock.curve_publickey = pub
    sock.curve_serverkey = server_pub


class WorkerAuthenticator:
    """A worker's ZAP handler (``zmq.auth``'s thread; start it before binding): admits
    the keys of ``authorized_clients_dir`` (any when ``None``), counts refusals."""

    def __init__(self, ctx: zmq.Context[Any], curve: CurveConfig) -> None:
        self.denied = 0
        self._lock = threading.Lock()
        self._allowed: set[bytes] | None = None
        if curve.authorized_clients_dir is not None:
            d = Path(curve.authorized_clients_dir)
            if not d.is_dir():
                raise ValueError(f"authorized_clients_dir {d} is not a directory")
            self._allowed = set(zmq.auth.load_certificates(str(d)))
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("transport.auth"))
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, key: bytes) -> bool:
        """``zmq.auth`` credentials-provider hook: is ``key`` (z85 public key) admitted?"""
        if self._allowed is None or key in self._allowed:
            return True
        with self._lock:
            self.denied += 1
        log.warning("refused CURVE client key %s (not in authorized_clients_dir)", key[:12])
        return False

    def stop(self) -> None:
        """Stop the authenticator thread."""
        self._auth.stop()
