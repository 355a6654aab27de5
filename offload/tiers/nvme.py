"""The nvme tier: payloads written to private slab files on local SSDs by the C++ engine.

What each stored storage pays runs in the core's `NvmeTransfers` (csrc/nvme_transfers.cpp):
the extent, the write and its batch, the backpressure, the read, the wait, the hand-out and
the release, with no Python in between; its notes say how ([Write batches], [Read after
write], [Deferred free]). This module keeps what is per step or per device: the store and
staging arena it takes from the process, and the step's figures; a CUDA tensor's copies that
feed and follow the I/O are nvme_device.py's `DevicePaths`.

Write path (forward), CPU tensors. `store` writes straight from the tensor's own memory (no
staging copy): the extent is allocated with the tensor's *phase* (address modulo the O_DIRECT
alignment), so the engine moves all but the partial sectors at the two ends in place (NOTE
[Phase]). The tensor is kept alive until its write lands; `store` waits only when more than
`staging_bytes` of such writes are in flight (it then retires the oldest: counted as forward
stall).

Write path, CUDA tensors (nvme_device.py). `store` starts the D2H into a pinned staging
block and the engine writes the block once the copy's event completes; a tensor that does
not fit the staging arena (or any, without CopyStreams) is copied into a page-aligned host
buffer and written from there like a CPU tensor.

Read path (backward). `prefetch` reads into memory of the payload's phase (a slice of the
staging arena, or of a fresh buffer when it is full) after the payload's own write; `fetch`
waits on that read only and returns a zero-copy uint8 view that holds the memory, so it
returns when autograd drops it. A CUDA payload's read is chained to its H2D in the engine; a
tensor needed again while its D2H is pending is served from the source (`device_tensor_if_held`).

NOTE [Phase] O_DIRECT needs the memory address and the file offset aligned. Instead of
copying each tensor into aligned staging memory, the extent's data starts `phase` bytes past
an aligned file offset, with phase = address % alignment; reads land in memory of the same
phase: a staging copy of every tensor costs the training thread a memcpy of all it saves
(docs/benchmarks.md, *Why the runtime's constants*). Phases that are not a multiple of 64
(memory not from torch's allocator) use phase 0 and go through the bounce buffer whole, so
that the read-back view's byte offset stays a multiple of every dtype's size. Small tensors
whose blocks adjoin and whose writes (or reads) queue together are the exception by design:
the engine moves them as one transfer through its bounce buffer (csrc/io_engine.cpp NOTE
[Small chunks travel together]), a copy of a few KiB each in place of a system call each.
The engine reads the tensor's memory while the forward goes on: an in-place change autograd
can see (version counter) raises at unpack as it would without offload; one made through
`.data` (invisible to the version counter) before the write lands may or may not reach the
disk, where plain autograd would use the changed values.

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
from ..util.sizes import format_bytes
from ..util.stats import Stats
from .base import Tier, on_cuda
from . import nvme_space, pool
from .heap import HeapSettings
from .nvme_device import USED_AFTER_CLOSE, DevicePaths
from .nvme_space import CHUNK_BYTES

__all__ = ["NvmeTier", "WRITE_BATCH"]

log = logging.getLogger("offload")

# Direct writes handed to the engine at once (csrc/nvme_transfers.hpp NOTE [Write batches]).
WRITE_BATCH = 32

# Every write and read in flight for one tier's payloads, and the payloads themselves (what
# each holds, and why the garbage collector need not track them: csrc/nvme_payload.cpp).
# None without the core: this tier runs only with it.
_NvmeTransfers = _ext.core_attr("NvmeTransfers")


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
        self._pid = os.getpid()   # a forked child's copy of the tier is not its own (`abort`)
        self._dirs = tuple(os.path.realpath(d) for d in dirs)  # the budget's key
        self._arena = None
        self._transfers = None
        self._device: DevicePaths | None = None   # a CUDA tensor's way (`_open`)
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
            self._open(staging_bytes, core, stats, copies)
        except BaseException:
            nvme_space.release(self._dirs, self._store, keep=True)
            self._store = None
            raise

    def _open(self, staging_bytes: int, core, stats: Stats, copies) -> None:
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
        # The chained paths need write_after_event / read_then_h2d (CUDA builds only).
        self._device = DevicePaths(self._store, self._arena, self._transfers, self._alignment,
                                   copies if getattr(core, "cuda_compiled", False) else None,
                                   core, stats)

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
            raise UsedAfterCloseError(USED_AFTER_CLOSE)
        if self._store is None:
            return None  # no room at all (see __init__)
        if not on_cuda(device):
            self._heap.acquire()  # heap.py: CPU RAM is freed and reused during the step
            # The heap is held from here on: the core's packer may store CPU storages
            # itself (Tier.store_cpu).
            self.store_cpu = self._transfers.store_direct
            return self.store_cpu(storage, device)   # written in place
        return self._device.store(storage, device)

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
        return self._device.prefetch(payload)

    def fetch(self, payload) -> torch.Tensor:
        """The payload's bytes on its device: waits for this payload's read only."""
        if not payload.cuda:
            return self._transfers.fetch(payload)
        return self._device.fetch(payload)

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
        # In a child forked inside the block (leaving it with an exception, a sys.exit) the
        # payloads and their I/O are the parent's, and the store was let go at the fork
        # (process.py): nothing here to free, where it raised "a child cannot read the
        # parent's nvme store", logged as an error about a backward never run.
        if self._transfers is not None and os.getpid() == self._pid:
            self._transfers.abort()

    def close(self, reuse: bool = True) -> None:
        """Close: wait for this tier's own I/O, then let go of the shared store (kept open
        for the next step when clean and idle, NOTE [One budget]) and the arena."""
        if self._closed:
            return
        self._closed = True
        if self._device is not None:
            self._device.close()
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
