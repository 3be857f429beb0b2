"""Exceptions of :mod:`transport.weights`, all under :class:`WeightUpdateError` (itself a
``TransportError`` and a ``fastio.FastioError``)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from fastio.errors import FastioError
from transport.errors import TransportError

if TYPE_CHECKING:
    from transport.weights.results import UpdateResult

__all__ = ["UpdateIncomplete", "WeightMismatchError", "WeightUpdateError"]


class WeightUpdateError(TransportError, FastioError):
    """Root of the weight-update errors."""


class WeightMismatchError(WeightUpdateError, ValueError):
    """An update's parameter names, shapes or dtypes do not match the model."""


class UpdateIncomplete(WeightUpdateError, TimeoutError):
    """Not every expected worker applied the version before the timeout; ``result``: the
    :class:`~transport.weights.results.UpdateResult`."""

    def __init__(self, message: str, result: UpdateResult) -> None:
        super().__init__(message)
        self.result = result


# Deprecated, never raised (a failed version is in UpdateResult.failed): served by
# __getattr__ with a warning.
_DEPRECATED: dict[str, type[WeightUpdateError]] = {
    n: type(n, (WeightUpdateError, *more), {"__doc__": "Deprecated, never raised."})
    for n, more in (("ChecksumError", (ValueError,)), ("VersionUnavailable", ()))
}


def deprecated(name: str, stacklevel: int = 3) -> type[WeightUpdateError]:
    """The deprecated error class ``name``, with a ``DeprecationWarning``."""
    warnings.warn(
        f"transport.weights.{name} is deprecated and never raised: a version that fails "
        "on a worker is reported in UpdateResult.failed",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return _DEPRECATED[name]


def __getattr__(name: str) -> Any:
    if name in _DEPRECATED:
        return deprecated(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
