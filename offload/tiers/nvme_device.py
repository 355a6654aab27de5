"""The NVMe tier's chained device ↔ NVMe operations: no Python between a device copy and
the disk I/O it feeds or is fed by. Both run in the C++ store's engine (CUDA paths of the
core); the copies and events themselves are offload/tiers/copies.py's.

* :func:`write_after_d2h`: an NVMe write of the pinned block a D2H copy fills, started by an
  engine thread when the copy's event completes (copies Notes 1-4);
* :func:`read_then_h2d`: an NVMe read into a pinned block, then the H2D from it on the
  prefetch stream, enqueued by the engine as soon as the read lands (Notes 6-10).
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["WriteBehind", "write_after_d2h", "read_then_h2d"]


class WriteBehind:
    """An NVMe write chained after a D2H event; holds the event until the write is done
    (copies Note 4: the engine waits on its raw handle)."""

    __slots__ = ("future", "_event")

    def __init__(self, future, event):
        self.future = future
        self._event = event

    @property
    def end_s(self) -> float | None:
        return getattr(self.future, "end_s", None)

    def done(self) -> bool:
        if self._event is not None and self.future.done():
            self._event = None
        return self._event is None

    def wait(self, timeout_s: float | None = None) -> int:
        nbytes = self.future.wait(timeout_s)
        self._event = None
        return nbytes


def write_after_d2h(store, extent, ticket) -> WriteBehind:
    """Write ``ticket.block`` to ``extent`` once the D2H ``ticket`` has landed in it.

    Args:
        store: The NvmeStore (a CUDA build of the core: ``write_after_event``).
        extent: Where the bytes go.
        ticket: The :class:`~offload.tiers.copies.D2HTicket` of the copy into the block; its
            block must be the HostBlock itself (the engine holds it until the write lands).
    """
    if isinstance(ticket.block, torch.Tensor):
        raise TypeError("write_after_d2h(): the D2H copied into a tensor view of a block; pass "
                        "the HostBlock itself to CopyStreams.offload so the engine can hold it")
    return WriteBehind(store.write_after_event(extent, ticket.block, ticket.event_handle),
                       ticket.event)


def read_then_h2d(copies, store, extent, block, nbytes: int) -> Any:
    """Read ``extent`` into the pinned ``block``, then copy it to a new device tensor.

    Returns the :class:`~offload.tiers.copies.H2DTicket` of the copy; the engine enqueues the
    H2D on the prefetch stream as soon as the read has landed. ``block`` is held until the
    copy is done (by the engine and by the ticket, copies Note 8).
    """
    def submit(dst_ptr: int, stream: int, event: int):
        return store.read_then_h2d(extent, block, dst_ptr, nbytes, stream, event)

    return copies.reload_chained(nbytes, submit, keep=block)
