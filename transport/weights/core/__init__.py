"""The weight protocol's core: state machines with no I/O (the sans-I/O style of h11).

:class:`~transport.weights.core.publisher.PublisherCore` and
:class:`~transport.weights.core.subscriber.SubscriberCore` take messages and the time
and return what to do; they open no socket, start no thread and read no clock. Every
rule of the weights section of ``docs/PROTOCOL.md`` that decides who may answer, what
a worker reports and when a buffer may be reused is decided here and tested without a
socket (``tests/transport/test_weights_core.py``). The drivers
(:class:`~transport.weights.WeightPublisher`, :class:`~transport.weights.WeightSubscriber`)
run them on sockets and threads.
"""
