"""The request, response and metadata types of the seed (AReaL's ``io_struct``), as
msgspec Structs.

Struct options, chosen once for every wire type (:class:`WireStruct`):

``array_like=True``
    A Struct encodes as a msgpack array of its fields in definition order, not a map:
    no field names on the wire (an LLMResponse header is ~110 bytes instead of ~200,
    and encoding/decoding skips the key matching), and the tag comes first.
    Schema evolution therefore works by *appending* fields with defaults: an older
    reader ignores trailing fields it does not know, a newer reader fills missing
    trailing fields from their defaults (see ``docs/PROTOCOL.md``).
not ``omit_defaults``
    msgspec ignores it for ``array_like`` Structs (every field is written, defaults
    included; 0.23 verified by ``tests/fastio/test_codec.py``), so setting it would
    only suggest a saving that does not happen. Readers still accept messages with
    trailing fields missing (from older peers) and fill in the defaults.
``gc=False``
    Instances are not tracked by the cyclic garbage collector. Thousands of requests
    and responses are alive at once in a rollout; tracking them makes every GC pass
    slower and GC passes more frequent. Safe because the types hold no reference
    cycles (keep ``metadata`` free of references back to the request).
``tag=int(MsgKind.*)``, ``tag_field="__kind__"``
    An integer tag per type, written as the first array element, so one receiver
    decodes whatever arrives (a tagged union, ``decode(frames, type=None)``). Integer
    tags are one byte on the wire; names would cost ~15. ``tag_field`` only names the
    tag for msgspec's map form, which ``array_like`` never uses; it is set on the base
    so every subclass is tagged.
not ``frozen``
    Rollout code mutates requests and responses (re-submission after an interrupt
    extends ``input_ids`` and accumulates output), as it does the seed's dataclasses.
not ``forbid_unknown_fields``
    That would make old readers reject newer peers' appended fields.

Token arrays (``input_ids``, ``input_tokens``, ``output_tokens``, ``output_logprobs``,
``output_versions``, ``itl``) are :class:`~fastio.tokens.TokenArray`: lists and numpy
arrays are accepted and converted on construction (numpy arrays without a copy). Lists
become ``int32`` token ids and versions when every value fits (every vocabulary and
version does), ``int64`` otherwise (``uint64`` for values in ``[2**63, 2**64)``; beyond
64 bits ``OverflowError``: msgpack cannot carry them), and ``float64`` logprobs and
latencies (the exact Python floats, as the seed kept them). Arrays keep their own dtype.
A float among token ids raises ``TypeError`` rather than being truncated.

Validation
----------
Sampling parameters carry msgspec constraints (``msgspec.Meta``: ``max_new_tokens >=
1``, ``0 < top_p <= 1``, ...; see :class:`GenerationHyperparameters`). They are checked
once, where data enters: on construction (``cls(...)`` checks types and constraints,
naming the field and the rule, through the metaclass, so decoding never runs these
checks), and on decode, ``msgspec.convert`` and ``msgspec.json.decode`` by msgspec
itself, in C (the codec's :class:`~fastio.DecodeError` names the field path and the
rule). What msgspec cannot see, that token fields hold numeric arrays of the right
kind, ``__post_init__`` checks on every path: one type and one kind check per field.
``msgspec.structs.replace`` checks nothing (use ``gconfig.new(...)``).

Static typing: the token fields are annotated ``TokenArray`` for type checkers, so code
that passes lists or arrays and wants to be ``mypy --strict`` clean wraps them in
``TokenArray(...)``; at runtime lists, tuples, arrays and CPU tensors are all accepted.
To msgspec the fields are ``Any`` (see ``_Tokens``) for decode speed; ``__post_init__``
gives them their type on construction and on decode alike.
"""

from __future__ import annotations

import enum
import getpass
import operator
import os
import re
import socket
import types
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol

import msgspec
import numpy as np

from fastio.protocol import MsgKind
from fastio.tokens import TokenArray

__all__ = [
    "MAX_NEW_TOKENS",
    "AllocationMode",
    "AllocationType",
    "FinetuneSpec",
    "GenerationHyperparameters",
    "LLMRequest",
    "LLMResponse",
    "ParamSpec",
    "RolloutStat",
    "SaveLoadMeta",
    "SaverConfig",
    "VLMRequest",
    "VLMResponse",
    "WeightUpdateMeta",
    "WireStruct",
]

