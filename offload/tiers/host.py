"""The host tier: host RAM.

CPU tensors: the compute device *is* host RAM, so the payload just holds a reference to the
storage's bytes (no copy; counted as resident). The capacity still applies, so
`OFFLOAD_TIERS=host,nvme OFFLOAD_HOST_BYTES=1GiB` keeps 1 GiB in RAM and spills the rest.

CUDA tensors: bytes are copied into a block of a pinned host arena and copied back on fetch.
Pinned memory is allocated in chunks of `PINNED_CHUNK_BYTES` as the tier fills (never one
pinned allocation per tensor, and not the whole capacity up front: the default capacity is
half the RAM, and pinning 64 GiB at the first tensor would stall the step for seconds); the
chunks are kept across steps (pool.py).
With a `copies` provider (the context's CopyStreams per device, offload/cuda_streams.py) the
copies are asynchronous: `store` starts the D2H on the offload stream and returns (Notes 1-3
there: the producer's event, the source and the pinned block are held by the pending copy);
`prefetch` starts the H2D on the prefetch stream, ordered after the D2H (Note 5); `fetch`
makes the consuming stream wait on the H2D's event (Notes 6, 7), never the host. A tensor
needed again while its D2H is still pending is served from the source itself
(`device_tensor_if_held`: nothing to copy back). Without a provider (tests, tools) the copies
are synchronous `copy_` calls.
"""
from __future__ import annotations

import logging
from typing import Callable, Hashable

import torch

from ..errors import UsedAfterCloseError
from ..stats import Stats
from . import pool
from .base import Payload, Tier, sync_d2h, sync_h2d

__all__ = ["HostTier"]

log = logging.getLogger("offload")

PINNED_CHUNK_BYTES = 1 << 30


class _RefPayload(Payload):
    """A CPU storage's bytes, held by reference (device == host)."""

    __slots__ = ("_flat", "_on_release")

    resident = True  # host RAM is the device's memory on a CPU-only run

    def __init__(self, flat: torch.Tensor, on_release: Callable[[int], None]) -> None:
        super().__init__(flat.numel(), flat.device)
        self._flat = flat
        self._on_release = on_release  # the tier's capacity accounting

    @property
    def prefetched(self) -> bool:
        return True

    def fetch(self) -> torch.Tensor:
        if self._flat is None:
            raise UsedAfterCloseError("offload: host payload used after release")
        return self._flat

    def release(self) -> None:
        if self._flat is not None:
            self._flat = None
            self._on_release(self.nbytes)


class _PinnedPayload(Payload):
    """A CUDA storage's bytes copied into pinned host memory.

    Owns its transfers (the D2H ticket, the H2D ticket of a reload) and the pinned view; the
    tier only hands it the CopyStreams to use and counts its capacity.
    """

    __slots__ = ("_host", "_copies", "_stats", "_on_release", "_d2h", "_h2d")

    def __init__(self, host: torch.Tensor, device: torch.device, stats: Stats,
                 on_release: Callable[[int], None], copies=None, d2h=None) -> None:
        super().__init__(host.numel(), device)
        self._host = host  # uint8 view of a pinned arena block (keeps the block alive)
        self._copies = copies  # CopyStreams of `device` (None: copied synchronously)
        self._stats = stats
        self._on_release = on_release
        self._d2h = d2h    # D2HTicket of the async copy (None: copied synchronously)
        self._h2d = None   # H2DTicket started by prefetch, not yet used

    @property
    def prefetchable(self) -> bool:  # an async reload is worth starting early
        return self._d2h is not None

    @property
    def prefetched(self) -> bool:
        return self._h2d is not None

    @property
    def released(self) -> bool:
        return self._host is None

    def prefetch(self) -> bool:
        if self._h2d is not None or self._host is None or self._d2h is None:
            return False
        self._h2d = self._reload()
        return True

    def fetch(self) -> torch.Tensor:
        if self._host is None:
            raise UsedAfterCloseError("offload: host payload used after release")
        if self._d2h is None:
            return sync_h2d(self._host, self.device, self._stats)
        held = self._d2h.device_tensor_if_held()
        if held is not None:  # needed again before its D2H finished: no copy back
            self._stats.bounce_hits += 1
            return held
        if self._h2d is None:
            self._h2d = self._reload()
        ticket, self._h2d = self._h2d, None
        return ticket.tensor_for_use()  # the current stream waits on the GPU (Notes 6, 7)

    def release(self) -> None:
        if self._host is not None:
            # The block returns to the arena with its last view; a pending copy holds its
            # own references (cuda_streams Notes 3, 8), so dropping ours never races.
            self._host = self._d2h = self._h2d = self._copies = None
            self._on_release(self.nbytes)

    def _reload(self):
        # Note 5 (cuda_streams.py): `after` orders the H2D after a D2H not yet seen done.
        return self._copies.reload(self._host, self.nbytes, after=self._d2h)


class HostTier(Tier):
    """Host RAM with a byte capacity; pinned arena for CUDA sources."""

    name = "host"

    def __init__(self, capacity_bytes: int, stats: Stats, capacity_key: Hashable = None,
                 copies: Callable[[torch.device], object] | None = None) -> None:
        """Args:
            copies: Returns the context's CopyStreams for a CUDA device (async copies);
                None: synchronous copies.
        """
        self._copies = copies
        self._capacity_bytes = capacity_bytes
        self._capacity_key = capacity_key if capacity_key is not None else capacity_bytes
        self._used_bytes = 0
        self._stats = stats
        self._arenas: list | None = None  # pinned HostArena chunks, taken from the pool lazily
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    def store(self, flat: torch.Tensor) -> Payload | None:
        nbytes = flat.numel()
        if self._used_bytes + nbytes > self._capacity_bytes:
            return None
        if flat.device.type == "cpu":
            payload: Payload = _RefPayload(flat, self._released)
        else:
            host = self._allocate_pinned(nbytes)
            if host is None:
                return None
            if self._copies is not None:
                copies = self._copies(flat.device)
                ticket = copies.offload(flat, host)  # returns at once
                payload = _PinnedPayload(host, flat.device, self._stats, self._released,
                                         copies, ticket)
            else:
                sync_d2h(flat, host, self._stats)
                payload = _PinnedPayload(host, flat.device, self._stats, self._released)
        self._used_bytes += nbytes
        return payload

    def _allocate_pinned(self, nbytes: int) -> torch.Tensor | None:
        if self._arenas is None:
            self._arenas = pool.take("host-pinned", self._capacity_key, list)
        for arena in self._arenas:
            block = arena.allocate(nbytes)
            if block is not None:
                return torch.frombuffer(block, dtype=torch.uint8)
        pinned_bytes = sum(a.capacity_bytes for a in self._arenas)
        room = self._capacity_bytes - pinned_bytes
        if room < nbytes:
            return None
        from .._ext import load_core

        # cudaHostAlloc costs milliseconds: grow by large chunks, never per tensor.
        arena = load_core().HostArena(min(room, max(PINNED_CHUNK_BYTES, nbytes)), pinned=True)
        self._arenas.append(arena)
        block = arena.allocate(nbytes)
        return torch.frombuffer(block, dtype=torch.uint8) if block is not None else None

    def _released(self, nbytes: int) -> None:
        self._used_bytes -= nbytes

    def close(self, reuse: bool = True) -> None:
        # Blocks still viewed by live tensors keep their memory; such an arena goes away
        # with the last of them instead of being reused.
        self._closed = True
        arenas, self._arenas = self._arenas, None
        if arenas and reuse and all(a.used_bytes == 0 for a in arenas):
            pool.give_back("host-pinned", self._capacity_key, arenas)
