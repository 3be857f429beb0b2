"""The data link's old module name, deprecated: it is :mod:`transport.weights.routes.tcp`."""

import warnings

from transport.weights.routes.tcp import *  # noqa: F403
from transport.weights.routes.tcp import __all__ as __all__

warnings.warn(
    f"{__name__} is deprecated: import transport.weights.routes.tcp", DeprecationWarning, 2
)
