"""The packages' public names: ``__all__`` complete, sorted and importable."""

from __future__ import annotations

import importlib
import inspect

import pytest

import fastio

FASTIO_MODULES = ["fastio.codec", "fastio.errors", "fastio.io_struct", "fastio.tokens"]


def isort_key(name: str) -> tuple[int, str]:
    """ruff's RUF022 order: SCREAMING_CASE, then CamelCase, then the rest."""
    if name.isupper():
        return 0, name
    if name[0].isupper():
        return 1, name
    return 2, name


def is_sorted(names: list[str]) -> bool:
    return list(names) == sorted(names, key=isort_key)


def own_public_names(pkg: object, prefix: str) -> set[str]:
    """Public attributes defined in the package (not imported helpers like Any)."""
    out = set()
    for n in dir(pkg):
        obj = getattr(pkg, n)
        if n.startswith("_") or inspect.ismodule(obj):
            continue
        module = getattr(obj, "__module__", None)
        if module is None or module.startswith(prefix) or not callable(obj):
            out.add(n)
    return out


def test_fastio_all_is_sorted_and_unique() -> None:
    assert is_sorted(fastio.__all__)
    assert len(set(fastio.__all__)) == len(fastio.__all__)


def test_fastio_all_resolves() -> None:
    for name in fastio.__all__:
        assert hasattr(fastio, name), name


def test_fastio_all_is_complete() -> None:
    aliases = {"Frame", "Message"}  # typing aliases: their __module__ is "typing"
    assert own_public_names(fastio, "fastio") | aliases == set(fastio.__all__) - {"__version__"}


@pytest.mark.parametrize("module", FASTIO_MODULES)
def test_fastio_submodule_names_are_exported(module: str) -> None:
    mod = importlib.import_module(module)
    assert is_sorted(mod.__all__)
    for name in mod.__all__:
        assert getattr(fastio, name) is getattr(mod, name), f"{module}.{name} not re-exported"


def test_fastio_protocol_constants_exported() -> None:
    from fastio import protocol

    assert is_sorted(protocol.__all__)
    for name in ("PROTOCOL_VERSION", "ExtCode", "MsgKind"):
        assert getattr(fastio, name) is getattr(protocol, name)


@pytest.mark.parametrize("package", ["transport", "transport.weights"])
def test_transport_all_complete_and_sorted(package: str) -> None:
    transport = importlib.import_module(package)
    names = transport.__all__
    assert is_sorted(names) and len(set(names)) == len(names)
    for name in names:
        assert getattr(transport, name) is not None, name
    lazy = getattr(transport, "_LAZY", {})
    public = own_public_names(transport, package) - {"TYPE_CHECKING"}
    assert public | set(lazy) == set(names)
