"""The weight protocol's core: the publisher's and the subscriber's state machines, with
no socket, thread or clock (``docs/weights.md``, "Three layers")."""
