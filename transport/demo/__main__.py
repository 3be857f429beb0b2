"""``python -m transport.demo``."""

import sys

from transport.demo.cli import main

sys.exit(main())
