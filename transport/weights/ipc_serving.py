"""The trainer's side of the ``ipc`` route: :class:`IpcOffering`, a part of
:class:`~transport.weights.WeightPublisher`.

It decides whether a version takes the route (``ipc="auto"``: CUDA tensors, ``"cpu"``:
any, ``"off"``: never), makes the persistent slots for the model's layout (new ones when
the layout changes), offers them to the workers that asked (``IpcHello``), packs each
version into them and queues its ``IpcReady`` notices for the serving thread to send
(:class:`~transport.weights.ipc.IpcExporter` does the slots). Workers without the slots,
and versions that fail there, go by ``shm`` or ``tcp``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import fastio
from fastio.ipc_msgs import IpcAck, IpcHello, IpcOffer
from transport import metrics
from transport.weights.core.publisher import PublisherCore
from transport.weights.ipc import IpcExporter, plan_layout

__all__ = ["IPC_MODES", "IpcOffering"]

#: Values of ``WeightPublisher(ipc=...)``.
IPC_MODES = ("auto", "cpu", "off")


class IpcOffering:
    """The ``ipc`` slots of a publisher and the workers that asked for them.

    Parameters
    ----------
    mode, slots, timeout:
        The publisher's ``ipc``, ``ipc_slots`` and ``ipc_timeout``.
    core, cond:
        The publisher's protocol core (its workers) and lock.
    encoder, wake:
        How a queued notice is encoded, and how the serving thread is woken to send it.
    publisher_id, bucket_bytes:
        The publisher's.
    """

    def __init__(
        self,
        mode: str,
        slots: int | None,
        timeout: float,
        *,
        core: PublisherCore,
        cond: threading.Condition,
        encoder: fastio.Encoder,
        wake: Callable[[], None],
        publisher_id: str,
        bucket_bytes: int,
    ) -> None:
        if mode not in IPC_MODES:
            raise ValueError(f"ipc must be one of {IPC_MODES}, not {mode!r}")
        self.mode = mode
        self.slots = slots
        self.timeout = timeout
        self.core = core
        self.cond = cond
        self.encoder = encoder
        self.wake = wake
        self.publisher_id = publisher_id
        self.bucket_bytes = bucket_bytes
        self.exporter: IpcExporter | None = None
        #: The last IpcHello of each worker that asked (offered again on a new layout).
        self.hellos: dict[str, IpcHello] = {}
        #: Notices for the serving thread to send: (worker identity, frames).
        self.outbox: list[tuple[bytes, list[Any]]] = []

    def wanted(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether a version of ``tensors`` takes the route."""
        if self.mode == "off" or not tensors:
            return False
        return self.mode == "cpu" or any(t.is_cuda for t in tensors.values())

    def reader(self, wid: str) -> bool:
        """Whether worker ``wid`` has the slots open (it reads versions there)."""
        with self.cond:
            w = self.exporter.workers.get(wid) if self.exporter is not None else None
            return w is not None and w.opened

    def only(self) -> bool:
        """Whether every live worker reads the next version here and the slots hold a
        whole version (a snapshot to stage from later)."""
        with self.cond:
            exp = self.exporter
            if exp is None or exp.n_slots < len(exp.layout):
                return False
            return all(w in exp.workers and exp.workers[w].opened for w in self.core.alive())

    def handle(self, wid: str, msg: IpcHello | IpcAck, now: float) -> IpcOffer | None:
        """An ``IpcHello`` (offer the slots, or keep it for the first version that takes
        the route) or ``IpcAck`` (a slot released); the offer to send, if any."""
        if msg.worker_id != wid:  # only a peer's own id counts
            self.core.count("ipc_foreign_ids")
            return None
        offer = None
        with self.cond:
            info = self.core.workers.get(wid)
            if info is not None:
                info.last_seen = now
            if isinstance(msg, IpcHello):
                if info is None:
                    return None  # a WeightHello comes first
                self.hellos[wid] = msg
                if self.exporter is not None:
                    offer = self.exporter.offer(msg)
            elif self.exporter is not None:
                self.exporter.handle_ack(msg)
                if msg.bucket == -2:
                    self.hellos.pop(wid, None)
            self.cond.notify_all()
        return offer

    def reap(self) -> list[str]:
        """Release the slots of workers whose process is gone; their ids (lock held)."""
        return self.exporter.reap() if self.exporter is not None else []

    def _queue(self, wid: str, msg: Any) -> None:
        self.outbox.append((wid.encode(), self.encoder.encode(msg)))

    def prepare(self, tensors: dict[str, torch.Tensor], closed: Callable[[], bool]) -> None:
        """Slots for this layout (new ones when it changed), offered to every worker
        that asked; those still opening them get a moment (else this version misses
        them)."""
        specs = [
            (k, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in tensors.items()
        ]
        layout = plan_layout(specs, self.bucket_bytes)
        with self.cond:
            if self.exporter is None or self.exporter.layout != layout:
                if self.exporter is not None:
                    self.exporter.close()
                self.exporter = IpcExporter(
                    tensors, bucket_bytes=self.bucket_bytes, slots=self.slots,
                    publisher_id=self.publisher_id,
                )  # fmt: skip
                alive = self.core.alive()
                for wid, hello in self.hellos.items():
                    if wid in alive:
                        self._queue(wid, self.exporter.offer(hello))
                self.wake()
            grace = min(5.0, self.timeout)
            deadline = time.monotonic() + grace
            exp = self.exporter
            while not closed():
                alive = self.core.alive()
                waiting = [
                    w
                    for w, st in exp.workers.items()
                    if not st.opened and time.monotonic() - st.offered_at < 2 * grace and w in alive
                ]
                left = deadline - time.monotonic()
                if not waiting or left <= 0:
                    break
                self.cond.wait(min(left, 0.1))

    def publish(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Pack ``version`` into the slots and queue its IpcReady notices (under the
        lock, released while a slot is still read)."""
        with self.cond:
            exp = self.exporter
            assert exp is not None

            def send(wid: str, ready: Any) -> None:
                self._queue(wid, ready)
                self.wake()

            def wait(seconds: float) -> None:
                self.cond.wait(seconds)

            exp.publish(tensors, version, send=send, wait=wait, timeout=self.timeout)
            readers = sum(w.opened for w in exp.workers.values())
        self.wake()
        metrics.PUBLISHER_BYTES.labels(path="ipc").inc(sum(b.nbytes for b in exp.layout) * readers)
        self.core.count("ipc_versions")

    def close(self) -> None:
        """Close the slots (the publisher is closing)."""
        with self.cond:
            exp, self.exporter = self.exporter, None
        if exp is not None:
            exp.close()