# Default element types when token fields are given as Python lists. Arrays passed in
# keep their own dtype (no copy).
_ID_DTYPE = np.int32
_LOGPROB_DTYPE = np.float64
_VERSION_DTYPE = np.int32
_LATENCY_DTYPE = np.float64


def _tokens(value: Any, dtype: Any, field: str) -> TokenArray:
    """Slow path of the token-field conversion in ``__post_init__``.

    Lists convert to ``dtype`` when every value fits exactly; a float among token ids
    or an id beyond the dtype's range raises instead of being truncated. This also
    validates decoded fields (the fields are ``Any`` to msgspec, see ``_Tokens``).
    """
    if isinstance(value, TokenArray):
        return value
    if isinstance(value, np.ndarray) or type(value).__module__ == "torch":
        return TokenArray(value)
    if not isinstance(value, (list, tuple, range)):
        raise TypeError(
            f"{field} takes a list, tuple, numpy array or TokenArray of numbers, "
            f"got {type(value).__name__}"
        )
    target = np.dtype(dtype)
    if len(value) == 0:
        return TokenArray._wrap(np.empty(0, target))
    try:
        arr = np.asarray(value)
    except ValueError as exc:  # ragged nesting
        raise ValueError(f"{field} must be a flat sequence of numbers") from exc
    kind = arr.dtype.kind
    if kind == "O" and arr.ndim == 1 and all(type(x) is int for x in value):
        raise OverflowError(
            f"{field}: integers beyond 64 bits cannot be stored or sent (int64, and uint64 "
            "for values in [2**63, 2**64), are the widest)"
        )
    if kind not in "biuf":
        raise TypeError(f"{field} holds numbers, got {arr.dtype} values")
    if arr.ndim != 1:
        raise ValueError(f"{field} must be a flat sequence of numbers, got shape {arr.shape}")
    if target.kind in "iu":
        if kind == "f":
            raise TypeError(f"{field} holds integers, got floats")
        if kind in "iu":
            info = np.iinfo(target)
            if arr.min() < info.min or arr.max() > info.max:
                # Wider ids are kept, as the seed's lists kept any int: numpy already
                # chose int64 (or uint64 for values >= 2**63).
                t = TokenArray._wrap(arr)
                t._excl = True
                return t
    t = TokenArray._wrap(arr.astype(target))
    t._excl = True
    return t


def _int_tokens(value: Any, dtype: Any, field: str) -> TokenArray:
    """A token field of integers (ids, versions): lists convert, arrays must be integer.

    A float or bool array passed as token ids is a bug in the caller's code (or a
    hostile peer); it raises instead of travelling on.
    """
    t = value if type(value) is TokenArray else _tokens(value, dtype, field)
    if t._a.dtype.kind not in "iu":
        raise TypeError(f"{field} holds integers, got an array of {t._a.dtype}")
    return t


def _float_tokens(value: Any, dtype: Any, field: str) -> TokenArray:
    """A token field of numbers (logprobs, latencies): bool arrays are rejected."""
    t = value if type(value) is TokenArray else _tokens(value, dtype, field)
    if t._a.dtype.kind not in "fiu":
        raise TypeError(f"{field} holds numbers, got an array of {t._a.dtype}")
    return t


#: Stop reasons: the seed's three, plus ``"abort"``, SGLang's finish reason for a
#: generation stopped by a pause (AReaL stores what its server sends).
StopReason = Literal["length", "stop", "interrupt", "abort"]
_STOP_REASONS = frozenset(("length", "stop", "interrupt", "abort"))


_TA = TokenArray

# The fast path of the token-field checks in ``__post_init__``: a set lookup of the
# array's dtype (cheaper than ``dtype.kind in "iu"``). Other dtypes of the right kind
# (non-native byte order, metadata) take the full check in ``_int_tokens`` /
# ``_float_tokens``, which accepts them.
_INT_DTYPES = frozenset(
    np.dtype(n) for n in ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")
)
_NUM_DTYPES = _INT_DTYPES | {np.dtype(n) for n in ("float16", "float32", "float64")}


