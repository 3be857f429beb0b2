"""AReaL's ``ModelRequest`` / ``ModelResponse`` <-> fastio's ``LLMRequest`` / ``LLMResponse``:
the rid, prompt, sampling parameters and ``metadata`` cross; the tokenizer and processor
stay on AReaL's side; images, stop strings and beam search are refused (``ValueError``).
"""

from __future__ import annotations

from typing import Any

from fastio import GenerationHyperparameters, LLMRequest, LLMResponse

__all__ = ["max_new_tokens", "to_llm_request", "to_model_response"]

#: fastio's stop reasons -> AReaL's. An ``interrupt`` never reaches here (the client
#: completes interrupted requests); an ``abort`` that does is reported as AReaL's.
_STOP = {"stop": "stop", "length": "length", "abort": "abort", "interrupt": "abort"}


def max_new_tokens(req: Any) -> int:
    """AReaL's budget: ``max_new_tokens`` capped by ``max_tokens`` minus the prompt
    (``RuntimeError`` when nothing is left, as AReaL's remote engines raise)."""
    g = req.gconfig
    n = min(int(g.max_tokens) - len(req.input_ids), int(g.max_new_tokens))
    if n <= 0:
        raise RuntimeError(
            f"max_new_tokens ({n}) is non-positive! max_tokens={g.max_tokens}, "
            f"prompt_len={len(req.input_ids)}, max_new_tokens={g.max_new_tokens}."
        )
    return n


def to_llm_request(req: Any) -> LLMRequest:
    """An AReaL ``ModelRequest`` as a fastio :class:`~fastio.LLMRequest`; ``ValueError``
    for ``n_samples != 1``, images, stop strings, beam search or a parameter out of bounds."""
    g = req.gconfig
    if g.n_samples != 1:
        raise ValueError(
            "Inference engines do not support n_samples > 1. "
            "Please call generate multiple times with n_samples = 1."
        )
    if req.image_data:
        raise ValueError("image inputs (ModelRequest.image_data) are not carried by the fabric")
    if getattr(req, "vision_msg_vllm", None):
        raise ValueError("vision messages are not carried by the fabric")
    if g.stop:
        raise ValueError(
            f"stop strings {g.stop!r} are not supported over the fabric; use stop_token_ids"
        )
    if getattr(g, "use_beam_search", False):
        raise ValueError("beam search is not supported over the fabric")
    top_k = int(g.top_k)
    kw = {} if top_k <= 0 else {"top_k": top_k}  # AReaL (like SGLang) may spell "no top-k" -1
    try:
        gconfig = GenerationHyperparameters(
            n_samples=1,
            max_new_tokens=max_new_tokens(req),
            min_new_tokens=int(g.min_new_tokens),
            greedy=bool(g.greedy),
            top_p=float(g.top_p),
            temperature=float(g.temperature),
            # new_with_stop_and_pad_token_ids appends None for a tokenizer without pad.
            stop_token_ids=[int(t) for t in g.stop_token_ids if t is not None],
            **kw,
        )
        return LLMRequest(
            rid=str(req.rid),
            input_ids=req.input_ids,
            gconfig=gconfig,
            metadata=dict(req.metadata),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"ModelRequest {req.rid!r} cannot be sent: {exc}") from exc


def to_model_response(req: Any, resp: LLMResponse, response_cls: Any) -> Any:
    """``resp`` as AReaL's ``ModelResponse`` (``response_cls``; token fields as lists, as
    AReaL's workflows take them), each token with the version that produced it."""
    return response_cls(
        input_tokens=list(req.input_ids),
        input_images=req.image_data,
        output_tokens=resp.output_tokens.tolist(),
        output_logprobs=resp.output_logprobs.tolist(),
        output_versions=resp.output_versions.tolist(),
        stop_reason=_STOP.get(resp.stop_reason, resp.stop_reason),
        latency=resp.latency,
        ttft=resp.ttft,
        itl=resp.itl.tolist(),
        tokenizer=req.tokenizer,
        processor=req.processor,
    )
