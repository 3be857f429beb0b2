"""Imports of optional dependencies that name the extra to install when missing."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["install_hint", "lazy", "missing", "require"]


def install_hint(extra: str) -> str:
    """The command that installs fastio's ``extra``, from an index and from a checkout."""
    return f"pip install 'fastio[{extra}]' (from a checkout: pip install '.[{extra}]')"


def missing(module: str, extra: str, purpose: str = "") -> ImportError:
    """The ImportError for a missing optional ``module``, naming what needs it."""
    what = f"{purpose} needs " if purpose else ""
    return ImportError(
        f"{what}{module!r}, which is not installed: {install_hint(extra)}", name=module
    )


def require(module: str, extra: str, purpose: str = "") -> ModuleType:
    """Import ``module`` or raise an ImportError that says which fastio extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise missing(module, extra, purpose) from exc


class lazy(ModuleType):
    """A module imported (or its extra named) on first attribute access, replacing
    itself in ``namespace``: ``torch = lazy("torch", "torch", "buckets", globals())``."""

    def __init__(self, module: str, extra: str, purpose: str, namespace: dict[str, Any]) -> None:
        super().__init__(module)
        self._spec = (module, extra, purpose, namespace)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):  # copy, pickle and inspect probe dunders: stay lazy
            raise AttributeError(attr)
        module, extra, purpose, namespace = self._spec
        real = require(module, extra, purpose)
        for key, value in list(namespace.items()):
            if value is self:
                namespace[key] = real
        return getattr(real, attr)
