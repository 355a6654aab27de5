"""The nvme tier's writes in flight, oldest first: batching, backpressure and retiring.

NOTE [Write batches] Direct writes (CPU memory written in place) go to the engine in
batches: handing one over costs a lock and a worker wake-up, which on a machine with few
cores preempts a compute thread. A batch is submitted when it holds WRITE_BATCH writes or
`batch_bytes`, and before anything waits on a write or reads (retire, backpressure, the
first read of the backward, drain, close): nothing ever waits on a write not submitted.
A payload released while its write is still batched is submitted first, so the engine holds
its extent's range and the range can go back at once (nvme.py NOTE [Deferred free]).
"""
from __future__ import annotations

import collections
import time
from typing import Any, Callable

from .. import _ext
from ..util.ranges import NO_SPAN, WRITE, profiling, span

__all__ = ["Write", "WriteQueue", "WRITE_BATCH", "end_s"]

WRITE_BATCH = 32


def end_s(future) -> float:
    """When an I/O finished: the engine's timestamp if it keeps one, else now (seen done)."""
    end = getattr(future, "end_s", None)
    return end if end is not None else time.perf_counter()


# One payload's write, from `store` until the queue retires it and drops it from the payload
# (tiers/base.py NOTE [One owner]): `Write(nbytes)`, with the fields `future`, `source`,
# `address`, `direct_bytes`, `d2h` and `start_s`. The core's `NvmeWrite`: what each field
# holds, and why the garbage collector need not track it, in csrc/nvme_records.cpp.
Write = _ext.core_attr("NvmeWrite")


class WriteQueue:
    """The writes of one tier's payloads (each payload has a `write` slot and an `extent`)."""

    def __init__(self, store, stats, direct_cap_bytes: int, batch_bytes: int) -> None:
        self._store = store
        self._stats = stats
        self._direct_cap = max(direct_cap_bytes, 1)
        self._batch_limit = batch_bytes
        self._writes: collections.deque = collections.deque()  # payloads, write order
        self._direct_inflight = 0    # bytes of direct-write sources held (NOTE [Deferred free])
        self._batch: list = []       # payloads whose direct write is not yet submitted
        self._batch_bytes = 0
        self._submitting = False
        self._release_later: list = []
        self.in_backward = False     # stall attribution: set by the tier at the first read

    # ---------------------------------------------------------------- adding
    def add_chained(self, payload, write: Write) -> None:
        """A write the engine starts itself after a device copy (its future is set)."""
        self._append(payload, write)

    def add_direct(self, payload, write: Write, source: Any, address: int) -> None:
        """A write from host memory: batched (NOTE [Write batches]); waits first while more
        than the cap of source bytes is held."""
        nbytes = write.nbytes
        if not self._has_direct_room(nbytes):   # (no closure made per save otherwise)
            self.retire_oldest(lambda: self._has_direct_room(nbytes), "wait write-behind")
        write.source = source
        write.address = address
        write.direct_bytes = nbytes
        self._direct_inflight += nbytes
        self._append(payload, write)
        batch = self._batch
        batch.append(payload)
        self._batch_bytes += nbytes
        if len(batch) >= WRITE_BATCH or self._batch_bytes >= self._batch_limit:
            self.submit()

    def _append(self, payload, write: Write) -> None:
        write.start_s = time.perf_counter()
        payload.write = write
        self._writes.append(payload)
        if len(self._writes) > self._stats.peak_writes_inflight:
            self._stats.peak_writes_inflight = len(self._writes)

    def submit(self) -> None:
        """Hand the batched direct writes to the engine (NOTE [Write batches])."""
        batch = self._batch
        if not batch or self._submitting:
            return
        self._submitting = True
        try:
            self._batch, self._batch_bytes = [], 0
            writes = [p.write for p in batch]
            with span(WRITE) if profiling() else NO_SPAN:
                futures = self._store.write_ptr_many([p.extent for p in batch],
                                                     [w.address for w in writes],
                                                     [w.nbytes for w in writes])
            for write, future in zip(writes, futures):
                write.future = future
        finally:
            self._submitting = False
        # Released while being submitted (the garbage collector can free a record at any
        # allocation above): the engine holds their ranges now, so they go back at once.
        later, self._release_later = self._release_later, []
        for payload in later:
            payload.extent.release()

    def released(self, payload) -> bool:
        """Prepare `payload`'s extent to go back; False when it must wait for the batch
        being submitted right now (which then gives it back)."""
        write = payload.write
        if write is not None and write.future is None:
            if self._submitting:
                self._release_later.append(payload)
                return False
            self.submit()
        return True

    # ---------------------------------------------------------------- retiring
    def retire(self, payload) -> None:
        """Wait for (or collect) a payload's write; raises StorageError if it failed. Its
        queue entry may linger: poll() and drain() drop entries with no write."""
        write = payload.write
        if write is None:
            return
        if write.future is None:
            self.submit()
        stats = self._stats
        try:
            moved = write.future.wait()
        finally:
            payload.write = None   # the payload keeps nothing of a finished write
            write.source = write.d2h = None
            self._direct_inflight -= write.direct_bytes
            write.direct_bytes = 0
            end = end_s(write.future)
            stats.write_clock.add_interval(write.start_s, end)
            if stats.trace.enabled:  # (the name and arguments cost a save ~1 us to make)
                stats.trace.add(f"write {write.nbytes} B", "nvme write", write.start_s, end,
                                category="io", args={"bytes": write.nbytes})
        stats.nvme_written_bytes += moved

    def retire_oldest(self, done: Callable[[], bool], what: str) -> None:
        """Backpressure: retire writes oldest first until `done()`; the wait is a stall."""
        if done() or not self._writes:
            return
        self.submit()
        start = time.perf_counter()
        while not done() and self._writes:
            self.retire(self._writes.popleft())
        self._stats.add_stall(time.perf_counter() - start, backward=self.in_backward,
                              start_s=start, what=what)

    def _has_direct_room(self, nbytes: int) -> bool:
        # At most `staging_bytes` of source tensors held for their writes (a larger tensor
        # goes alone), the same RAM the staging arena would have used.
        held = self._direct_inflight
        return held == 0 or held + nbytes <= self._direct_cap

    def poll(self) -> None:
        """Retire the writes that landed, oldest first (cheap: stops at the first one not)."""
        writes = self._writes
        while writes:
            write = writes[0].write
            if write is not None and (write.future is None or not write.future.done()):
                return
            self.retire(writes.popleft())

    def drain(self) -> None:
        """Wait for every write."""
        self.submit()
        while self._writes:
            self.retire(self._writes.popleft())

    # ---------------------------------------------------------------- closing
    @property
    def pending(self) -> bool:
        return any(p.write is not None for p in self._writes)  # retired entries linger

    def futures(self) -> list:
        """Every write's future (the batch submitted first)."""
        self.submit()
        return [p.write.future for p in self._writes if p.write is not None]

    def forget(self) -> None:
        """Drop every write's references (the tier closes; the engine holds what it needs)."""
        for payload in self._writes:
            if payload.write is not None:
                payload.write.source = payload.write.d2h = None
                payload.write = None
        self._writes.clear()
        self._batch.clear()
        self._batch_bytes = 0
