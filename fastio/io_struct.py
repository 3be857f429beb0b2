"""The seed's types (AReaL's ``io_struct``) as msgspec Structs: requests and responses
here, metadata from :mod:`fastio.meta`. Token fields are :class:`~fastio.tokens.TokenArray`;
constraints are checked on construction and decode (``docs/PROTOCOL.md``, "Structs")."""

from __future__ import annotations

import operator
import types
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import msgspec
import msgspec.inspect as mi
import numpy as np

from fastio.meta import (
    AllocationMode,
    AllocationType,
    FinetuneSpec,
    ParamSpec,
    RolloutStat,
    SaveLoadMeta,
    SaverConfig,
    WeightUpdateMeta,
)
from fastio.protocol import MsgKind
from fastio.structs import (
    _INT_DTYPES,
    _NUM_DTYPES,
    _TA,
    WireStruct,
    _CheckedMeta,
    _Tokens,
    _tokens,
)
from fastio.tokens import TokenArray

__all__ = [
    "MAX_NEW_TOKENS", "AllocationMode", "AllocationType", "FinetuneSpec",
    "GenerationHyperparameters", "LLMRequest", "LLMResponse", "ParamSpec", "RolloutStat",
    "SaveLoadMeta", "SaverConfig", "VLMRequest", "VLMResponse", "WeightUpdateMeta", "WireStruct",
]  # fmt: skip

#: Upper bound of ``max_new_tokens``: above any context length, below typos (``10**12``).
MAX_NEW_TOKENS = 1 << 24

#: The seed's stop reasons, plus SGLang's ``"abort"`` for a generation a pause stopped.
StopReason = Literal["length", "stop", "interrupt", "abort"]
_STOP_REASONS = frozenset(("length", "stop", "interrupt", "abort"))


def _empty_ids() -> TokenArray:
    return TokenArray.wrap(np.empty(0, np.int32))


def _empty_floats() -> TokenArray:
    return TokenArray.wrap(np.empty(0, np.float64))


class GenerationHyperparameters(
    WireStruct, tag=int(MsgKind.GENERATION_HYPERPARAMETERS), metaclass=_CheckedMeta
):
    """Sampling parameters of one generation request (AReaL's defaults; ``top_k=100000000``:
    no top-k). A violated constraint raises ``ValueError`` (``TypeError`` for a wrong type)."""

    n_samples: Annotated[int, msgspec.Meta(ge=1)] = 1
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_NEW_TOKENS)] = 16384
    min_new_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_NEW_TOKENS)] = 0
    greedy: bool = False
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=1)] = 100000000
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    stop_token_ids: list[Annotated[int, msgspec.Meta(ge=0)]] = msgspec.field(default_factory=list)

    @staticmethod
    def _check_new(obj: GenerationHyperparameters) -> None:
        for field in _GCONFIG_FIELDS:
            setattr(obj, field.name, _checked(field.name, getattr(obj, field.name), field.type))

    def new(self, **kwargs: Any) -> GenerationHyperparameters:
        """A copy with the given fields changed and checked (unknown names: ``TypeError``)."""
        new = msgspec.structs.replace(self, **{"stop_token_ids": [*self.stop_token_ids], **kwargs})
        self._check_new(new)
        return new


_GCONFIG_FIELDS = mi.type_info(GenerationHyperparameters).fields  # type: ignore[attr-defined]


def _checked(name: str, value: Any, info: Any) -> Any:
    """``value`` converted and checked against ``info``, a ``msgspec.inspect`` type."""
    if isinstance(info, mi.BoolType):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
        return bool(value)
    if isinstance(info, mi.ListType):
        if not isinstance(value, list):
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise TypeError(
                    f"{name} must be a list of ints, got {type(value).__name__} {value!r}"
                )
            value = list(value)
        for i, v in enumerate(value):
            value[i] = _checked(f"{name}[{i}]", v, info.item_type)
        return value
    is_int = isinstance(info, mi.IntType)
    kinds = (int, np.integer) if is_int else (int, float, np.integer, np.floating)
    fits = isinstance(value, kinds) and not isinstance(value, bool)  # value stays Any
    if not fits:
        what = "an int" if is_int else "a float"
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    value = operator.index(value) if is_int else float(value)
    rules = (
        (info.ge, operator.ge, ">="),
        (info.gt, operator.gt, ">"),
        (info.le, operator.le, "<="),
    )
    for bound, holds, rule in rules:
        if bound is not None and not holds(value, bound):
            raise ValueError(f"{name} must be {rule} {bound}, got {value!r}")
    return value


