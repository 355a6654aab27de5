"""The nvme tier's CUDA tensors: how one goes to the disk and comes back, with no Python
between a device copy and the disk I/O it feeds or is fed by. The chained operations run
in the C++ store's engine (CUDA paths of the core); the copies and events themselves are
offload/tiers/copies.py's; the tier (nvme.py) hands its CUDA payloads to `DevicePaths`.

* :func:`write_after_d2h`: an NVMe write of the pinned block a D2H copy fills, started by an
  engine thread when the copy's event completes (copies Notes 1-4);
* :func:`read_then_h2d`: an NVMe read into a pinned block, then the H2D from it on the
  prefetch stream, enqueued by the engine as soon as the read lands (Notes 6-10);
* without a staging block (or without CopyStreams) a synchronous copy through host memory
  of the payload's phase (:func:`phase_buffer`, nvme.py NOTE [Phase]).
"""
from __future__ import annotations

from typing import Any

import torch

from ..errors import UsedAfterCloseError
from ..util.ranges import D2H, NO_SPAN, profiling, span
from ..util.stats import Stats
from .base import flat_bytes, sync_d2h, sync_h2d

__all__ = ["DevicePaths", "WriteBehind", "write_after_d2h", "read_then_h2d", "phase_buffer",
           "USED_AFTER_CLOSE"]

# What a save or load after the tier closed says (the core says the same: nvme_transfers.hpp).
USED_AFTER_CLOSE = (
    "offload: nvme tier used after close (the context's close() ran inside its block, or the "
    "step was freed after an exception); call ctx.close() after the block and its backward")


class DevicePaths:
    """One nvme tier's CUDA payloads: stored, read ahead and fetched through its store, its
    staging arena and its transfers (which own every payload's I/O, tiers/base.py NOTE [One
    owner]). `copies` returns the step's CopyStreams for a device; None (a CPU build of the
    core, or no CopyStreams) copies synchronously through host memory."""

    def __init__(self, store, arena, transfers, alignment: int,
                 copies: Any, core, stats: Stats) -> None:
        self._store, self._arena, self._transfers = store, arena, transfers
        self._alignment = alignment
        self._copies = copies
        self._core = core
        self._stats = stats
        self.closed = False

    def close(self) -> None:
        """The tier closed: a read started now raises; the store and arena are let go."""
        self.closed = True
        self._store = self._arena = None



    # ---------------------------------------------------------------- write path
    def store(self, storage: torch.UntypedStorage, device: torch.device):
        """Start the D2H into a staging block, its write chained after it in the engine; a
        storage that does not fit the arena (or any, without CopyStreams) is copied into host
        memory and written from there like a CPU tensor. None: the disk is full."""
        transfers = self._transfers
        nbytes = storage.nbytes()
        transfers.poll()
        chained = self._copies is not None
        block = self._arena.allocate(nbytes) if chained else None
        if chained and block is None and nbytes <= self._arena.capacity_bytes:
            block = self._wait_for_staging(nbytes)
        payload = transfers.allocate(nbytes, device, 0, True)
        if payload is None:
            return None  # full (or too fragmented): the caller spills to the next tier
        if block is not None:
            with span(D2H) if profiling() else NO_SPAN:  # returns at once
                ticket = self._copies(device).offload(flat_bytes(storage), block)
            transfers.add_chained(
                payload, write_after_d2h(self._store, payload.extent, ticket), ticket)
            return payload  # the copy and the engine hold the block (copies Notes 3, 4)
        source = phase_buffer(self._core, nbytes, 0, self._alignment)
        sync_d2h(flat_bytes(storage), source, self._stats)
        transfers.add_direct(payload, source, source.data_ptr())
        return payload

    def _wait_for_staging(self, nbytes: int):
        # The arena is full of D2H copies in flight; wait for the oldest writes.
        block = None

        def allocated() -> bool:
            nonlocal block
            block = self._arena.allocate(nbytes)
            return block is not None

        self._transfers.retire_oldest(allocated, "wait staging space")
        return block  # None: fragmented or held by reads; written from a host copy

    # ---------------------------------------------------------------- read path
    def prefetch(self, payload) -> bool:
        # (A failed write's error is for its own fetch to raise, not a read-ahead's caller.)
        if payload.reading or payload.released or payload.write_failed:
            return False
        return self._start_read(payload)

    def _start_read(self, payload) -> bool:
        """Start loading a payload: read → H2D chained in the engine when a staging block is
        free, else a host read that `fetch` copies over. False when, while its write was
        waited for, another thread released the payload or started its read."""
        if self.closed:
            raise UsedAfterCloseError(USED_AFTER_CLOSE)
        transfers = self._transfers
        # Its own write first (csrc/nvme_transfers.hpp NOTE [Read after write]).
        transfers.before_read(payload)
        # That wait lets the GIL go: a record dying on another thread may have released the
        # payload (its extent gone), or another thread's fetch started its read (as the
        # core's start_host_read checks).
        if payload.released or payload.reading:
            return False
        if self._copies is not None and payload.phase == 0:
            block = self._arena.allocate(payload.nbytes + self._alignment)
            if block is not None:
                # The ticket holds block and destination until the copy is done (copies
                # Notes 8, 9).
                transfers.add_chained_read(payload, read_then_h2d(
                    self._copies(payload.device), self._store, payload.extent, block,
                    payload.nbytes))
                return True
        transfers.start_read(payload)
        return True

    def fetch(self, payload) -> torch.Tensor:
        """The payload's bytes on its device: waits for this payload's read only."""
        transfers = self._transfers
        if not payload.released:
            transfers.poll()   # retire landed writes first: their memory goes back sooner
            d2h = transfers.pending_d2h(payload)
            if d2h is not None:
                # The source on the device while its D2H is still pending.
                held = d2h.device_tensor_if_held()
                if held is not None:  # needed again before its D2H finished: no read at all
                    self._stats.pending_copy_hits += 1
                    return held
            if not payload.reading:
                self._start_read(payload)
        if payload.reading_on_device:
            return transfers.fetch(payload)   # chained: the stream waits on the H2D
        return sync_h2d(transfers.fetch(payload), payload.device, self._stats)


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


def phase_buffer(core, nbytes: int, phase: int, alignment: int) -> torch.Tensor:
    """`nbytes` of fresh host memory whose address % `alignment` is `phase` (nvme.py NOTE
    [Phase]), as a uint8 tensor (storage offset 0, like the original storage) that keeps it
    alive."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    room = nbytes + alignment
    block = core.HostArena(room, pinned=False).allocate(room)
    skip = (phase - block.ptr) % alignment
    return torch.frombuffer(block, dtype=torch.uint8, count=nbytes, offset=skip)
