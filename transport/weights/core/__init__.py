"""The weight protocol's core: the publisher's and the subscriber's state machines, with
no socket, thread or clock (the sans-I/O style of h11). Every rule of ``docs/PROTOCOL.md``,
"Weight updates", on who may answer, what a worker reports and when a buffer may be
reused lives here, tested without a socket (``tests/transport/weights/core/test_core.py``).
"""
