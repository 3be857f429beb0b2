"""How a version's tensors land on one worker, bound before a byte is fetched
(``docs/PROTOCOL.md``, "Names, aliases and dtypes"); the digest trainer and workers compare."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Union

import torch

from fastio.weight_msgs import WeightBucketInfo, WeightTensor
from transport.weights.bucket import (
    DEFAULT_CHECKSUM,
    Hasher,
    _flat_bytes,
    _numel,
    dtype_from_name,
    dtype_name,
    wire_tensor,
)
from transport.weights.errors import WeightMismatchError

__all__ = [
    "FLOAT_DTYPES", "Binding", "DtypeSpec", "Rename", "advertised_dtype", "check_manifest",
    "parse_dtype", "parse_dtype_spec", "state_digest",
]  # fmt: skip

#: Dtypes converted into one another on request.
FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})

#: What a worker wants: ``None`` (exact dtypes), ``"auto"`` (each target's dtype), one
#: dtype for every floating tensor, or engine name -> dtype.
DtypeSpec = Union[torch.dtype, str, Mapping[str, Union[torch.dtype, str]], None]  # noqa: UP007
#: Trainer name -> engine name, as a mapping or a callable (``None``: skip the tensor).
Rename = Union[Mapping[str, str], Callable[[str], Union[str, None]], None]  # noqa: UP007


def parse_dtype(x: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or its name (``"bfloat16"``, ``"torch.bfloat16"``,
    ``"bf16"``, ``"fp32"``...); :class:`WeightMismatchError` if unknown."""
    if isinstance(x, torch.dtype):
        dtype_name(x)  # supported?
        return x
    name = x.removeprefix("torch.")
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
            "float": "float32", "fp64": "float64", "double": "float64"}.get(name, name)  # fmt: skip
    return dtype_from_name(name)


def parse_dtype_spec(spec: DtypeSpec) -> DtypeSpec:
    """Validate a :data:`DtypeSpec` (names become dtypes); raises on unknown dtypes."""
    if spec is None or (isinstance(spec, str) and spec == "auto"):
        return spec
    if isinstance(spec, Mapping):
        return {k: parse_dtype(v) for k, v in spec.items()}
    return parse_dtype(spec)


def advertised_dtype(spec: DtypeSpec, targets: Mapping[str, torch.Tensor]) -> str:
    """The dtype a worker's Hello asks for: its one floating dtype, else ``""``."""
    if spec is None or isinstance(spec, Mapping):
        return ""
    if isinstance(spec, str) and spec == "auto":
        floats = {t.dtype for t in targets.values() if t.dtype in FLOAT_DTYPES}
        return dtype_name(floats.pop()) if len(floats) == 1 else ""
    return dtype_name(parse_dtype(spec))


