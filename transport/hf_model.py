"""The ``transformers`` side of the ``hf`` engine: random-weight models of
:data:`MODEL_SIZES`, local ``from_pretrained``, the batched KV cache (:class:`KVBatch`)."""

from __future__ import annotations

import os
from typing import Any, Generic, TypeVar

try:
    import torch
    from torch import nn
except ImportError as exc:  # name the extra that brings torch
    from fastio._optional import missing

    raise missing("torch", "hf", "the hf engine (transport.hf_model)") from exc

from fastio._optional import require

T = TypeVar("T")

__all__ = ["MODEL_SIZES", "KVBatch", "build_model", "load_pretrained", "model_config"]


_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "intermediate_size")  # fmt: skip
#: Size name -> config fields of the random-weight models (about 0.1M, 4M, 40M, 100M
#: parameters; vocabularies of 256, 4096 and 32000 tokens).
MODEL_SIZES: dict[str, dict[str, int]] = {
    size: dict(zip(_FIELDS, values, strict=True))
    for size, values in {
        "tiny": (256, 64, 2, 4, 2, 176),
        "small": (4096, 256, 4, 4, 2, 704),
        "medium": (32000, 512, 4, 8, 4, 1408),
        "large": (32000, 1024, 4, 16, 4, 2816),
    }.items()
}

_ARCHS = ("llama", "qwen2")


def transformers_module() -> Any:
    return require("transformers", "hf", "the hf engine")


def model_config(size: str = "small", arch: str = "llama", max_len: int = 4096) -> Any:
    """The ``transformers`` config of a random-weight model of :data:`MODEL_SIZES`:
    ``arch`` ``"llama"`` or ``"qwen2"`` (biased q/k/v), a context of ``max_len`` tokens."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {', '.join(MODEL_SIZES)}")
    if arch not in _ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(_ARCHS)}")
    tf = transformers_module()
    cls = tf.LlamaConfig if arch == "llama" else tf.Qwen2Config
    fields = MODEL_SIZES[size]
    return cls(
        **fields,
        # Wider than the usual 0.02, which lets greedy decoding repeat the last token:
        # next-token distributions come out peaked and varied, like text.
        initializer_range=3.2 / fields["hidden_size"] ** 0.5,
        tie_word_embeddings=True,
        max_position_embeddings=max_len,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def build_model(
    size: str = "small",
    seed: int = 0,
    arch: str = "llama",
    dtype: torch.dtype = torch.float32,
    max_len: int = 4096,
) -> nn.Module:
    """A causal LM of :data:`MODEL_SIZES` with random weights drawn from ``seed``: the
    same in every process (on one torch version), so a trainer and its workers agree.

    >>> m = build_model("tiny", seed=1)
    >>> sum(p.numel() for p in m.parameters()) < 200_000
    True
    """
    tf = transformers_module()
    cfg = model_config(size, arch, max_len)
    cls = tf.LlamaForCausalLM if arch == "llama" else tf.Qwen2ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: nn.Module = cls(cfg)
    return model.to(dtype).eval()


def load_pretrained(path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` on a local directory (never downloads)."""
    auto = transformers_module().AutoModelForCausalLM
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is not a directory (nothing is downloaded)")
    try:
        model: nn.Module = auto.from_pretrained(path, dtype=dtype, local_files_only=True)
    except TypeError:  # transformers before 4.56 names it torch_dtype
        model = auto.from_pretrained(path, torch_dtype=dtype, local_files_only=True)
    return model.eval()


def _kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def _set_kv(cache: Any, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if hasattr(cache, "layers"):
        for layer, (k, v) in zip(cache.layers, kv, strict=True):
            layer.keys, layer.values = k, v
    else:
        cache.key_cache[:] = [k for k, _ in kv]
        cache.value_cache[:] = [v for _, v in kv]


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    pad = [0, 0] * (t.dim() - 1 - dim) + [max(0, width - t.shape[dim]), 0]
    return torch.nn.functional.pad(t, pad) if pad[-2] else t


class KVBatch(Generic[T]):
    """The running batch: its sequences (row order), their KV cache (left-padded) and
    attention mask ((rows, columns) int64, 0 on the padding)."""

    def __init__(self) -> None:
        self.seqs: list[T] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows``; drop the columns that became all padding."""
        if len(rows) == len(self.seqs):
            return
        self.seqs = [self.seqs[i] for i in rows]
        if not rows:
            self.cache = self.mask = None
            return
        assert self.mask is not None
        idx = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        first = int(mask.any(0).nonzero()[0])  # the first column any row still uses
        self.mask = mask[:, first:]
        kv = [(k.index_select(0, idx)[:, :, first:], v.index_select(0, idx)[:, :, first:])
              for k, v in _kv(self.cache)]  # fmt: skip
        _set_kv(self.cache, kv)

    def merge(self, seqs: list[T], cache: Any, mask: torch.Tensor) -> None:
        """Append rows prefilled on their own, left-padding the shorter side."""
        if not self.seqs:
            self.seqs, self.cache, self.mask = list(seqs), cache, mask
            return
        assert self.mask is not None
        w = max(self.mask.shape[1], mask.shape[1])
        self.mask = torch.cat([_left_pad(self.mask, w, 1), _left_pad(mask, w, 1)], 0)
        kv = [
            (torch.cat([_left_pad(k, w, 2), _left_pad(k2, w, 2)], 0),
             torch.cat([_left_pad(v, w, 2), _left_pad(v2, w, 2)], 0))
            for (k, v), (k2, v2) in zip(_kv(self.cache), _kv(cache), strict=True)
        ]  # fmt: skip
        _set_kv(self.cache, kv)
        self.seqs += seqs


def weight_left_linear(mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``mod(x)`` as ``(weight @ x.T).T``: the row-major weight streamed once (faster with MKL
    for a decode step's few rows; ``python -m bench.hf_engine``)."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.mm(mod.weight, rows.t()).t()
    if mod.bias is not None:
        y = y + mod.bias
    return y.reshape(*x.shape[:-1], y.shape[-1])