def _gconfig(value: Any) -> GenerationHyperparameters:
    """The seed's ``GenerationHyperparameters`` (a dataclass) or a mapping of its
    fields, converted; anything else is a ``TypeError`` here, not a worker's error."""
    hint = "pass a fastio.GenerationHyperparameters (or a dict of its fields)"
    if isinstance(value, Mapping):
        unknown = sorted(map(str, set(value) - set(GenerationHyperparameters.__struct_fields__)))
        if unknown:
            raise TypeError(f"gconfig has no field {', '.join(map(repr, unknown))}: {hint}")
        # array_like Structs convert from arrays only: read the dict as attributes.
        value = types.SimpleNamespace(**value)
    try:
        return msgspec.convert(value, GenerationHyperparameters, from_attributes=True)
    except msgspec.ValidationError as exc:
        if isinstance(value, types.SimpleNamespace):
            raise TypeError(f"gconfig dict is not valid: {exc}; {hint}") from exc
        raise TypeError(
            "gconfig must be a GenerationHyperparameters (or a dict of its fields), "
            f"got {type(value).__name__}: {exc}"
        ) from exc


class LLMRequest(WireStruct, tag=int(MsgKind.LLM_REQUEST), metaclass=_CheckedMeta):
    """A generation request: prompt token ids and sampling parameters (``rid``: a fresh
    uuid4 by default; requests sharing a rid go to the same worker, for KV-cache reuse)."""

    rid: str = msgspec.field(default_factory=lambda: str(uuid.uuid4()))
    input_ids: _Tokens = msgspec.field(default_factory=_empty_ids)
    # The default is valid: no construction checks.
    gconfig: GenerationHyperparameters = msgspec.field(
        default_factory=lambda: msgspec.StructMeta.__call__(GenerationHyperparameters)
    )
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    model_id: str | None = None

    def __post_init__(self) -> None:
        # Construction and decode: msgspec sees the token field as Any.
        ids = self.input_ids
        if type(ids) is not _TA or ids._a.dtype not in _INT_DTYPES:
            self.input_ids = _tokens(ids, np.int32, "input_ids")

    @staticmethod
    def _check_new(obj: LLMRequest) -> None:
        # Construction only: decode and convert check these.
        if type(obj.gconfig) is not GenerationHyperparameters:
            obj.gconfig = _gconfig(obj.gconfig)
        if not isinstance(obj.rid, str):
            raise TypeError(f"rid must be a str, got {type(obj.rid).__name__} {obj.rid!r}")
        if not isinstance(obj.metadata, dict):
            raise TypeError(f"metadata must be a dict, got {type(obj.metadata).__name__}")
        if obj.model_id is not None and not isinstance(obj.model_id, str):
            raise TypeError(f"model_id must be a str or None, got {type(obj.model_id).__name__}")


class LLMResponse(WireStruct, tag=int(MsgKind.LLM_RESPONSE)):
    """Generated tokens with their logprobs, weight versions and latency statistics."""

    input_tokens: _Tokens = msgspec.field(default_factory=_empty_ids)
    output_tokens: _Tokens = msgspec.field(default_factory=_empty_ids)
    output_logprobs: _Tokens = msgspec.field(default_factory=_empty_floats)
    output_versions: _Tokens = msgspec.field(default_factory=_empty_ids)
    stop_reason: StopReason = "stop"
    latency: float = float("inf")
    #: Time to first token, seconds.
    ttft: float = float("inf")
    #: Inter-token latencies, seconds.
    itl: _Tokens = msgspec.field(default_factory=_empty_floats)

    def __post_init__(self) -> None:
        # Construction and decode: msgspec sees the token fields as Any.
        a, b, c = self.input_tokens, self.output_tokens, self.output_logprobs
        d, e = self.output_versions, self.itl
        if (
            type(a) is type(b) is type(c) is type(d) is type(e) is _TA
            and a._a.dtype in _INT_DTYPES
            and b._a.dtype in _INT_DTYPES
            and d._a.dtype in _INT_DTYPES
            and c._a.dtype in _NUM_DTYPES
            and e._a.dtype in _NUM_DTYPES
            and self.stop_reason in _STOP_REASONS
        ):
            return
        self.input_tokens = _tokens(self.input_tokens, np.int32, "input_tokens")
        self.output_tokens = _tokens(self.output_tokens, np.int32, "output_tokens")
        self.output_logprobs = _tokens(self.output_logprobs, np.float64, "output_logprobs")
        self.output_versions = _tokens(self.output_versions, np.int32, "output_versions")
        self.itl = _tokens(self.itl, np.float64, "itl")
        if self.stop_reason not in _STOP_REASONS:
            raise ValueError(
                f"stop_reason must be one of {sorted(_STOP_REASONS)}, got {self.stop_reason!r}"
            )

    @property
    def input_len(self) -> int:
        """Number of prompt tokens."""
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        """Number of generated tokens."""
        return len(self.output_tokens)


class VLMRequest(LLMRequest, tag=int(MsgKind.VLM_REQUEST)):
    """An :class:`LLMRequest` with images (PIL images or strings such as URLs/paths)."""

    image_data: list[Any] | None = msgspec.field(default_factory=list)


class VLMResponse(LLMResponse, tag=int(MsgKind.VLM_RESPONSE)):
    """An :class:`LLMResponse` carrying the request's images back."""

    input_images: list[Any] = msgspec.field(default_factory=list)
