"""The nvme tier: payloads written to private slab files on local SSDs by the C++ engine.

What each stored storage pays runs in the core's `NvmeTransfers` (csrc/nvme_transfers.cpp):
the extent, the write and its batch, the backpressure, the read, the wait, the hand-out and
the release, with no Python in between; its notes say how ([Write batches], [Read after
write], [Deferred free]). This module keeps what is per step or per device: the store and
staging arena it takes from the process, the CUDA copies that feed and follow the I/O, and
the step's figures.

Write path (forward), CPU tensors. `store` writes straight from the tensor's own memory (no
staging copy): the extent is allocated with the tensor's *phase* (address modulo the O_DIRECT
alignment), so the engine moves all but the partial sectors at the two ends in place (NOTE
[Phase]). The tensor is kept alive until its write lands; `store` waits only when more than
`staging_bytes` of such writes are in flight (it then retires the oldest: counted as forward
stall).

Write path, CUDA tensors. `store` starts the D2H into a pinned staging block and the engine
writes the block once the copy's event completes (nvme_device.py); a tensor that does not fit
the staging arena (or any, without CopyStreams) is copied into a page-aligned host buffer and
written from there like a CPU tensor.

Read path (backward). `prefetch` reads into memory of the payload's phase (a slice of the
staging arena, or of a fresh buffer when it is full) after the payload's own write; `fetch`
waits on that read only and returns a zero-copy uint8 view that holds the memory, so it
returns when autograd drops it. A CUDA payload's read is chained to its H2D in the engine; a
tensor needed again while its D2H is pending is served from the source (`device_tensor_if_held`).

NOTE [Phase] O_DIRECT needs the memory address and the file offset aligned. Instead of
copying each tensor into aligned staging memory, the extent's data starts `phase` bytes past
an aligned file offset, with phase = address % alignment; reads land in memory of the same
phase: a staging copy of every tensor costs the training thread a memcpy of all it saves
(docs/benchmarks.md, *Why the runtime's constants*). Phases that are not a multiple of 64 (memory not from torch's
allocator) use phase 0 and go through the bounce buffer whole, so that the read-back view's
byte offset stays a multiple of every dtype's size. Small tensors whose blocks adjoin and
whose writes (or reads) queue together are the exception by design: the engine moves them
as one transfer through its bounce buffer (csrc/io_engine.cpp NOTE [Small chunks travel
together]), a copy of a few KiB each in place of a system call each. The engine reads the tensor's memory
while the forward goes on: an in-place change autograd can see (version counter) raises at
unpack as it would without offload; one made through `.data` (invisible to the version
counter) before the write lands may or may not reach the disk, where plain autograd would
use the changed values.

NOTE [One owner] (tiers/base.py) The tier owns every transfer, through its NvmeTransfers:
a payload holds its extent and its write and read in flight, set and cleared only there; it
calls nothing.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Hashable

import torch

from .. import _ext
from ..errors import ExtensionUnavailable, UsedAfterCloseError
from ..util import ranges
from ..util.ranges import D2H, NO_SPAN, profiling, span
from ..util.sizes import format_bytes
from ..util.stats import Stats
from .base import Tier, flat_bytes, on_cuda, sync_d2h, sync_h2d
from . import nvme_device, nvme_space, pool
from .heap import HeapSettings
from .nvme_space import CHUNK_BYTES

__all__ = ["NvmeTier", "phase_buffer", "WRITE_BATCH"]

log = logging.getLogger("offload")

# Direct writes handed to the engine at once (csrc/nvme_transfers.hpp NOTE [Write batches]).
WRITE_BATCH = 32

# Every write and read in flight for one tier's payloads, and the payloads themselves (what
# each holds, and why the garbage collector need not track them: csrc/nvme_payload.cpp).
# None without the core: this tier runs only with it.
_NvmeTransfers = _ext.core_attr("NvmeTransfers")


def phase_buffer(core, nbytes: int, phase: int, alignment: int) -> torch.Tensor:
    """`nbytes` of fresh host memory whose address % `alignment` is `phase` (NOTE [Phase]),
    as a uint8 tensor (storage offset 0, like the original storage) that keeps it alive."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    room = nbytes + alignment
    block = core.HostArena(room, pinned=False).allocate(room)
    skip = (phase - block.ptr) % alignment
    return torch.frombuffer(block, dtype=torch.uint8, count=nbytes, offset=skip)


# What a save or load after the tier closed says (the core says the same: nvme_transfers.hpp).
_USED_AFTER_CLOSE = (
    "offload: nvme tier used after close (the context's close() ran inside its block, or the "
    "step was freed after an exception); call ctx.close() after the block and its backward")


