"""``python -m transport.worker``."""

from transport.worker.cli import main

main()
