"""The ``transformers`` side of the ``hf`` engine (:mod:`transport.hf_engine`).

Random-weight models of :data:`MODEL_SIZES` built from a config (nothing is
downloaded), ``from_pretrained`` on a local directory, the KV-cache accessors that hide
how the ``transformers`` version names its parts, and batched sampling with per-row
:class:`~fastio.GenerationHyperparameters`.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from typing import Any, Protocol

try:
    import torch
    from torch import nn
except ImportError as exc:  # name the extra that brings torch
    from fastio._optional import missing

    raise missing("torch", "hf", "the hf engine (transport.hf_model)") from exc

from fastio import GenerationHyperparameters
from fastio._optional import require

__all__ = ["MODEL_SIZES", "build_model", "load_pretrained", "model_config"]


class SampledRow(Protocol):
    """What :func:`sample_rows` reads of a sequence: its tokens so far, its stop tokens
    and its random generator."""

    @property
    def toks(self) -> list[int]: ...

    @property
    def stop_ids(self) -> Collection[int]: ...

    @property
    def gen(self) -> torch.Generator: ...


#: Size name -> config fields of the random-weight models (about 0.1M, 4M, 40M, 100M
#: parameters; vocabularies of 256, 4096 and 32000 tokens).
MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=176,
    ),
    "small": dict(
        vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=704,
    ),
    "medium": dict(
        vocab_size=32000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=1408,
    ),
    "large": dict(
        vocab_size=32000, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, intermediate_size=2816,
    ),
}  # fmt: skip

_ARCHS = ("llama", "qwen2")


def transformers_module() -> Any:
    return require("transformers", "hf", "the hf engine")


def model_config(size: str = "small", arch: str = "llama", max_len: int = 4096) -> Any:
    """The ``transformers`` config of a random-weight model of :data:`MODEL_SIZES`.

    Parameters
    ----------
    size:
        A key of :data:`MODEL_SIZES`.
    arch:
        ``"llama"`` (``LlamaConfig``) or ``"qwen2"`` (``Qwen2Config``, biased q/k/v).
    max_len:
        ``max_position_embeddings``: prompt plus output never exceed it.
    """
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {', '.join(MODEL_SIZES)}")
    if arch not in _ARCHS:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(_ARCHS)}")
    tf = transformers_module()
    cls = tf.LlamaConfig if arch == "llama" else tf.Qwen2Config
    fields = MODEL_SIZES[size]
    return cls(
        **fields,
        # Wider than the usual 0.02: with tied embeddings and small weights, the residual
        # stream dominates and greedy decoding just repeats the last token. At this scale
        # the random model's next-token distributions are peaked and varied, like text.
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
    """A causal LM of :data:`MODEL_SIZES` with random weights drawn from ``seed``.

    The same arguments give the same weights in every process (the trainer of the demo
    and its workers start equal this way), on this torch version.

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
    tf = transformers_module()
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} is not a directory (nothing is downloaded)")
    kwargs: dict[str, Any] = {"local_files_only": True}
    try:
        model: nn.Module = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except TypeError:  # transformers before 4.56 names it torch_dtype
        model = tf.AutoModelForCausalLM.from_pretrained(path, torch_dtype=dtype, **kwargs)
    return model.eval()


# -- the KV cache, whatever the transformers version calls its parts -------------------
def cache_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


def cache_set(cache: Any, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    if hasattr(cache, "layers"):
        for layer, (k, v) in zip(cache.layers, kv, strict=True):
            layer.keys, layer.values = k, v
    else:
        cache.key_cache[:] = [k for k, _ in kv]
        cache.value_cache[:] = [v for _, v in kv]


def left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    extra = width - t.shape[dim]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim)


def sample_rows(
    logits: torch.Tensor, gs: list[GenerationHyperparameters], seqs: Sequence[SampledRow]
) -> tuple[list[int], list[float]]:
    """Tokens and logprobs for a batch of rows, each with its own sampling parameters."""
    rows, vocab = logits.shape
    dev = logits.device
    for i, (g, s) in enumerate(zip(gs, seqs, strict=True)):
        if len(s.toks) < g.min_new_tokens and s.stop_ids:
            ban = [t for t in s.stop_ids if 0 <= t < vocab]
            if ban:
                logits[i, ban] = float("-inf")
    greedy = [g.greedy for g in gs]
    temps = torch.tensor(
        [1.0 if g.greedy else max(g.temperature, 1e-5) for g in gs], device=dev
    ).unsqueeze(1)
    scaled = logits / temps
    logp = torch.log_softmax(scaled, -1)
    toks = torch.argmax(logits, -1)
    sampled = [i for i in range(rows) if not greedy[i]]
    if sampled:
        idx = torch.tensor(sampled, device=dev)
        filt = scaled.index_select(0, idx)
        ks = [min(max(gs[i].top_k, 1), vocab) for i in sampled]
        if min(ks) < vocab:
            kth = torch.topk(filt, max(k for k in ks if k < vocab), -1).values
            pick = torch.tensor([k - 1 if k < vocab else 0 for k in ks], device=dev)
            thresh = kth.gather(1, pick.unsqueeze(1))
            thresh[torch.tensor([k >= vocab for k in ks], device=dev)] = float("-inf")
            filt = filt.masked_fill(filt < thresh, float("-inf"))
        ps = [max(gs[i].top_p, 1e-9) for i in sampled]  # top_p <= 0 keeps the argmax
        if min(ps) < 1.0:
            top_p = torch.tensor([p if p < 1.0 else 2.0 for p in ps], device=dev).unsqueeze(1)
            sorted_l, order = torch.sort(filt, descending=True)
            probs = torch.softmax(sorted_l, -1)
            drop = (probs.cumsum(-1) - probs) >= top_p  # keeps the first token past p
            filt = filt.scatter(1, order, sorted_l.masked_fill(drop, float("-inf")))
        cdf = torch.softmax(filt, -1).cumsum(-1)
        u = torch.cat([torch.rand(1, generator=seqs[i].gen) for i in sampled]).to(dev)
        u = u.unsqueeze(1) * cdf[:, -1:]
        # right=True never lands on a token of probability 0 (its cdf equals the previous).
        picked = torch.searchsorted(cdf, u, right=True).clamp(max=vocab - 1).squeeze(1)
        toks = toks.index_copy(0, idx, picked)
    chosen = logp.gather(1, toks.unsqueeze(1)).squeeze(1)
    return toks.tolist(), chosen.tolist()


def weight_left_linear(mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``mod(x)`` computed as ``(weight @ x.T).T``.

    ``F.linear`` asks BLAS for ``x @ weight.T`` (the weight transposed); with only a
    few rows in ``x`` (a decode step) MKL's sgemm runs that product several times
    slower than ``weight @ x.T``, which streams the row-major weight once.
    ``python -m bench.hf_engine`` compares both on a machine.
    """
    rows = x.reshape(-1, x.shape[-1])
    y = torch.mm(mod.weight, rows.t()).t()
    if mod.bias is not None:
        y = y + mod.bias
    return y.reshape(*x.shape[:-1], y.shape[-1])
