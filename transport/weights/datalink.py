"""The data link's old module name: it is :mod:`transport.weights.routes.tcp`."""

from transport.weights.routes.tcp import (
    PIECE,
    DataLinkError,
    DataListener,
    DataReceiver,
    DataSender,
    Piece,
    connect,
    worker_token,
)

__all__ = [
    "PIECE",
    "DataLinkError",
    "DataListener",
    "DataReceiver",
    "DataSender",
    "Piece",
    "connect",
    "worker_token",
]
