"""fastio's messages as JSON: :func:`to_builtins`, :func:`to_json` and the ``enc_hook``
behind them for msgspec's own encoders."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from fastio import _ext
from fastio.tokens import TokenArray

__all__ = ["enc_hook", "to_builtins", "to_json"]


def enc_hook(obj: Any) -> Any:
    """``enc_hook`` for msgspec's other encoders: arrays and tensors as lists, numpy
    scalars as numbers, PIL images as ``data:image/png;base64,...`` URLs, tokenizers and
    processors as their ``name_or_path``: ``msgspec.json.encode(msg, enc_hook=enc_hook)``."""
    if isinstance(obj, (TokenArray, np.ndarray, np.generic)) or _ext.is_tensor(obj):
        return obj.tolist()
    if _ext.is_pil_image(obj):
        import base64
        import io

        out = io.BytesIO()
        obj.save(out, format="PNG")
        return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    name = getattr(obj, "name_or_path", None)
    if isinstance(name, str):
        return name
    raise NotImplementedError(f"fastio.enc_hook cannot convert {type(obj).__qualname__}")


def _named(obj: Any) -> Any:
    # Every Struct at any depth as a dict (msgspec.structs.asdict is shallow).
    if isinstance(obj, msgspec.Struct):
        return {f: _named(getattr(obj, f)) for f in obj.__struct_fields__}
    if isinstance(obj, dict):
        return {k: _named(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_named(v) for v in obj]
    return obj


def to_builtins(obj: Any) -> Any:
    """A message (or value holding messages) as JSON-ready builtins: Structs as dicts,
    arrays as lists, ``bytes`` base64, images data URLs (one way, for logs)."""
    return msgspec.to_builtins(_named(obj), enc_hook=enc_hook)


def to_json(obj: Any) -> bytes:
    """:func:`to_builtins` encoded as one line of JSON (UTF-8 ``bytes``, no newline).

    >>> json.loads(fastio.to_json(fastio.LLMRequest(input_ids=[1, 2])))["input_ids"]
    [1, 2]
    """
    return msgspec.json.encode(to_builtins(obj))
