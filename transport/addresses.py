"""Host names in ``tcp://`` addresses: a name that does not resolve is said as such
(ZeroMQ only retries), and wildcard hosts are replaced by an address a peer can reach."""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import threading

from transport.errors import BadAddress

__all__ = [
    "check_address", "resolve_problem", "tcp_host", "warn_if_unresolvable", "with_reachable_host",
]  # fmt: skip

_WILDCARDS = frozenset({"*", "0.0.0.0", "::", "[::]"})
_SCHEMES = ("tcp", "ipc", "inproc")
_ADDRESS = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)", re.DOTALL)


def check_address(address: str, *, bind: bool = False) -> str:
    """``address`` if a peer can connect to it (``bind``: a socket can bind it, port 0 or
    ``*`` and host ``*`` allowed), else :class:`~transport.errors.BadAddress` saying why.

    >>> check_address("tcp://127.0.0.1:0", bind=True)
    'tcp://127.0.0.1:0'
    """
    what = "bind address" if bind else "worker address"
    if not isinstance(address, str):
        raise BadAddress(f"{what} must be a str, got {type(address).__name__}")
    m = _ADDRESS.fullmatch(address)
    scheme, rest = m.groups() if m is not None else ("", "")
    host, sep, port = rest.rpartition(":")
    lowest = 0 if bind else 1
    why = ""
    if m is None:
        why = " has no scheme: expected tcp://host:port, ipc://path or inproc://name"
    elif scheme not in _SCHEMES:
        why = f": transport {scheme!r} is not supported (use one of {', '.join(_SCHEMES)})"
    elif not rest:
        why = f" names no endpoint after {scheme}://"
    elif scheme == "tcp" and (not sep or not host):
        why = " needs a port: tcp://host:port"
    elif scheme == "tcp" and host == "*" and not bind:
        why = ": '*' binds, a client needs a host"
    elif (
        scheme == "tcp"
        and not (bind and port == "*")
        and not (port.isdigit() and lowest <= int(port) < 65536)
    ):
        why = f": port {port!r} is not a number in {lowest}-65535"
    if why:
        raise BadAddress(f"{what} {address!r}{why}")
    return address


def tcp_host(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``tcp://host:port`` address whose host is a name to look up;
    None for other schemes, IP literals, wildcards, interface names, bracketed IPv6.

    >>> tcp_host("tcp://trainer:5600"), tcp_host("tcp://127.0.0.1:5600"), tcp_host("ipc://x")
    (('trainer', 5600), None, None)
    """
    host, sep, port = address.removeprefix("tcp://").rpartition(":")
    if not address.startswith("tcp://") or not sep or not port.isdigit():
        return None
    if not host or host in _WILDCARDS or host.startswith("[") or ";" in host:
        return None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host, int(port)
    return None


def resolve_problem(address: str) -> str:
    """``"cannot resolve host 'NAME' (reason)"``, or ``""`` when it resolves or there is
    no name; blocks on the system resolver (call it off any event loop)."""
    hp = tcp_host(address)
    if hp is None:
        return ""
    try:
        socket.getaddrinfo(*hp, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"cannot resolve host {hp[0]!r} ({exc.strerror or exc})"
    except OSError:  # anything else from the resolver is not a verdict on the name
        pass
    return ""


def warn_if_unresolvable(address: str, log: logging.Logger, what: str) -> None:
    """Check ``address``'s host name on a daemon thread; log one WARNING if it does not
    resolve (ZeroMQ keeps retrying; the name may appear later)."""
    if tcp_host(address) is None:
        return

    def check() -> None:
        if problem := resolve_problem(address):
            log.warning("%s %s: %s; retrying until it does", what, address, problem)

    threading.Thread(target=check, name="fastio-resolve", daemon=True).start()


def with_reachable_host(advertised: str, reached: str) -> str:
    """``advertised`` (an endpoint a peer reported) with a wildcard host replaced by the
    host of ``reached``, where this side already reached that peer.

    >>> with_reachable_host("tcp://0.0.0.0:7001", "tcp://trainer:7000")
    'tcp://trainer:7001'
    >>> with_reachable_host("tcp://10.0.0.5:7001", "tcp://trainer:7000")
    'tcp://10.0.0.5:7001'
    """
    if not (advertised.startswith("tcp://") and reached.startswith("tcp://")):
        return advertised
    host, sep, port = advertised[len("tcp://") :].rpartition(":")
    reached_host = reached[len("tcp://") :].rpartition(":")[0]
    if not sep or host not in _WILDCARDS or not reached_host or reached_host in _WILDCARDS:
        return advertised
    return f"tcp://{reached_host}:{port}"