def _empty_ids() -> TokenArray:
    return TokenArray._wrap(np.empty(0, _ID_DTYPE))


def _empty_floats() -> TokenArray:
    return TokenArray._wrap(np.empty(0, np.float64))


def _new_rid() -> str:
    return str(uuid.uuid4())


#: Bumped whenever a WireStruct subclass is defined, so the codec knows when the union
#: of message types (``decode(frames, type=None)``) must be rebuilt.
_registry_generation = 0


if TYPE_CHECKING:
    _Tokens = TokenArray
else:
    # msgspec sees token fields as Any so that it never calls the per-field dec_hook on
    # the hot path. The codec decodes every token encoding (``ExtCode.TOKENS`` and the
    # compact forms) straight into TokenArray, and __post_init__, which msgspec runs on
    # decode too, converts or rejects anything else a peer sends (ndarray, list,
    # garbage). Type checkers see TokenArray.
    _Tokens = Any


class _CheckedMeta(msgspec.StructMeta):
    """Metaclass of the types with construction-time checks.

    ``cls(...)`` runs ``cls._check_new(obj)`` after msgspec's own ``__init__``. Decoding
    never calls it (msgspec builds decoded instances directly and checks the typed
    fields and their constraints itself), so the checks run once, where data enters.
    """

    _check_new: Any

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        obj = super().__call__(*args, **kwargs)
        cls._check_new(obj)
        return obj


