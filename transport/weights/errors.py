"""Exceptions of :mod:`transport.weights`, all under :class:`WeightUpdateError` (itself a
``TransportError`` and a ``fastio.FastioError``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastio.errors import FastioError
from transport.errors import TransportError

if TYPE_CHECKING:
    from transport.weights.results import UpdateResult

__all__ = [
    "ChecksumError",
    "UpdateIncomplete",
    "VersionUnavailable",
    "WeightMismatchError",
    "WeightUpdateError",
]


class WeightUpdateError(TransportError, FastioError):
    """Root of the weight-update errors."""


class WeightMismatchError(WeightUpdateError, ValueError):
    """An update's parameter names, shapes or dtypes do not match the model."""


class ChecksumError(WeightUpdateError, ValueError):
    """A bucket's bytes do not match the checksum announced for it."""


class VersionUnavailable(WeightUpdateError):
    """The publisher has retired the version asked for (a newer one replaced it)."""


class UpdateIncomplete(WeightUpdateError, TimeoutError):
    """Not every expected worker applied the version before the timeout; ``result`` is
    the :class:`~transport.weights.results.UpdateResult` (applied, failed, missing)."""

    def __init__(self, message: str, result: UpdateResult) -> None:
        super().__init__(message)
        self.result = result
