"""The nvme tier's reads in flight: when each was issued and seen done, and the memory of a
read whose payload was released before it landed (nvme.py NOTE [Deferred free]).
"""
from __future__ import annotations

import collections
import logging
import threading

import torch

from .. import _ext
from .nvme_writes import end_s

__all__ = ["Read", "ReadQueue", "phase_buffer"]

log = logging.getLogger("offload")


def phase_buffer(core, nbytes: int, phase: int, alignment: int, block=None) -> torch.Tensor:
    """`nbytes` of host memory whose address % `alignment` is `phase` (nvme.py NOTE
    [Phase]), as a uint8 tensor.

    A view of just those bytes (storage offset 0, like the original storage) that keeps its
    memory alive: a slice of `block` (an arena block of nbytes + alignment), else of a
    fresh page-aligned allocation. The tensor holds the block itself (`frombuffer`'s offset
    and count: no memoryview objects for the garbage collector to track per read).
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if block is None:
        room = nbytes + alignment
        block = core.HostArena(room, pinned=False).allocate(room)
    skip = (phase - block.ptr) % alignment
    return torch.frombuffer(block, dtype=torch.uint8, count=nbytes, offset=skip)


# One payload's read, from `prefetch` / `fetch` until its bytes are handed out:
# `Read(nbytes, future, buf, gpu)`, with the fields `start_s` (when it was made) and
# `observed` besides. The core's `NvmeRead`: what each field holds, and why the garbage
# collector need not track it, in csrc/nvme_records.cpp.
Read = _ext.core_attr("NvmeRead")


class ReadQueue:
    """Reads whose completion is not yet seen, in submission order (the engine serves them
    first in, first out, so `poll` looks at the oldest ones only), and the deferred ones.

    A FIFO, not a dict popped as reads are seen done: a dict keeps the slots of removed
    keys until it resizes, and iterating it from the front walks all of them, so polling
    the oldest read cost time in proportion to the reads the step had already seen. A read
    seen done out of order (fetched first) stays in the FIFO, marked, until it reaches
    the front.
    """

    def __init__(self, stats) -> None:
        self._stats = stats
        self._reads: collections.deque[Read] = collections.deque()
        self._pending = 0   # reads in `_reads` not yet observed
        self._deferred: list[Read] = []
        # Records die on whatever thread autograd drops them (defer), while the tier polls
        # (reap): without it, a defer that took the list before reap swapped it could
        # append after reap walked it, and the read's memory would go while it lands.
        # Reentrant: the collector may free a record (defer) inside reap's own swap.
        self._deferred_lock = threading.RLock()

    def add(self, read: Read) -> None:
        self._reads.append(read)
        self._pending += 1
        if self._pending > self._stats.peak_reads_inflight:
            self._stats.peak_reads_inflight = self._pending

    def observe(self, read: Read) -> None:
        """Count a read's transfer once: its clock and its trace span."""
        if not read.observed:
            read.observed = True
            self._pending -= 1
            end = end_s(read.future)
            self._stats.read_clock.add_interval(read.start_s, end)
            if self._stats.trace.enabled:  # (as for writes: nothing formatted without one)
                self._stats.trace.add(f"read {read.nbytes} B", "nvme read", read.start_s,
                                      end, category="io", args={"bytes": read.nbytes})

    def defer(self, read: Read) -> None:
        """A released payload's read still in flight: its memory stays until it lands."""
        self.observe(read)
        if not read.future.done():
            with self._deferred_lock:
                self._deferred.append(read)

    def poll(self) -> None:
        reads = self._reads
        while reads:
            read = reads[0]
            if not read.observed:
                if not read.future.done():
                    break
                self.observe(read)
            reads.popleft()
        if self._deferred:
            self.reap(wait=False)

    def reap(self, wait: bool) -> None:
        """Drop the memory kept for released payloads' reads once they are done."""
        # Swap first: a release triggered by garbage collection while we iterate appends
        # to the new list instead of the one being walked.
        with self._deferred_lock:
            pending, self._deferred = self._deferred, []
        for read in pending:
            if wait or read.future.done():
                try:
                    read.future.wait()
                except OSError as exc:  # nobody needs these bytes any more
                    log.debug("offload: I/O of a released payload failed: %s", exc)
                read.buf = None
            else:
                with self._deferred_lock:
                    self._deferred.append(read)

    @property
    def idle(self) -> bool:
        return not self._pending and not self._deferred

    def futures(self) -> list:
        return [r.future for r in self._reads if not r.observed] + \
            [r.future for r in self._deferred]

    def clear(self) -> None:
        self._reads.clear()
        self._pending = 0
        self._deferred.clear()