class WireStruct(msgspec.Struct, array_like=True, gc=False, tag_field="__kind__"):
    """Base of every fastio wire type (see the module docstring for the options).

    Subclass it with ``tag=<unused MsgKind value>`` to define a new message type; the
    codec's ``type=None`` union picks it up automatically.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        global _registry_generation
        super().__init_subclass__(**kwargs)
        _registry_generation += 1


#: Upper bound of ``max_new_tokens`` (2**24, 16M tokens): above any context length in
#: use, low enough that a typo such as ``10**12`` is refused instead of served.
MAX_NEW_TOKENS = 1 << 24

_NSamples = Annotated[int, msgspec.Meta(ge=1)]
_MaxNew = Annotated[int, msgspec.Meta(ge=1, le=MAX_NEW_TOKENS)]
_MinNew = Annotated[int, msgspec.Meta(ge=0, le=MAX_NEW_TOKENS)]
_TopP = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
_TopK = Annotated[int, msgspec.Meta(ge=1)]
_Temperature = Annotated[float, msgspec.Meta(ge=0.0)]
_TokenId = Annotated[int, msgspec.Meta(ge=0)]


class GenerationHyperparameters(
    WireStruct, tag=int(MsgKind.GENERATION_HYPERPARAMETERS), metaclass=_CheckedMeta
):
    """Sampling parameters of one generation request (AReaL's defaults).

    Constraints, checked on construction and on decode (msgspec ``Meta``):

    ==================  ========================================================
    ``n_samples``       int >= 1
    ``max_new_tokens``  int, 1 <= value <= :data:`MAX_NEW_TOKENS` (2**24)
    ``min_new_tokens``  int, 0 <= value <= 2**24
    ``greedy``          bool
    ``top_p``           float, 0 < value <= 1
    ``top_k``           int >= 1 (the default 100000000 means "no top-k")
    ``temperature``     float >= 0
    ``stop_token_ids``  list of int >= 0
    ==================  ========================================================

    A violation raises ``ValueError`` (``TypeError`` for a wrong type) naming the field
    and the rule, e.g. ``max_new_tokens must be >= 1, got 0``.
    """

    n_samples: _NSamples = 1
    max_new_tokens: _MaxNew = 16384
    min_new_tokens: _MinNew = 0
    greedy: bool = False
    top_p: _TopP = 1.0
    top_k: _TopK = 100000000
    temperature: _Temperature = 1.0
    stop_token_ids: list[_TokenId] = msgspec.field(default_factory=list)

    @staticmethod
    def _check_new(obj: GenerationHyperparameters) -> None:
        _check_gconfig(obj)

    def new(self, **kwargs: Any) -> GenerationHyperparameters:
        """A copy with the given fields changed (unknown names raise ``TypeError``)."""
        values = {f: getattr(self, f) for f in self.__struct_fields__}
        values["stop_token_ids"] = list(self.stop_token_ids)
        unknown = set(kwargs) - set(values)
        if unknown:
            raise TypeError(f"GenerationHyperparameters has no field(s) {sorted(unknown)}")
        values.update(kwargs)
        return GenerationHyperparameters(**values)


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return operator.index(value)


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    return float(value)


def _bounds(name: str, value: float, ge: Any = None, gt: Any = None, le: Any = None) -> None:
    if ge is not None and not value >= ge:
        raise ValueError(f"{name} must be >= {ge}, got {value!r}")
    if gt is not None and not value > gt:
        raise ValueError(f"{name} must be > {gt}, got {value!r}")
    if le is not None and not value <= le:
        raise ValueError(f"{name} must be <= {le}, got {value!r}")


def _check_gconfig(g: GenerationHyperparameters) -> None:
    """The construction-time twin of the msgspec constraints on the fields."""
    g.n_samples = n = _as_int("n_samples", g.n_samples)
    _bounds("n_samples", n, ge=1)
    g.max_new_tokens = n = _as_int("max_new_tokens", g.max_new_tokens)
    _bounds("max_new_tokens", n, ge=1, le=MAX_NEW_TOKENS)
    g.min_new_tokens = n = _as_int("min_new_tokens", g.min_new_tokens)
    _bounds("min_new_tokens", n, ge=0, le=MAX_NEW_TOKENS)
    if not isinstance(g.greedy, (bool, np.bool_)):
        raise TypeError(f"greedy must be a bool, got {type(g.greedy).__name__} {g.greedy!r}")
    g.greedy = bool(g.greedy)
    g.top_p = x = _as_float("top_p", g.top_p)
    _bounds("top_p", x, gt=0.0, le=1.0)
    g.top_k = n = _as_int("top_k", g.top_k)
    _bounds("top_k", n, ge=1)
    g.temperature = x = _as_float("temperature", g.temperature)
    _bounds("temperature", x, ge=0.0)
    ids = g.stop_token_ids
    if not isinstance(ids, list):
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise TypeError(
                f"stop_token_ids must be a list of ints, got {type(ids).__name__} {ids!r}"
            )
        g.stop_token_ids = ids = list(ids)
    for i, v in enumerate(ids):
        if type(v) is not int:
            ids[i] = v = _as_int(f"stop_token_ids[{i}]", v)
        _bounds(f"stop_token_ids[{i}]", v, ge=0)


def _check_request(req: LLMRequest) -> None:
    if not isinstance(req.rid, str):
        raise TypeError(f"rid must be a str, got {type(req.rid).__name__} {req.rid!r}")
    if not isinstance(req.metadata, dict):
        raise TypeError(f"metadata must be a dict, got {type(req.metadata).__name__}")
    if req.model_id is not None and not isinstance(req.model_id, str):
        raise TypeError(f"model_id must be a str or None, got {type(req.model_id).__name__}")


def _gconfig(value: Any) -> GenerationHyperparameters:
    """Accept the seed's own ``GenerationHyperparameters`` (a dataclass with the same
    fields) or a mapping of its fields, converted once; anything else is a ``TypeError``
    here rather than a ``BAD_REQUEST`` from a worker later."""
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
    """A generation request: prompt token ids and sampling parameters.

    ``rid`` defaults to a fresh uuid4 string; requests sharing a rid are routed to the
    same worker (KV-cache reuse).
    """

    rid: str = msgspec.field(default_factory=_new_rid)
    input_ids: _Tokens = msgspec.field(default_factory=_empty_ids)
    gconfig: GenerationHyperparameters = msgspec.field(default_factory=GenerationHyperparameters)
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    model_id: str | None = None

    def __post_init__(self) -> None:
        # Runs on construction and on decode. msgspec checks every typed field on decode;
        # the token field is Any to msgspec (for speed), so it is checked here: one type
        # and one dtype lookup when it is a TokenArray already (every decode by fastio).
        ids = self.input_ids
        if type(ids) is not _TA or ids._a.dtype not in _INT_DTYPES:
            self.input_ids = _int_tokens(ids, _ID_DTYPE, "input_ids")

    @staticmethod
    def _check_new(obj: LLMRequest) -> None:
        # Construction only: msgspec's decode and convert type gconfig themselves.
        if type(obj.gconfig) is not GenerationHyperparameters:
            obj.gconfig = _gconfig(obj.gconfig)
        _check_request(obj)


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
        # Runs on construction and on decode. msgspec checks the typed fields on decode
        # (stop_reason, floats); the token fields are Any to msgspec, so they are checked
        # here: a type check and a dtype lookup each when they are TokenArrays already.
        a, b, c = self.input_tokens, self.output_tokens, self.output_logprobs
        d, e = self.output_versions, self.itl
        if (
            type(a) is _TA
            and type(b) is _TA
            and type(c) is _TA
            and type(d) is _TA
            and type(e) is _TA
            and a._a.dtype in _INT_DTYPES
            and b._a.dtype in _INT_DTYPES
            and d._a.dtype in _INT_DTYPES
            and c._a.dtype in _NUM_DTYPES
            and e._a.dtype in _NUM_DTYPES
            and self.stop_reason in _STOP_REASONS
        ):
            return
        self.input_tokens = _int_tokens(self.input_tokens, _ID_DTYPE, "input_tokens")
        self.output_tokens = _int_tokens(self.output_tokens, _ID_DTYPE, "output_tokens")
        self.output_logprobs = _float_tokens(
            self.output_logprobs, _LOGPROB_DTYPE, "output_logprobs"
        )
        self.output_versions = _int_tokens(self.output_versions, _VERSION_DTYPE, "output_versions")
        self.itl = _float_tokens(self.itl, _LATENCY_DTYPE, "itl")
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


class FinetuneSpec(WireStruct, tag=int(MsgKind.FINETUNE_SPEC)):
    """Size of a fine-tuning run."""

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int

    @property
    def total_train_steps(self) -> int:
        """Steps over all epochs, dropping the last incomplete batch."""
        return self.total_train_epochs * (self.dataset_size // self.train_batch_size)

    @property
    def steps_per_epoch(self) -> int:
        """Steps per epoch, dropping the last incomplete batch."""
        return self.dataset_size // self.train_batch_size


class AllocationType(enum.Enum):
    """Which generation backend a decoupled allocation uses."""

    DECOUPLED_vLLM = 1
    DECOUPLED_SGLANG = 2


_STRATEGY = re.compile(r"([dpt])(\d+)([dpt])(\d+)([dpt])(\d+)")
_VALID_EXAMPLE = "'sglang.d4p1t1+d2p2t1' or 'd2p2t1+vllm.d4t1p1'"


def _parse_strategy(text: str, role: str, whole: str) -> dict[str, int]:
    m = _STRATEGY.fullmatch(text)
    if m is None or len({m.group(1), m.group(3), m.group(5)}) != 3:
        raise ValueError(
            f"invalid allocation mode {whole!r}: the {role} part {text!r} is not a parallel "
            "strategy; it must name each of d, p, t exactly once with a size, such as "
            f"'d4p1t1'. A valid mode looks like {_VALID_EXAMPLE}"
        )
    strategy = {m.group(i): int(m.group(i + 1)) for i in (1, 3, 5)}
    for axis, size in strategy.items():
        if size < 1:
            raise ValueError(
                f"invalid allocation mode {whole!r}: {role} size {axis}{size} must be >= 1. "
                f"A valid mode looks like {_VALID_EXAMPLE}"
            )
    return strategy


class AllocationMode(WireStruct, tag=int(MsgKind.ALLOCATION_MODE)):
    """Decoupled generation/training allocation, parsed from strings like
    ``"sglang.d4p1t1+d2p2t1"`` (generation on SGLang with data parallel 4, training with
    data parallel 2 and pipeline parallel 2).

    ``parallel_strat["gen"]`` holds the generation sizes, ``parallel_strat["*"]`` the
    training sizes, each keyed by ``"d"``, ``"p"`` and ``"t"``.
    """

    type_: AllocationType
    parallel_strat: dict[str, dict[str, int]]

    @property
    def gen_tp_size(self) -> int:
        """Generation tensor-parallel size."""
        return self.parallel_strat["gen"]["t"]

    @property
    def gen_pp_size(self) -> int:
        """Generation pipeline-parallel size."""
        return self.parallel_strat["gen"]["p"]

    @property
    def gen_dp_size(self) -> int:
        """Generation data-parallel size."""
        return self.parallel_strat["gen"]["d"]

    @property
    def gen_world_size(self) -> int:
        """Number of generation GPUs."""
        return self.gen_dp_size * self.gen_pp_size * self.gen_tp_size

    @property
    def train_tp_size(self) -> int:
        """Training tensor-parallel size."""
        return self.parallel_strat["*"]["t"]

    @property
    def train_pp_size(self) -> int:
        """Training pipeline-parallel size."""
        return self.parallel_strat["*"]["p"]

    @property
    def train_dp_size(self) -> int:
        """Training data-parallel size."""
        return self.parallel_strat["*"]["d"]

    @property
    def train_world_size(self) -> int:
        """Number of training GPUs."""
        return self.train_dp_size * self.train_pp_size * self.train_tp_size

    @classmethod
    def from_str(cls, allocation_mode: str) -> AllocationMode:
        """Parse ``"<backend>.<gen>+<train>"`` or ``"<train>+<backend>.<gen>"``.

        ``<backend>`` is ``vllm`` or ``sglang``; ``<gen>`` and ``<train>`` name each of
        ``d``, ``p``, ``t`` once with a positive size, in any order. Anything else raises
        ``ValueError`` saying what is wrong.

        >>> AllocationMode.from_str("sglang.d4p1t1+d2p2t1").gen_world_size
        4
        """
        if not isinstance(allocation_mode, str):
            raise ValueError(f"allocation mode must be a string, got {allocation_mode!r}")
        parts = allocation_mode.split("+")
        if len(parts) != 2:
            raise ValueError(
                f"invalid allocation mode {allocation_mode!r}: expected exactly one '+' "
                f"between a generation and a training part, such as {_VALID_EXAMPLE}"
            )
        backends = {
            "vllm": AllocationType.DECOUPLED_vLLM,
            "sglang": AllocationType.DECOUPLED_SGLANG,
        }
        gen_idx = [i for i, p in enumerate(parts) if p.split(".", 1)[0] in backends and "." in p]
        if len(gen_idx) != 1:
            raise ValueError(
                f"invalid allocation mode {allocation_mode!r}: exactly one part must name the "
                f"generation backend as 'vllm.<strategy>' or 'sglang.<strategy>', such as "
                f"{_VALID_EXAMPLE}"
            )
        backend, gen_text = parts[gen_idx[0]].split(".", 1)
        train_text = parts[1 - gen_idx[0]]
        train = _parse_strategy(train_text, "training", allocation_mode)
        gen = _parse_strategy(gen_text, "generation", allocation_mode)
        return cls(backends[backend], {"*": train, "gen": gen})

    @staticmethod
    def extract_parallelism_strategy(allocation_mode: str) -> dict[str, dict[str, int]]:
        """The seed's helper: ``"d2p2t1"`` -> ``{"*": {"d": 2, "p": 2, "t": 1}}``.

        Raises ``ValueError`` unless the string names each of d, p, t once with a
        positive size.
        """
        if not isinstance(allocation_mode, str):
            raise ValueError(f"parallel strategy must be a string, got {allocation_mode!r}")
        return {"*": _parse_strategy(allocation_mode, "parallel strategy", allocation_mode)}

    @staticmethod
    def extract_decoupled_alloc(allocation_mode: str) -> dict[str, dict[str, int]]:
        """The seed's helper: ``parallel_strat`` of :meth:`from_str`'s result."""
        return AllocationMode.from_str(allocation_mode).parallel_strat


class ParamSpec(WireStruct, tag=int(MsgKind.PARAM_SPEC)):
    """Name, shape and dtype (a torch dtype name such as ``"bfloat16"``) of one parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: str


