"""Imports of optional dependencies that name the extra to install when missing."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, extra: str, purpose: str = "") -> ModuleType:
    """Import ``module`` or raise an ImportError that says which fastio extra provides it.

    >>> require("json", "none").__name__
    'json'
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        what = f"{purpose} needs " if purpose else ""
        raise ImportError(
            f"{what}{module!r}, which is not installed: pip install 'fastio[{extra}]'"
        ) from exc
