"""The host tier: host RAM.

CPU tensors: the compute device *is* host RAM, so the payload just holds a reference to the
storage's bytes (no copy; counted as resident). The capacity still applies, so
`OFFLOAD_TIERS=host,nvme OFFLOAD_HOST_BYTES=1GiB` keeps 1 GiB in RAM and spills the rest.
With the core, the tier's ledger makes these payloads in C, and the core's packer stores
plain CPU activations through it without a Python frame (`store_cpu`).

CUDA tensors: bytes are copied into a block of a pinned host arena and copied back on fetch.
Pinned memory is allocated in chunks of `PINNED_CHUNK_BYTES` as the tier fills (never one
pinned allocation per tensor, and not the whole capacity up front: the default capacity is
half the RAM, and pinning 64 GiB at the first tensor would stall the step for seconds); the
chunks are kept across steps (pool.py).
With a `copies` provider (the context's CopyStreams per device, offload/tiers/copies.py) the
copies are asynchronous: `store` starts the D2H on the offload stream and returns (Notes 1-3
there: the producer's event, the source and the pinned block are held by the pending copy);
`prefetch` starts the H2D on the prefetch stream, ordered after the D2H (Note 5); `fetch`
makes the consuming stream wait on the H2D's event (Notes 6, 7), never the host. A tensor
needed again while its D2H is still pending is served from the source itself
(`device_tensor_if_held`: nothing to copy back). Without a provider (tests, tools) the copies
are synchronous `copy_` calls.
"""
from __future__ import annotations

from typing import Callable, Hashable

import torch

from .. import _ext
from ..errors import UsedAfterCloseError
from ..util.ranges import D2H, NO_SPAN, WAIT_READ, profiling, span
from ..util.stats import Stats
from . import host_budget, pool
from .base import Payload, Tier, flat_bytes, on_cuda, sync_d2h, sync_h2d

__all__ = ["HostTier"]


PINNED_CHUNK_BYTES = 1 << 30


class _PyStorageRef(Payload):
    """A CPU storage's bytes, held by reference (device == host): the core's `StorageRef`
    (csrc/storage_ref.cpp, an object the garbage collector does not walk; one per stored
    storage of a CPU run) for a process without the core."""

    __slots__ = ("storage",)

    resident = True  # host RAM is the device's memory on a CPU-only run

    def __init__(self, storage: torch.UntypedStorage, nbytes: int,
                 device: torch.device) -> None:
        super().__init__(nbytes, device)
        self.storage: torch.UntypedStorage | None = storage   # None once released


_RefPayload = _ext.load_core().StorageRef if _ext.core_available() else _PyStorageRef


class _PyHostLedger:
    """The tier's byte count against its capacity, and the CPU payloads it holds: the core's
    `HostLedger` (csrc/storage_ref.cpp, whose `store` the core's packer calls: the tier's
    `store_cpu`) for a process without the core. Pinned copies are counted through `take`
    and `give`, so both kinds of payload share one count and one capacity. With `budget`
    (the process's: NOTE [One host budget] in host_budget.py) the bytes count into it too
    and fit into its capacity."""

    def __init__(self, capacity_bytes: int, budget: "_PyHostLedger | None" = None) -> None:
        self._capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.budget = budget
        self.ledgers = 0   # as a budget: the ledgers that count into it
        if budget is not None:
            budget.ledgers += 1
        self._live: set[_PyStorageRef] = set()

    @property
    def capacity_bytes(self) -> int:
        return self.budget.capacity_bytes if self.budget is not None else self._capacity_bytes

    def take(self, nbytes: int) -> bool:
        if nbytes < 0:
            raise ValueError(f"offload: HostLedger: nbytes must be >= 0, got {nbytes}")
        fits = self.budget if self.budget is not None else self
        if fits.used_bytes + nbytes > fits.capacity_bytes:
            return False
        fits.used_bytes += nbytes
        if fits is not self:
            self.used_bytes += nbytes
        return True

    def _uncount(self, nbytes: int) -> None:
        self.used_bytes -= nbytes
        if self.budget is not None:
            self.budget.used_bytes -= nbytes

    def give(self, nbytes: int) -> None:
        if not 0 <= nbytes <= self.used_bytes:
            raise ValueError(f"offload: HostLedger.give({nbytes}) with only "
                             f"{self.used_bytes} bytes counted")
        self._uncount(nbytes)

    def detach(self) -> None:
        if self.budget is not None:
            self.budget.used_bytes -= self.used_bytes
            self.budget.ledgers -= 1
            self.budget = None

    __del__ = detach   # as the core's: what it still counts leaves the budget with it

    def store(self, storage: torch.UntypedStorage, device: torch.device) -> Payload | None:
        nbytes = storage.nbytes()
        if not self.take(nbytes):
            return None
        ref = _PyStorageRef(storage, nbytes, device)
        self._live.add(ref)
        return ref

    def release(self, ref: _PyStorageRef) -> None:
        if ref.storage is None:
            return
        ref.storage = None
        self._uncount(ref.nbytes)
        self._live.discard(ref)

    def abort(self) -> None:
        for ref in list(self._live):
            self.release(ref)

    def __len__(self) -> int:
        return len(self._live)


