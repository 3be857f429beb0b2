"""Build the API reference from the docstrings: ``python docs/build_api.py [OUT]``.

Writes HTML (pdoc, from the ``dev`` extra) to ``docs/_build/api`` or ``OUT``. Fails
(exit 1) on every warning pdoc gives (a name in ``__all__`` that does not resolve, a
module that does not import, a broken docstring), so CI catches a broken reference.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The public modules, in the order of the index. A module added here must import with
#: the ``dev`` extra installed.
MODULES = [
    "fastio",
    "fastio.io_struct",
    "fastio.structs",
    "fastio.meta",
    "fastio.tokens",
    "fastio.codec",
    "fastio.encoder",
    "fastio.decoder",
    "fastio.errors",
    "fastio.protocol",
    "fastio.fabric_msgs",
    "fastio.weight_msgs",
    "fastio.ipc_msgs",
    "transport",
    "transport.client",
    "transport.worker",
    "transport.control",
    "transport.errors",
    "transport.sockets",
    "transport.pump",
    "transport.addresses",
    "transport.collector",
    "transport.counting",
    "transport.options",
    "transport.engines",
    "transport.engines.api",
    "transport.engines.registry",
    "transport.engines.http",
    "transport.engines.flight",
    "transport.engines.sglang",
    "transport.engines.vllm",
    "transport.engines.vllm_staging",
    "transport.engines.vllm_inproc",
    "transport.engine",
    "transport.hf_engine",
    "transport.generation",
    "transport.metrics",
    "transport.weights",
    "transport.weights.update",
    "transport.weights.publisher",
    "transport.weights.subscriber",
    "transport.weights.config",
    # A package without ``__all__``: pdoc adds its submodules (core.publisher,
    # core.subscriber, core.process); naming them again would warn.
    "transport.weights.core",
    "transport.weights.routes",
    "transport.weights.routes.shm",
    "transport.weights.routes.tcp",
    "transport.weights.routes.ipc",
    "transport.weights.routes.ipc_worker",
    "transport.weights.results",
    "transport.weights.errors",
    "transport.weights.bucket",
    "transport.weights.disk",
    "transport.weights.dist",
]

#: AReaL's rollout engine over the fabric: documented where the ``areal`` package is
#: installed (``.ci/areal.sh``), left out elsewhere (it imports ``areal``).
AREAL_MODULES = ["transport.areal", "transport.areal.engine"]
if importlib.util.find_spec("areal") is not None:
    MODULES += AREAL_MODULES


def _resolve_lazy_names() -> None:
    """Give pdoc the names a package imports on first use (``transport.WorkerServer``,
    ...): it reads a module's namespace, where they are missing until then."""
    for name in MODULES:
        module = importlib.import_module(name)
        for attr in getattr(module, "__all__", ()):
            if attr not in vars(module):
                setattr(module, attr, getattr(module, attr))


def main(argv: list[str]) -> int:
    out = Path(argv[1]) if len(argv) > 1 else ROOT / "docs" / "_build" / "api"
    sys.path.insert(0, str(ROOT))
    import pdoc
    import pdoc.render

    pdoc.render.configure(docformat="numpy", footer_text="fastio API reference")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _resolve_lazy_names()
        pdoc.pdoc(*MODULES, output_directory=out)
    # Only pdoc's own warnings judge the reference; libraries imported on the way
    # (torch, transformers) may warn about themselves.
    problems = [w for w in caught if "/pdoc/" in w.filename]
    for w in problems:
        print(f"{w.category.__name__}: {w.message}", file=sys.stderr)
    missing = [m for m in MODULES if not (out / (m.replace(".", "/") + ".html")).exists()]
    for m in missing:
        print(f"no page for {m}", file=sys.stderr)
    if problems or missing:
        print(
            f"API reference: {len(problems)} warnings, {len(missing)} pages missing",
            file=sys.stderr,
        )
        return 1
    print(f"API reference: {len(MODULES)} modules in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
