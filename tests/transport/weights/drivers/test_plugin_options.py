"""The worker plugin's options: a bad key or value is refused with one line naming it."""

from __future__ import annotations

from typing import Any

import pytest
import torch


# -- 6. the worker plugin's options -------------------------------------------------------
class _Server:
    worker_id = "w"
    paused = False
    pause_requests = 0

    def __init__(self) -> None:
        self.on_resume: list[Any] = []
        self.on_pause: list[Any] = []
        self.engine = type("E", (), {"model": torch.nn.Linear(2, 2), "version": 0})()


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({}, "weights_endpoint"),
        ({"weights_endpoint": "tcp://127.0.0.1:1", "weigths_shm": "0"}, "weigths_shm"),
        ({"weights_endpoint": "tcp://127.0.0.1:1", "weights_dtype": "float7"}, "float7"),
        ({"weights_endpoint": "tcp://127.0.0.1:1", "weights_loader": "nomodule"}, "loader"),
    ],
)
def test_the_plugin_refuses_bad_options(opts: dict[str, str], match: str) -> None:
    import asyncio

    from transport.weights.update import subscribe

    with pytest.raises(ValueError, match=match):
        asyncio.run(asyncio.wait_for(subscribe(_Server(), opts), 10))
