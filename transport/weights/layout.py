"""The layout of a version (dtype names, checksums, plans), now in
:mod:`transport.weights.bucket`; kept for the modules that import it from here."""

from transport.weights.bucket import *  # noqa: F403
from transport.weights.bucket import __all__ as __all__
from transport.weights.bucket import _align as _align
from transport.weights.bucket import _numel as _numel
