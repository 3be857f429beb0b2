"""Fake SGLang and vLLM HTTP servers, written from those servers' public API docs, run as
real processes on 127.0.0.1 (see :mod:`tests.transport.fakes.common`)."""
