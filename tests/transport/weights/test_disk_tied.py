"""save_weights of a model with tied weights (one tensor under two names)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.transport.weights.helpers import equal


# -- 3. tied weights on disk --------------------------------------------------------------
class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight


def test_save_weights_of_tied_weights(tmp_path: Path) -> None:
    from transport.weights.disk import load_weights, save_weights

    torch.manual_seed(0)
    src = Tied()
    path = save_weights(tmp_path, src, 1)
    dst = Tied()
    torch.nn.init.zeros_(dst.embed.weight)
    assert load_weights(tmp_path, dst) == 1
    assert equal(dict(dst.state_dict()), dict(src.state_dict()))
    # a worker whose model is not tied gets both names
    untied = {k: torch.zeros_like(v) for k, v in src.state_dict().items()}
    load_weights(tmp_path, untied)
    assert equal(untied, dict(src.state_dict()))
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == ["embed.weight", "mid.bias", "mid.weight"]  # once
