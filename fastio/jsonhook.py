"""``enc_hook`` for msgspec's JSON encoder and ``to_builtins``: fastio's values as
JSON-ready builtins."""

from __future__ import annotations

from typing import Any

import numpy as np

from fastio._ext import _is_pil_image, _is_tensor
from fastio.tokens import TokenArray

__all__ = ["enc_hook"]


def enc_hook(obj: Any) -> Any:
    """``enc_hook`` for msgspec's other encoders: fastio's values as JSON-ready builtins.

    ``TokenArray`` and numpy arrays become lists, numpy scalars Python numbers, torch
    tensors nested lists, PIL images ``data:image/png;base64,...`` URLs (what SGLang
    accepts as ``image_data``), tokenizers and processors their ``name_or_path``.

    Examples
    --------
    >>> import msgspec, fastio
    >>> resp = fastio.LLMResponse(output_tokens=[5, 6], latency=0.5, ttft=0.1)
    >>> msgspec.json.encode(resp, enc_hook=fastio.enc_hook)[:24]
    b'[3,[],[5,6],[],[],"stop"'
    >>> msgspec.to_builtins(msgspec.structs.asdict(resp), enc_hook=fastio.enc_hook)["output_tokens"]
    [5, 6]
    """
    if isinstance(obj, TokenArray):
        return obj.tolist()
    if isinstance(obj, (np.ndarray, np.generic)):
        return obj.tolist()
    if _is_tensor(obj):
        return obj.tolist()
    if _is_pil_image(obj):
        import base64
        import io

        out = io.BytesIO()
        obj.save(out, format="PNG")
        return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    name = getattr(obj, "name_or_path", None)
    if isinstance(name, str):
        return name
    raise NotImplementedError(f"fastio.enc_hook cannot convert {type(obj).__qualname__}")