class NvmeTier(Tier):
    """Slab files in `dirs` (striped), written and read through a staging arena."""

    name = "nvme"
    stores_cpu_in_core = True   # store_cpu once a CPU storage was stored (Tier.store_cpu)

    def __init__(self, dirs: tuple[str, ...], capacity_bytes: Callable[[], int], *,
                 workers: int, staging_bytes: int, stats: Stats, core,
                 cpu_heap: str = "reuse", checksum: bool = False,
                 max_bytes_per_s: int = 0,
                 capacity_key: Hashable = None, capacity_source: str = "",
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
            capacity_source: What a new store's capacity is taken of, in words (a store
                shared with another context says its own: `self.capacity_source`).
            copies: Returns the context's CopyStreams for a CUDA device; with a CUDA build
                of the extension device copies are then chained with the I/O.
            max_bytes_per_s: The engine's throughput cap (OFFLOAD_NVME_MAX_BW; 0: none).
        """
        if _NvmeTransfers is None:
            raise ExtensionUnavailable(
                "offload: the compiled core offload._C predates the nvme tier's transfers "
                f"(csrc/nvme_transfers.cpp): {_ext.HOW_TO_BUILD}")
        self._stats = stats
        self._core = core
        # The chained paths need write_after_event / read_then_h2d (CUDA builds only).
        self._copies = copies if getattr(core, "cuda_compiled", False) else None
        self._dirs = tuple(os.path.realpath(d) for d in dirs)  # the budget's key
        self._arena = None
        self._transfers = None
        self._closed = False
        self.capacity_source = ""
        # CPU sources: freed activation RAM should be reused, not returned and refaulted.
        self._heap = HeapSettings(cpu_heap)
        self._store = nvme_space.acquire_sized(
            self._dirs, capacity_bytes, core, workers=workers, checksum=checksum,
            max_bytes_per_s=max_bytes_per_s, capacity_key=capacity_key,
            source=capacity_source)
        if self._store is None:
            return
        try:   # whatever stops the opening (a Ctrl-C too) gives the store back
            self._open(staging_bytes, core, stats)
        except BaseException:
            nvme_space.release(self._dirs, self._store, keep=True)
            self._store = None
            raise

    def _open(self, staging_bytes: int, core, stats: Stats) -> None:
        """The rest of the opening, once the store is acquired."""
        self.capacity_source = nvme_space.capacity_source(self._dirs)
        # Not pinned on a CPU-only run (nothing to DMA from); pinned iff CUDA works.
        self._arena_key = max(staging_bytes, core.DEFAULT_ALIGNMENT)
        self._arena = pool.take("nvme-staging", self._arena_key,
                                lambda: core.HostArena(self._arena_key, pinned=None))
        self._arena.reset_peak()
        # A shared store counts on across steps and contexts: the difference is this tier's
        # (plus any other context's bounced bytes in the meantime).
        self._bounced_at_open = self._store.bytes_bounced
        self._alignment = max(self._store.alignment, core.DEFAULT_ALIGNMENT)
        # At most `staging_bytes` of source tensors held for their direct writes, the RAM
        # the staging arena would have used; batches of WRITE_BATCH writes or CHUNK_BYTES.
        self._transfers = _NvmeTransfers(self._store, self._arena, self._alignment,
                                         max(staging_bytes, 1), CHUNK_BYTES, WRITE_BATCH,
                                         stats, ranges, torch.frombuffer, torch.uint8)
        # A dying record gives its payload back through `tier.release` (csrc/saved_record.cpp):
        # the core's own, with no Python frame between (the method below says what it does).
        self.release = self._transfers.release
        self.cpu_reads = self._transfers   # a CPU payload's reads (Tier.cpu_reads)

    @classmethod
    def open(cls, config, stats: Stats, copies) -> "NvmeTier":
        from .._ext import load_core

        tier = cls(config.nvme_dir, config.nvme_capacity_bytes, workers=config.io_workers,
                   staging_bytes=config.staging_bytes, cpu_heap=config.cpu_heap,
                   checksum=config.nvme_checksum, max_bytes_per_s=config.nvme_max_bw,
                   stats=stats, core=load_core(), capacity_key=config.nvme_bytes,
                   capacity_source=config.nvme_capacity_source(), copies=copies)
        try:   # not handed to the step yet: closed here if anything stops us (a Ctrl-C)
            figures = stats.tier(cls.name)
            figures.capacity_bytes, figures.capacity_source = tier.capacity_bytes, \
                tier.capacity_source
        except BaseException:
            tier.close(reuse=False)
            raise
        return tier

    def fold(self, stats: Stats) -> None:
        transfers = self._transfers
        if transfers is None:
            return
        written, read, peak_writes, peak_reads, write_busy, read_busy = transfers.take_counts()
        stats.nvme_written_bytes += written
        stats.nvme_read_bytes += read
        stats.peak_writes_inflight = max(stats.peak_writes_inflight, peak_writes)
        stats.peak_reads_inflight = max(stats.peak_reads_inflight, peak_reads)
        stats.write_clock.add_intervals(write_busy)
        stats.read_clock.add_intervals(read_busy)

    def report(self, stats: Stats) -> None:
        self.fold(stats)
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
        return self._transfers.own_bytes if self._transfers is not None else 0

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

    @property
    def _live(self) -> set:
        """The payloads stored and not yet released (abort frees them)."""
        return self._transfers.live if self._transfers is not None else set()

    # ---------------------------------------------------------------- write path
    def store(self, storage: torch.UntypedStorage, device: torch.device):
        if self._closed:
            raise UsedAfterCloseError(_USED_AFTER_CLOSE)
        if self._store is None:
            return None  # no room at all (see __init__)
        if not on_cuda(device):
            self._heap.acquire()  # heap.py: CPU RAM is freed and reused during the step
            # The heap is held from here on: the core's packer may store CPU storages
            # itself (Tier.store_cpu).
            self.store_cpu = self._transfers.store_direct
            return self.store_cpu(storage, device)   # written in place
        return self._store_from_device(storage, device)

    def _store_from_device(self, storage: torch.UntypedStorage, device: torch.device):
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
                payload, nvme_device.write_after_d2h(self._store, payload.extent, ticket), ticket)
            return payload  # the copy and the engine hold the block (copies Notes 3, 4)
        # No CopyStreams, or no staging space: a host copy, written like a CPU tensor.
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
    def prefetchable(self, payload) -> bool:
        return True

    def prefetched(self, payload) -> bool:
        return payload.reading

    def released(self, payload) -> bool:
        return payload.released

    def prefetch(self, payload) -> bool:
        if not payload.cuda:
            return self._transfers.prefetch(payload)
        # (A failed write's error is for its own fetch to raise, not a read-ahead's caller.)
        if payload.reading or payload.released or payload.write_failed:
            return False
        return self._start_device_read(payload)

    def _start_device_read(self, payload) -> bool:
        """Start loading a CUDA payload: read → H2D chained in the engine when a staging
        block is free, else a host read that `fetch` copies over. False when, while its
        write was waited for, another thread released the payload or started its read."""
        if self._closed:
            raise UsedAfterCloseError(_USED_AFTER_CLOSE)
        transfers = self._transfers
        transfers.before_read(payload)   # its own write first (NOTE [Read after write])
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
                transfers.add_chained_read(payload, nvme_device.read_then_h2d(
                    self._copies(payload.device), self._store, payload.extent, block,
                    payload.nbytes))
                return True
        transfers.start_read(payload)
        return True

    def fetch(self, payload) -> torch.Tensor:
        """The payload's bytes on its device: waits for this payload's read only."""
        if not payload.cuda:
            return self._transfers.fetch(payload)
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
                self._start_device_read(payload)
        if payload.reading_on_device:
            return transfers.fetch(payload)   # chained: the stream waits on the H2D
        return sync_h2d(transfers.fetch(payload), payload.device, self._stats)

    # ---------------------------------------------------------------- housekeeping
    def poll(self) -> None:
        """Retire landed writes (oldest first), note finished reads, free deferred memory."""
        if self._transfers is not None:
            self._transfers.poll()

    def flush(self) -> None:
        """Hand the writes still batched to the engine (csrc/nvme_transfers.hpp NOTE [Write
        batches]): a backward run after the block may come much later."""
        if self._transfers is not None:
            self._transfers.submit()

    def release(self, payload) -> None:
        """Give the payload's extent back at once; never waits for I/O."""
        self._transfers.release(payload)

    def drain(self) -> None:
        """Wait for every write in flight and free deferred memory."""
        if self._transfers is not None:
            self._transfers.drain()

    def abort(self) -> None:
        if self._transfers is not None:
            self._transfers.abort()

    def close(self, reuse: bool = True) -> None:
        """Close: wait for this tier's own I/O, then let go of the shared store (kept open
        for the next step when clean and idle, NOTE [One budget]) and the arena."""
        if self._closed:
            return
        self._closed = True
        store, arena, transfers = self._store, self._arena, self._transfers
        clean = False
        try:   # whatever stops the closing (a Ctrl-C too), the store is given back
            self.store_cpu = None
            self._heap.release()
            if store is None:
                return
            clean = reuse and transfers.idle
            if not clean:
                # Every transfer of this tier is over, so the memory it reads or writes may
                # go. The store may live on (other contexts use it): unlike closing it, this
                # waits only for our own requests; failures are dropped.
                transfers.wait_all()
        finally:
            if store is not None:
                try:
                    self.fold(self._stats)
                    self._stats.nvme_bounced_bytes += store.bytes_bounced - self._bounced_at_open
                finally:
                    transfers.close()
                    self._store = self._arena = None
                    nvme_space.release(self._dirs, store, keep=clean)
        # Blocks still viewed by live tensors keep their memory; such an arena is dropped
        # (freed with its last block), not reused.
        if clean and arena.used_bytes == 0:
            pool.give_back("nvme-staging", self._arena_key, arena)