class Binding:
    """One version (``buckets``, ``aliases``) bound to one worker's ``targets``;
    :class:`WeightMismatchError` names every problem. ``strict``: every target covered;
    ``loader``: names that are no target allowed. ``dests``: travelling name -> engine
    names; ``wanted``: engine name -> the dtype it is delivered in."""

    def __init__(
        self,
        buckets: Sequence[WeightBucketInfo],
        targets: Mapping[str, torch.Tensor],
        *,
        aliases: Mapping[str, str] | None = None,
        rename: Rename = None,
        dtype: DtypeSpec = None,
        strict: bool = True,
        loader: bool = False,
    ) -> None:
        self.dests: dict[str, list[str]] = {}
        self.wanted: dict[str, torch.dtype] = {}
        table = rename if isinstance(rename, Mapping) else {}
        to_engine = rename if callable(rename) else (lambda n: table.get(n, n))
        problems: list[str] = []
        wire: dict[str, tuple[WeightTensor, torch.dtype | None]] = {}
        for b in buckets:
            end = 0
            for e in b.tensors:
                if e.name in wire:
                    problems.append(f"{e.name!r} appears twice in the update")
                try:
                    dt = dtype_from_name(e.dtype)
                except WeightMismatchError as exc:
                    problems.append(str(exc))
                    wire[e.name] = (e, None)
                    continue
                wire[e.name] = (e, dt)
                want = _numel(e.shape) * dt.itemsize
                if e.nbytes != want or e.offset < end or e.offset + e.nbytes > b.nbytes:
                    problems.append(f"bad layout for {e.name!r} in bucket {b.index}")
                end = e.offset + e.nbytes
        names: dict[str, list[str]] = {n: [n] for n in wire}
        for alias, canon in (aliases or {}).items():
            if canon not in wire or alias in wire:
                problems.append(f"bad alias {alias!r} -> {canon!r} in the manifest")
            else:
                names[canon].append(alias)
        covered: dict[str, str] = {}
        for wname, trainer_names in names.items():
            self.dests[wname] = []
            for tname in trainer_names:
                en = to_engine(tname)
                if en is None:
                    continue
                if en in covered:
                    problems.append(
                        f"{en!r} would receive both {covered[en]!r} and {tname!r} (renaming)"
                    )
                    continue
                covered[en] = tname
                self.dests[wname].append(en)
                e, wdt = wire[wname]
                if wdt is None:  # an unknown dtype, already named
                    continue
                t = targets.get(en)
                wanted = _wanted(dtype, en, e, wdt, t)
                if isinstance(wanted, str):
                    problems.append(wanted)
                    continue
                self.wanted[en] = wanted
                if t is None:
                    if not loader:
                        problems.append(f"{en!r} is not a parameter of this worker's model")
                    continue
                if tuple(t.shape) != tuple(e.shape):
                    problems.append(
                        f"shape mismatch for {en!r}: model has {list(t.shape)}, "
                        f"update has {list(e.shape)}"
                    )
                if t.dtype != wanted:
                    problems.append(
                        f"dtype mismatch for {en!r}: model has {dtype_name(t.dtype)}, "
                        f"update has {dtype_name(wanted)}"
                    )
        missing = [n for n in targets if n not in covered] if strict else []
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            problems.append(f"parameters missing from the update: {missing[:5]}{more}")
        if problems:
            more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
            raise WeightMismatchError("; ".join(problems[:8]) + more)

    def named_tensors(
        self, buckets: Sequence[tuple[WeightBucketInfo, Sequence[torch.Tensor]]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(engine name, tensor)`` for every tensor, in the wanted dtype (a loader's
        argument; views valid during the call only)."""
        for info, chunks in buckets:
            for e in info.tensors:
                dests = self.dests.get(e.name, [])
                if not dests:
                    continue
                t = wire_tensor(e, chunks)
                for en in dests:
                    want = self.wanted[en]
                    yield en, (t if t.dtype == want else t.to(want))


def _wanted(
    spec: DtypeSpec, en: str, e: WeightTensor, wire: torch.dtype, t: torch.Tensor | None
) -> torch.dtype | str:
    """The dtype ``en`` is delivered in (of its wire dtype ``wire``), or why it cannot be."""
    wanted = wire
    if isinstance(spec, Mapping):
        wanted = parse_dtype(spec.get(en, wire))
    elif isinstance(spec, str) and spec == "auto":
        if t is not None and t.dtype in FLOAT_DTYPES and wire in FLOAT_DTYPES:
            wanted = t.dtype
    elif spec is not None and wire in FLOAT_DTYPES:
        wanted = parse_dtype(spec)
    if wanted != wire and (wire not in FLOAT_DTYPES or wanted not in FLOAT_DTYPES):
        return f"cannot convert {en!r} from {e.dtype} to {dtype_name(wanted)}"
    if wanted != wire and e.src_dtype:  # a cast of a cast is not what tensor.to(wanted) gives
        return (
            f"{en!r} travels as {e.dtype}, cast by the trainer from {e.src_dtype} for "
            f"the other workers; this worker wants {dtype_name(wanted)}"
        )
    return wanted


def check_manifest(
    buckets: Sequence[WeightBucketInfo], targets: Mapping[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Check an update against the worker's tensors before touching any;
    :class:`~transport.weights.errors.WeightMismatchError` names every problem."""
    Binding(buckets, targets, strict=strict)


def state_digest(tensors: Mapping[str, torch.Tensor], names: Iterable[str] | None = None) -> int:
    """A checksum of the tensors' bytes in ``names`` order (default: sorted names), for
    trainer and workers to compare; CUDA tensors are copied to the host for it."""
    h = Hasher(DEFAULT_CHECKSUM)
    for n in sorted(tensors) if names is None else names:
        h.update(n.encode())
        h.update(_flat_bytes(tensors[n].detach().cpu().contiguous()).numpy())
    return h.digest()