class SaverConfig(WireStruct, tag=int(MsgKind.SAVER_CONFIG)):
    """Where and how often checkpoints are saved."""

    experiment_name: str
    trial_name: str
    fileroot: str
    freq_epochs: int | None = None
    freq_steps: int | None = None
    freq_secs: int | None = None


class _HasParamSpecs(Protocol):
    def get_param_specs(self) -> list[ParamSpec]: ...


def _host_ip() -> str:
    # As AReaL's gethostip: this host's name, resolved. A fallback to 127.0.0.1 would
    # leave workers on other hosts waiting for a store they cannot reach.
    name = socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError as exc:
        raise OSError(
            f"cannot find this host's address: its name {name!r} does not resolve "
            f"({getattr(exc, 'strerror', None) or exc}); pass master_address="
        ) from exc


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class WeightUpdateMeta(WireStruct, tag=int(MsgKind.WEIGHT_UPDATE_META)):
    """How new weights reach the generation workers.

    ``type="disk"``: a safetensors checkpoint at ``path``. ``type="nccl"``: broadcast in
    a torch.distributed group (NCCL on GPUs, gloo on CPU) of world size
    ``alloc_mode.gen_world_size + 1`` at ``nccl_master_address:nccl_master_port``.
    """

    type: Literal["disk", "nccl"]
    path: str | None = None
    alloc_mode: AllocationMode | None = None
    nccl_master_address: str = "127.0.0.1"
    nccl_master_port: int = 29500
    nccl_param_specs: list[ParamSpec] = msgspec.field(default_factory=list)
    nccl_group_name: str = "update_weight_group"

    @classmethod
    def from_disk(cls, saver_config: SaverConfig) -> WeightUpdateMeta:
        """Disk path ``{fileroot}/checkpoints/{user}/{experiment}/{trial}/default/weight_update``.

        As the seed (through ``Saver.get_save_checkpoint_root``), this creates the
        checkpoint root ``.../default`` (``os.makedirs(exist_ok=True)``) but not
        ``weight_update`` itself, which the trainer writes.
        """
        root = os.path.join(
            saver_config.fileroot,
            "checkpoints",
            getpass.getuser(),
            saver_config.experiment_name,
            saver_config.trial_name,
            "default",
        )
        os.makedirs(root, exist_ok=True)
        return cls(type="disk", path=os.path.join(root, "weight_update"))

    @classmethod
    def from_param_specs(
        cls,
        allocation_mode: AllocationMode,
        param_specs: list[ParamSpec],
        nccl_group_name: str = "update_weight_group",
        master_address: str | None = None,
        master_port: int | None = None,
    ) -> WeightUpdateMeta:
        """Process-group update of the given parameters.

        ``master_address`` defaults to this host's IP (its host name, resolved; an
        :class:`OSError` when the name does not resolve), ``master_port`` to a free port.
        """
        address = master_address or _host_ip()
        return cls(
            type="nccl",
            alloc_mode=allocation_mode,
            nccl_master_address=address,
            nccl_master_port=master_port if master_port is not None else _free_port(),
            nccl_param_specs=list(param_specs),
            nccl_group_name=nccl_group_name,
        )

    @classmethod
    def from_fsdp_nccl(
        cls,
        allocation_mode: AllocationMode,
        fsdp_engine: _HasParamSpecs,
        nccl_group_name: str = "update_weight_group",
    ) -> WeightUpdateMeta:
        """The seed's factory: parameter specs taken from a training engine."""
        return cls.from_param_specs(
            allocation_mode, fsdp_engine.get_param_specs(), nccl_group_name=nccl_group_name
        )


class SaveLoadMeta(WireStruct, tag=int(MsgKind.SAVE_LOAD_META)):
    """Where and how to save or load a model.

    ``tokenizer`` and ``processor`` may hold live objects in process; live objects never
    travel. On the wire each becomes its ``name_or_path`` string (the receiver loads it
    itself), and a decoded ``SaveLoadMeta`` holds those strings.
    """

    path: str
    weight_format: str
    with_optim: bool
    # Required, as in the seed (None where there is none).
    tokenizer: Any
    processor: Any
    base_model_path: str | None
    naive_distributed: bool = False


class RolloutStat(WireStruct, tag=int(MsgKind.ROLLOUT_STAT)):
    """Counters that drive staleness control."""

    submitted: int = 0
    accepted: int = 0
    running: int = 0