_HostLedger = _ext.load_core().HostLedger if _ext.core_available() else _PyHostLedger


class _PinnedPayload(Payload):
    """A CUDA storage's bytes copied into pinned host memory, and its transfers: the D2H
    ticket, the H2D ticket of a reload (the tier starts and uses them: NOTE [One owner])."""

    __slots__ = ("host", "d2h", "h2d")

    def __init__(self, host: torch.Tensor, device: torch.device, d2h=None) -> None:
        super().__init__(host.numel(), device)
        self.host: torch.Tensor | None = host  # uint8 view of a pinned arena block
        self.d2h = d2h     # D2HTicket of the async copy (None: copied synchronously)
        self.h2d = None    # H2DTicket started by prefetch, not yet used


class HostTier(Tier):
    """Host RAM with a byte capacity; pinned arena for CUDA sources."""

    name = "host"
    # A CPU run's payloads are made by the ledger's `store`, in C with the core: the core's
    # packer stores plain CPU activations through it (Tier.store_cpu).
    stores_cpu_in_core = _ext.core_available()

    def __init__(self, capacity_bytes: int, stats: Stats, capacity_key: Hashable = None,
                 copies: Callable[[torch.device], object] | None = None,
                 capacity_source: str = "") -> None:
        """Args:
            capacity_key: The setting the capacity came from (OFFLOAD_HOST_BYTES's spec):
                tiers of one setting share the process's budget silently.
            copies: Returns the context's CopyStreams for a CUDA device (async copies);
                None: synchronous copies.
            capacity_source: What the capacity was taken of, in words (a budget in use
                says its own: `self.capacity_source`).
        """
        self._copies = copies
        self._capacity_key = capacity_key if capacity_key is not None else capacity_bytes
        # The byte count of both kinds of payload, and the CPU ones (abort frees them),
        # counted into the process's budget too (NOTE [One host budget]).
        self._ledger, self.capacity_source = host_budget.ledger_for(
            self._capacity_key, capacity_bytes, _HostLedger, capacity_source)
        # The core's ledger makes the core's refs; a subclass with its own `store` is
        # called through it (the core's packer must not go around it).
        if _RefPayload is not _PyStorageRef and type(self).store is HostTier.store:
            self.store_cpu = self._ledger.store
        self._stats = stats
        self._arenas: list | None = None  # pinned HostArena chunks, taken from the pool lazily
        self._pinned: set[Payload] = set()  # pinned copies not yet released (abort frees them)
        self._closed = False

    @classmethod
    def open(cls, config, stats: Stats, copies) -> "HostTier":
        capacity, source = config.host_capacity()
        tier = cls(capacity, stats, capacity_key=config.host_bytes, copies=copies,
                   capacity_source=source)
        figures = stats.tier(cls.name)
        # The process's budget's: another step's, while one is in use.
        figures.capacity_bytes = tier._ledger.capacity_bytes
        figures.capacity_source = tier.capacity_source
        return tier

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def capacity_bytes(self) -> int:
        return self._ledger.capacity_bytes   # the process's budget's

    @property
    def used_bytes(self) -> int:
        return self._ledger.used_bytes       # this step's own

    def usage_text(self) -> str:
        from ..util.sizes import format_bytes

        budget = self._ledger.budget
        if budget is None or budget.used_bytes == self._ledger.used_bytes:
            return super().usage_text()
        return (f"host {format_bytes(budget.used_bytes)} of {format_bytes(budget.capacity_bytes)}"
                f" used, {format_bytes(self._ledger.used_bytes)} of it by this step")

    # ---------------------------------------------------------------- store / load
    def store(self, storage: torch.UntypedStorage, device: torch.device) -> Payload | None:
        if not on_cuda(device):
            return self._ledger.store(storage, device)
        nbytes = storage.nbytes()
        if not self._ledger.take(nbytes):
            return None
        flat = flat_bytes(storage)
        host = self._allocate_pinned(nbytes)
        if host is None:
            self._ledger.give(nbytes)
            return None
        if self._copies is not None:
            with span(D2H) if profiling() else NO_SPAN:  # returns at once
                ticket = self._copies(device).offload(flat, host)
            payload = _PinnedPayload(host, device, ticket)
        else:
            sync_d2h(flat, host, self._stats)
            payload = _PinnedPayload(host, device)
        self._pinned.add(payload)
        return payload

    def prefetchable(self, payload: Payload) -> bool:
        # An async reload is worth starting early; a CPU reference or a sync copy is not.
        return type(payload) is _PinnedPayload and payload.d2h is not None

    def prefetched(self, payload: Payload) -> bool:
        return type(payload) is _RefPayload or payload.h2d is not None

    def released(self, payload: Payload) -> bool:
        return (payload.storage if type(payload) is _RefPayload else payload.host) is None

    def prefetch(self, payload: Payload) -> bool:
        if not self.prefetchable(payload) or payload.h2d is not None or payload.host is None:
            return False
        payload.h2d = self._reload(payload)
        return True

    def fetch(self, payload: Payload) -> torch.Tensor:
        if type(payload) is _RefPayload:
            if payload.storage is None:
                raise UsedAfterCloseError("offload: host payload used after release")
            return flat_bytes(payload.storage)
        if payload.host is None:
            raise UsedAfterCloseError("offload: host payload used after release")
        if payload.d2h is None:
            return sync_h2d(payload.host, payload.device, self._stats)
        held = payload.d2h.device_tensor_if_held()
        if held is not None:  # needed again before its D2H finished: no copy back
            self._stats.pending_copy_hits += 1
            return held
        if payload.h2d is None:
            payload.h2d = self._reload(payload)
        ticket, payload.h2d = payload.h2d, None
        with span(WAIT_READ) if profiling() else NO_SPAN:
            return ticket.tensor_for_use()  # the current stream waits on the GPU (Notes 6, 7)

    def release(self, payload: Payload) -> None:
        if type(payload) is _RefPayload:
            self._ledger.release(payload)
            return
        if payload.host is None:
            return
        # The block returns to the arena with its last view; a pending copy holds its
        # own references (copies Notes 3, 8), so dropping ours never races.
        payload.host = payload.d2h = payload.h2d = None
        self._ledger.give(payload.nbytes)
        self._pinned.discard(payload)

    def abort(self) -> None:
        self._ledger.abort()
        for payload in list(self._pinned):
            self.release(payload)

    def _reload(self, payload: _PinnedPayload):
        # Note 5 (copies.py): `after` orders the H2D after a D2H not yet seen done.
        return self._copies(payload.device).reload(payload.host, payload.nbytes,
                                                   after=payload.d2h)

    def _allocate_pinned(self, nbytes: int) -> torch.Tensor | None:
        if self._arenas is None:
            self._arenas = pool.take("host-pinned", self._capacity_key, list)
        for arena in self._arenas:
            block = arena.allocate(nbytes)
            if block is not None:
                return torch.frombuffer(block, dtype=torch.uint8)
        pinned_bytes = sum(a.capacity_bytes for a in self._arenas)
        room = self._ledger.capacity_bytes - pinned_bytes   # the budget's, as `take`'s
        if room < nbytes:
            return None
        from .._ext import load_core   # looked up at the call: tests stand in for it

        # cudaHostAlloc costs milliseconds: grow by large chunks, never per tensor.
        arena = load_core().HostArena(min(room, max(PINNED_CHUNK_BYTES, nbytes)), pinned=True)
        self._arenas.append(arena)
        block = arena.allocate(nbytes)
        return torch.frombuffer(block, dtype=torch.uint8) if block is not None else None

    def close(self, reuse: bool = True) -> None:
        # Blocks still viewed by live tensors keep their memory; such an arena goes away
        # with the last of them instead of being reused.
        self._closed = True
        self.store_cpu = None   # the core's packer may not store through it any more
        self._ledger.detach()   # what it still counts is no longer the process's
        arenas, self._arenas = self._arenas, None
        if arenas and reuse and all(a.used_bytes == 0 for a in arenas):
            pool.give_back("host-pinned", self._capacity_key, arenas)
