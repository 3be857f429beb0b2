"""The data link's old module name: it is :mod:`transport.weights.routes.tcp`."""

from transport.weights.routes.tcp import *  # noqa: F403
from transport.weights.routes.tcp import __all__ as __all__
