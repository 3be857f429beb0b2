"""``python -m transport.demo``."""

from transport.demo.cli import main

raise SystemExit(main())
