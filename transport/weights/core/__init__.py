"""The weight protocol's core: state machines with no I/O (the sans-I/O style of h11).

:class:`~transport.weights.core.publisher.PublisherCore` and
:class:`~transport.weights.core.subscriber.SubscriberCore` take messages and the time
and return what to do (no socket, thread or clock); every rule of the weights section
of ``docs/PROTOCOL.md`` on who may answer, what a worker reports and when a buffer may
be reused lives here, tested without a socket (``tests/transport/test_weights_core.py``).
"""
