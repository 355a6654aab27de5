"""The nvme tier: payloads written to private slab files on local SSDs by the C++ engine.

Write path (forward), CPU tensors. `store` writes straight from the tensor's own memory
(`write_ptr`, no staging copy): the extent is allocated with the tensor's *phase* (address
modulo the O_DIRECT alignment), so the engine moves all but the partial sectors at the two
ends in place (NOTE [Phase]). The tensor is kept alive until its write lands (NOTE [Deferred
free]); `store` waits only when more than `staging_bytes` of such writes are in flight (it
then retires the oldest: counted as forward stall).

Write path, CUDA tensors. `store` starts the D2H into a pinned staging block (see below); a
tensor that does not fit the staging arena (or any, without CopyStreams) is copied into a
page-aligned host buffer and written from there like a CPU tensor.

Read path (backward). `prefetch` takes memory with the payload's phase (a slice of a staging
arena block, or of a plain buffer when the arena is full), waits for the payload's own write
if it is still in flight (NOTE [Read after write]) and submits the read. `fetch` waits on that
read only and returns a zero-copy uint8 view, so the memory returns when autograd drops it.

NOTE [Phase] O_DIRECT needs the memory address and the file offset aligned. Instead of
copying each tensor into aligned staging memory, the extent's data starts `phase` bytes past
an aligned file offset, with phase = address % alignment; reads land in memory of the same
phase: a staging copy of every tensor costs the training thread a memcpy of all it saves
(docs/benchmarks.md, *Why the runtime's constants*). Phases that are not a multiple of 64 (memory not from torch's
allocator) use phase 0 and go through the bounce buffer whole, so that the read-back view's
byte offset stays a multiple of every dtype's size. The engine reads the tensor's memory
while the forward goes on: an in-place change autograd can see (version counter) raises at
unpack as it would without offload; one made through `.data` (invisible to the version
counter) before the write lands may or may not reach the disk, where plain autograd would
use the changed values.

NOTE [Read after write] The engine does not order a read after a write of the same extent;
reading before the write landed returns stale bytes. Every read first retires its payload's
write.

NOTE [Deferred free] Memory the engine reads from or into must outlive the I/O. The engine
itself keeps HostBlocks and the extent's slab range alive until a request is done, so a
released payload gives its extent back at once; but the raw memory of `write_ptr` (the
source tensor) and `read_ptr` (a slice of an arena block or of a plain buffer) is ours. A
write's source stays with its `Write` (the write queue holds the payload) until retired, freed
payload or not; a read still in flight when its payload is released (a prefetched tensor
never used) goes to a deferred list, dropped when `poll` sees it done. `release` never blocks.

CUDA sources with the context's CopyStreams and a CUDA build of the extension: the D2H →
write and read → H2D chains run in the engine (nvme_device.py); a tensor needed again
while its D2H is pending is served from the source (`device_tensor_if_held`). Otherwise
the copies are synchronous `copy_` calls (`sync_d2h` / `sync_h2d`).

NOTE [One owner] (tiers/base.py) The tier owns every transfer: a `Write` and a `Read` per
payload in flight, kept in its queues, with the memory each must keep alive and its clock.
A payload holds its extent and *references* to its current `Write` / `Read`, set and
cleared only by the tier; it calls nothing.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Hashable

import torch

from .. import _ext
from ..errors import ExtensionUnavailable, UsedAfterCloseError
from ..util.sizes import format_bytes
from ..util.stats import Stats
from .base import Payload, Tier, flat_bytes, on_cuda, sync_d2h, sync_h2d
from . import nvme_device, nvme_space, pool
from .nvme_space import CHUNK_BYTES
from ..util.ranges import D2H, NO_SPAN, WAIT_READ, profiling, span
from .heap import HeapSettings
from .nvme_reads import Read, ReadQueue, phase_buffer
from .nvme_writes import Write, WriteQueue

__all__ = ["NvmeTier"]

log = logging.getLogger("offload")


# An extent in the store and the transfers in flight for it, which the tier sets and clears
# (NOTE [One owner]): the payload itself calls nothing. `_NvmePayload(extent, nbytes, device,
# phase, cuda)` (NOTE [Phase]), with the fields `write`, `read` and `released` besides. The
# core's `NvmePayload`: what each field holds, and why the garbage collector need not track
# it, in csrc/nvme_records.cpp. None without the core: this tier runs only with it.
_NvmePayload = _ext.core_attr("NvmePayload")


class NvmeTier(Tier):
    """Slab files in `dirs` (striped), written and read through a staging arena."""

    name = "nvme"

    def __init__(self, dirs: tuple[str, ...], capacity_bytes: Callable[[], int], *,
                 workers: int, staging_bytes: int, stats: Stats, core,
                 cpu_heap: str = "reuse", checksum: bool = False,
                 max_bytes_per_s: int = 0,
                 capacity_key: Hashable = None,
                 copies: Callable[[torch.device], Any] | None = None) -> None:
        """Take the process's store for `dirs` (NOTE [One budget] in nvme_space.py) and a
        staging arena from the pool.

        Args:
            capacity_bytes: Called only when a new store must be made (it stats the disk).
                Below `nvme_space.MIN_STORE_BYTES` the tier has no room: every `store`
                returns None, so tensors spill to the next tier, stay with a warning, or
                raise TierFullError.
            capacity_key: What the capacity was derived from (the OFFLOAD_NVME_BYTES spec);
                with `workers` and `checksum` it decides whether an idle store fits.
            copies: Returns the context's CopyStreams for a CUDA device; with a CUDA build
                of the extension device copies are then chained with the I/O.
            max_bytes_per_s: The engine's throughput cap (OFFLOAD_NVME_MAX_BW; 0: none).
        """
        if _NvmePayload is None or Write is None or Read is None:
            raise ExtensionUnavailable(
                "offload: the compiled core offload._C predates the nvme tier's records "
                f"(csrc/nvme_records.cpp): {_ext.HOW_TO_BUILD}")
        self._stats = stats
        self._core = core
        # The chained paths need write_after_event / read_then_h2d (CUDA builds only).
        self._copies = copies if getattr(core, "cuda_compiled", False) else None
        self._dirs = tuple(os.path.realpath(d) for d in dirs)  # the budget's key
        self._arena = None
        self._closed = False
        self._store = nvme_space.acquire_sized(
            self._dirs, capacity_bytes, core, workers=workers, checksum=checksum,
            max_bytes_per_s=max_bytes_per_s, capacity_key=capacity_key)
        self._own_bytes = 0  # this tier's share of the store (others may use it too)
        self._live: set[_NvmePayload] = set()  # stored, not yet released (abort frees them)
        # Reads in submission order until seen done (the engine serves them first in, first
        # out, so poll looks at the oldest ones only), and released payloads' reads.
        self._reads = ReadQueue(stats)
        self._writes = WriteQueue(self._store, stats, staging_bytes, CHUNK_BYTES)
        # CPU sources: freed activation RAM should be reused, not returned and refaulted.
        self._heap = HeapSettings(cpu_heap)
        if self._store is None:
            return
        try:
            # Not pinned on a CPU-only run (nothing to DMA from); pinned iff CUDA works.
            self._arena_key = max(staging_bytes, core.DEFAULT_ALIGNMENT)
            self._arena = pool.take("nvme-staging", self._arena_key,
                                    lambda: core.HostArena(self._arena_key, pinned=None))
        except BaseException:
            nvme_space.release(self._dirs, self._store, keep=True)
            raise
        self._arena.reset_peak()
        # A shared store counts on across steps and contexts: the difference is this tier's
        # (plus any other context's bounced bytes in the meantime).
        self._bounced_at_open = self._store.bytes_bounced
        self._alignment = max(self._store.alignment, core.DEFAULT_ALIGNMENT)

    @classmethod
    def open(cls, config, stats: Stats, copies) -> "NvmeTier":
        from .._ext import load_core

        tier = cls(config.nvme_dir, config.nvme_capacity_bytes, workers=config.io_workers,
                   staging_bytes=config.staging_bytes, cpu_heap=config.cpu_heap,
                   checksum=config.nvme_checksum, max_bytes_per_s=config.nvme_max_bw,
                   stats=stats, core=load_core(), capacity_key=config.nvme_bytes,
                   copies=copies)
        stats.tier(cls.name).capacity_bytes = tier.capacity_bytes
        return tier

    def report(self, stats: Stats) -> None:
        super().report(stats)
        arena = self._arena
        stats.staging_peak_bytes = arena.peak_bytes if arena is not None else 0
        stats.exit_staging_used_bytes = arena.used_bytes if arena is not None else 0

    # ---------------------------------------------------------------- properties
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def capacity_bytes(self) -> int:
        """The process's budget for these directories (shared by every context)."""
        return self._store.capacity_bytes if self._store is not None else 0

    @property
    def used_bytes(self) -> int:
        """Bytes of this tier's payloads still on disk (0 after a clean step)."""
        return self._own_bytes

    @property
    def budget_used_bytes(self) -> int:
        """Bytes of the shared budget in use by every context of the process."""
        return self._store.used_bytes if self._store is not None and not self._closed else 0

    def usage_text(self) -> str:
        # The shared budget: what every context of the process holds (NOTE [One budget]).
        return (f"nvme {format_bytes(self.budget_used_bytes)} of "
                f"{format_bytes(self.capacity_bytes)} used")

    @property
    def paths(self) -> list[str]:
        return list(self._store.paths) if self._store is not None else []

    # ---------------------------------------------------------------- write path
    def store(self, storage: torch.UntypedStorage, device: torch.device) -> Payload | None:
        if self._closed:
            raise UsedAfterCloseError("offload: nvme tier used after close")
        if self._store is None:
            return None  # no room at all (see __init__)
        nbytes = storage.nbytes()
        on_cpu = not on_cuda(device)
        chained = self._copies is not None and not on_cpu
        if on_cpu:
            self._heap.acquire()  # heap.py: CPU RAM is freed and reused during the step
        self.poll()
        block = self._arena.allocate(nbytes) if chained else None
        if chained and block is None and nbytes <= self._arena.capacity_bytes:
            block = self._wait_for_staging(nbytes)
        address = storage.data_ptr()
        phase = self._phase_of(address) if on_cpu else 0
        extent = self._store.allocate(nbytes, phase)
        if extent is None:
            return None  # full (or too fragmented): the caller spills to the next tier
        payload = _NvmePayload(extent, nbytes, device, phase, not on_cpu)
        write = Write(nbytes)
        self._own_bytes += nbytes  # from here on `release` gives it back
        self._live.add(payload)
        if block is not None:
            with span(D2H) if profiling() else NO_SPAN:  # returns at once
                ticket = self._copies(device).offload(flat_bytes(storage), block)
            write.future = nvme_device.write_after_d2h(self._store, extent, ticket)
            write.d2h = ticket
            del block  # the copy and the engine hold it (copies Notes 3, 4)
            self._writes.add_chained(payload, write)
            return payload
        source = storage  # written in place (NOTE [Phase])
        if not on_cpu:  # no CopyStreams, or no staging space
            source = phase_buffer(self._core, nbytes, 0, self._alignment)
            sync_d2h(flat_bytes(storage), source, self._stats)
            address = source.data_ptr()
        # NOTE [Deferred free]: the source must outlive the write.
        self._writes.add_direct(payload, write, source, address)
        return payload

    def _phase_of(self, address: int) -> int:
        phase = address % self._alignment
        return phase if phase % 64 == 0 else 0  # NOTE [Phase]

    def _wait_for_staging(self, nbytes: int):
        # The arena is full of D2H copies in flight; wait for the oldest writes.
        block = None

        def allocated() -> bool:
            nonlocal block
            block = self._arena.allocate(nbytes)
            return block is not None

        self._writes.retire_oldest(allocated, "wait staging space")
        return block  # None: fragmented or held by reads; written from a host copy

    # ---------------------------------------------------------------- read path
    def prefetchable(self, payload: _NvmePayload) -> bool:
        return True

    def prefetched(self, payload: _NvmePayload) -> bool:
        return payload.read is not None

    def released(self, payload: _NvmePayload) -> bool:
        return payload.released

    def prefetch(self, payload: _NvmePayload) -> bool:
        if payload.read is not None or payload.released:
            return False
        self.start_read(payload)
        return True

    def start_read(self, payload: _NvmePayload) -> None:
        """Start loading `payload` (its prefetch, or its fetch when nothing was prefetched)."""
        if self._closed:
            raise UsedAfterCloseError("offload: nvme tier used after close")
        self._writes.in_backward = True
        self._writes.submit()  # the reads come now: nothing waits behind them any more
        if payload.write is not None:  # NOTE [Read after write]
            start = time.perf_counter()
            self._writes.retire(payload)
            self._stats.add_stall(time.perf_counter() - start, backward=True, start_s=start,
                                  what="wait own write")
        nbytes, phase = payload.nbytes, payload.phase
        room = nbytes + self._alignment  # fits `nbytes` at any phase
        block = self._arena.allocate(room)
        gpu = block is not None and self._copies is not None and payload.cuda and phase == 0
        if gpu:
            # read → H2D chained in the engine; the ticket holds block and destination
            # until the copy is done (copies Notes 8, 9).
            read = Read(nbytes, nvme_device.read_then_h2d(
                self._copies(payload.device), self._store, payload.extent, block, nbytes),
                None, True)
        else:
            # Memory of the payload's phase (NOTE [Phase]): a slice of the arena block, or
            # of a plain buffer. The engine does not hold either (read_ptr): the Read does,
            # and NOTE [Deferred free] covers a release mid-read.
            buf = phase_buffer(self._core, nbytes, phase, self._alignment, block)
            read = Read(nbytes, self._store.read_ptr(payload.extent, buf.data_ptr(), nbytes),
                        buf, False)
        payload.read = read
        self._reads.add(read)

    def fetch(self, payload: _NvmePayload) -> torch.Tensor:
        """The payload's bytes on its device: waits for this payload's read only."""
        if payload.released:
            raise UsedAfterCloseError(
                "offload: a saved tensor was used after its offload.activations() context "
                "released it (the block exited with an exception, or backward ran after the "
                "context was closed)")
        self.poll()  # retire landed writes first: their memory goes back sooner
        write = payload.write
        if write is not None and write.d2h is not None:
            # The source on the device while its D2H is still pending.
            held = write.d2h.device_tensor_if_held()
            if held is not None:  # needed again before its D2H finished: no read at all
                self._stats.pending_copy_hits += 1
                return held
        if payload.read is None:
            self.start_read(payload)
        read, payload.read = payload.read, None
        try:
            if read.gpu:
                # Waits on the host only for the engine's read + H2D submission; the
                # current stream then waits on the H2D event on the GPU (copies Note 7).
                # CopyStreams counts that wait itself (h2d_wait_s, folded in at context
                # exit, and the trace): counted here too, a step's stall could exceed the
                # step.
                with span(WAIT_READ) if profiling() else NO_SPAN:
                    result = read.future.tensor_for_use()
                self._stats.nvme_read_bytes += payload.nbytes
                return result
            if read.observed:   # landed already (the poll above saw it): no wait, no stall
                moved = read.future.wait()
            else:
                moved = self._wait_read(read)
        finally:
            self._reads.observe(read)
            # A read seen here may stay in the queue until it reaches the front: it keeps
            # nothing (the bytes are the caller's now, or the read failed: its wait has no
            # timeout, so a read that raised is over and its memory is free to go).
            buf, read.buf, read.future = read.buf, None, None
        self._stats.nvme_read_bytes += moved
        return buf if not payload.cuda else sync_h2d(buf, payload.device, self._stats)

    def _wait_read(self, read: Read) -> int:
        """Wait for a read still in flight: a backward stall."""
        start = time.perf_counter()
        try:
            with span(WAIT_READ) if profiling() else NO_SPAN:
                return read.future.wait()
        finally:
            self._stats.add_stall(time.perf_counter() - start, backward=True, start_s=start,
                                  what="wait read")

    # ---------------------------------------------------------------- housekeeping
    def poll(self) -> None:
        """Retire landed writes (oldest first), note finished reads, free deferred memory."""
        self._writes.poll()
        self._reads.poll()

    def release(self, payload: _NvmePayload) -> None:
        """Give the payload's extent back at once; never waits for I/O."""
        if payload.released:
            return
        payload.released = True
        self._live.discard(payload)
        if self._closed:
            return
        self._own_bytes -= payload.nbytes
        if not self._writes.released(payload):
            return  # being submitted now: the batch gives it back (NOTE [Write batches])
        read, payload.read = payload.read, None
        if read is not None:
            # The engine keeps the extent's range (and any HostBlock) until its I/O is done,
            # so the extent goes back at once; the raw memory a read_ptr lands in must stay
            # (a write's source stays with its Write in the queue until it is retired).
            self._reads.defer(read)
        payload.extent.release()

    def drain(self) -> None:
        """Wait for every write in flight and free deferred memory."""
        self._writes.drain()
        self._reads.reap(wait=True)

    def abort(self) -> None:
        for payload in list(self._live):
            self.release(payload)

    def close(self, reuse: bool = True) -> None:
        """Close: wait for this tier's own I/O, then let go of the shared store (kept open
        for the next step when clean and idle, NOTE [One budget]) and the arena."""
        if self._closed:
            return
        self._closed = True
        self._heap.release()
        store, arena = self._store, self._arena
        if store is None:
            return
        clean = reuse and not self._writes.pending and self._reads.idle
        try:
            if not clean:
                self._wait_own_io()
        finally:
            self._stats.nvme_bounced_bytes += store.bytes_bounced - self._bounced_at_open
            self._writes.forget()
            self._reads.clear()
            self._store = self._arena = None
            nvme_space.release(self._dirs, store, keep=clean)
        # Blocks still viewed by live tensors keep their memory; such an arena is dropped
        # (freed with its last block), not reused.
        if clean and arena.used_bytes == 0:
            pool.give_back("nvme-staging", self._arena_key, arena)

    def _wait_own_io(self) -> None:
        """Every transfer of this tier is over, so the memory it reads or writes may go.

        The store may live on (other contexts use it): unlike closing it, this waits only
        for our own requests. Failures are dropped: nobody needs these bytes any more.
        """
        futures = self._writes.futures() + self._reads.futures()
        for future in futures:
            try:
                future.wait()
            except Exception as exc:  # noqa: BLE001 - StorageError, or a closed store
                log.debug("offload: I/O of a closed nvme tier failed: %s", exc)
