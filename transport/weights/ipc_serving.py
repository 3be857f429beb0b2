"""The trainer's side of the ``ipc`` path inside :class:`~transport.weights.WeightPublisher`.

:class:`IpcServing` holds the publisher's :class:`~transport.weights.ipc.IpcExporter`:
it decides whether a version takes the path (``ipc="auto"``: CUDA tensors, ``"cpu"``:
any, ``"off"``: never), makes the persistent slots for the model's layout (new ones
when the layout changes) and offers them to the workers whose ``IpcHello`` the serving
thread kept, then packs each version into the slots and queues its ``IpcReady`` notices
for the serving thread to send. The serving thread (:mod:`transport.weights.serving`)
answers ``IpcHello`` / ``IpcAck`` and reaps the slots of workers whose process is gone.
Workers without the slots, and versions that fail there, go by ``shm`` or ``tcp``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from transport import metrics
from transport.weights.ipc import IpcExporter, plan_layout
from transport.weights.serving import PublisherService

__all__ = ["IPC_MODES", "IpcServing"]

#: Values of ``WeightPublisher(ipc=...)``.
IPC_MODES = ("auto", "cpu", "off")


class IpcServing(PublisherService):
    """The ``ipc`` half of :class:`transport.weights.WeightPublisher`."""

    # Set by WeightPublisher.__init__.
    bucket_bytes: int

    def _wake(self) -> None:
        raise NotImplementedError

    def _init_ipc(self, mode: str, slots: int | None, timeout: float) -> None:
        """The ``ipc``, ``ipc_slots`` and ``ipc_timeout`` parameters (no slots yet)."""
        if mode not in IPC_MODES:
            raise ValueError(f"ipc must be one of {IPC_MODES}, not {mode!r}")
        self.ipc_mode = mode
        self.ipc_slots = slots
        self.ipc_timeout = timeout
        self._ipc = None
        self._ipc_hellos = {}
        self._outbox = []

    def _ipc_wanted(self, tensors: dict[str, torch.Tensor]) -> bool:
        if self.ipc_mode == "off" or not tensors:
            return False
        if self.ipc_mode == "cpu":
            return True
        return any(t.is_cuda for t in tensors.values())

    def _queue(self, wid: str, msg: Any) -> None:
        """Have the serving thread send ``msg`` to ``wid`` (lock held)."""
        self._outbox.append((wid.encode(), self._encoder.encode(msg)))

    def _prepare_ipc(self, tensors: dict[str, torch.Tensor]) -> None:
        """Slots for this layout (new ones when it changed), offered to every worker
        that asked, which get a moment to open them."""
        specs = [
            (k, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for k, t in tensors.items()
        ]
        layout = plan_layout(specs, self.bucket_bytes)
        with self._cond:
            if self._ipc is None or self._ipc.layout != layout:
                if self._ipc is not None:
                    self._ipc.close()
                self._ipc = IpcExporter(
                    tensors,
                    bucket_bytes=self.bucket_bytes,
                    slots=self.ipc_slots,
                    publisher_id=self.publisher_id,
                )
                # Workers that asked before: offered now.
                for wid, hello in self._ipc_hellos.items():
                    info = self.core.workers.get(wid)
                    if info is not None and info.alive:
                        self._queue(wid, self._ipc.offer(hello))
                self._wake()
            # Every live worker offered the slots lately (now, or when it asked) and not
            # yet done opening them gets a moment: else this version misses it.
            grace = min(5.0, self.ipc_timeout)
            deadline = time.monotonic() + grace
            exp = self._ipc
            while not self._closed:
                waiting = [
                    w
                    for w, st in exp.workers.items()
                    if not st.opened
                    and time.monotonic() - st.offered_at < 2 * grace
                    and w in self.core.workers
                    and self.core.workers[w].alive
                ]
                left = deadline - time.monotonic()
                if not waiting or left <= 0:
                    break
                self._cond.wait(min(left, 0.1))

    def _publish_ipc(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Pack ``version`` into the ipc slots and send its IpcReady notices (under the
        lock, released while a slot is still read; the serving thread sends)."""
        with self._cond:
            exp = self._ipc
            assert exp is not None

            def send(wid: str, ready: Any) -> None:
                self._queue(wid, ready)
                self._wake()

            def wait(seconds: float) -> None:
                self._cond.wait(seconds)

            exp.publish(tensors, version, send=send, wait=wait, timeout=self.ipc_timeout)
            readers = sum(w.opened for w in exp.workers.values())
        self._wake()
        nbytes = sum(b.nbytes for b in exp.layout)
        metrics.PUBLISHER_BYTES.labels(path="ipc").inc(nbytes * readers)
        self._count("ipc_versions")

    def _close_ipc(self) -> None:
        """Close the slots (the publisher is closing)."""
        with self._cond:
            exp, self._ipc = self._ipc, None
        if exp is not None:
            exp.close()
