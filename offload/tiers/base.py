"""The tier interface: a tier stores and loads a flat byte payload.

The hook layer (offload/hooks.py) turns tensors into flat uint8 payloads (one per storage)
and back, so a tier never sees dtypes, shapes or views. A tier is chosen per storage by
offload/placement.py; spilling to the next tier happens when `store` returns None.

Life of a payload: `store` (forward; may copy asynchronously) → optional `prefetch` (starts
the load early, called by offload/prefetch.py) → `fetch` (backward; waits only for this
payload) → `release` (when autograd frees the last saved tensor of the storage). `release`
must never block on I/O: a tier defers freeing space that an in-flight transfer still uses.
"""
from __future__ import annotations

import abc
import time

import torch

from ..cuda_streams import refuse_graph_capture

__all__ = ["Tier", "Payload", "sync_d2h", "sync_h2d"]


class Payload(abc.ABC):
    """One storage's bytes held by a tier."""

    __slots__ = ("nbytes", "device", "order_pos", "__weakref__")

    #: True when the bytes still occupy the compute device's memory (see Tier.resident).
    resident = False
    #: True when `prefetch` starts a real transfer (the prefetcher tracks such payloads).
    prefetchable = False

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.device = device  # where the bytes came from and must go back to
        self.order_pos = -1   # position in pack order, set by the prefetcher

    def prefetch(self) -> bool:
        """Start bringing the bytes back without waiting; True if a transfer was started."""
        return False

    @property
    def prefetched(self) -> bool:
        """Whether a load is in flight or done (so `fetch` will not start one)."""
        return False

    @property
    def released(self) -> bool:
        return False

    @abc.abstractmethod
    def fetch(self) -> torch.Tensor:
        """The bytes as a 1-D uint8 tensor on `device`; waits for this payload only.

        The returned tensor owns (keeps alive) whatever memory holds the bytes; the payload
        drops its own reference, so the memory returns when the caller drops the tensor.
        May be called more than once (retain_graph): it then loads again.
        """

    @abc.abstractmethod
    def release(self) -> None:
        """Free the tier's space; idempotent; never waits for I/O."""


class Tier(abc.ABC):
    """A place for payloads with a capacity. `store` returns None when it is full."""

    name: str = "?"
    #: True when stored bytes still occupy the compute device's memory (the host tier on a
    #: CPU-only run: there the device *is* host RAM).
    resident: bool = False

    @abc.abstractmethod
    def store(self, flat: torch.Tensor) -> Payload | None:
        """Take a copy of (or a reference to) the bytes of `flat` (1-D uint8, any device).

        Returns None when the tier has no room; the caller spills to the next tier.
        """

    @property
    @abc.abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    @abc.abstractmethod
    def used_bytes(self) -> int: ...

    @property
    def closed(self) -> bool:
        return False

    def usage_text(self) -> str:
        """How full the tier is, for messages ("host 1 GiB of 8 GiB used")."""
        from ..sizes import format_bytes

        return (f"{self.name} {format_bytes(self.used_bytes)} of "
                f"{format_bytes(self.capacity_bytes)} used")

    def poll(self) -> None:
        """Retire finished transfers (called often; must be cheap)."""

    def drain(self) -> None:
        """Wait for every transfer in flight (end of step, before closing)."""

    def close(self, reuse: bool = True) -> None:
        """Free every resource; payloads still alive afterwards fail on `fetch`.

        With `reuse`, expensive resources (stores, arenas) that are clean may go back to
        offload/tiers/pool.py for the next step instead of being destroyed.
        """


def sync_d2h(src: torch.Tensor, dst: torch.Tensor, stats) -> None:
    """Blocking device-to-host copy, the fallback when no CopyStreams exist.

    A blocking `copy_` returns only when the bytes are on the host, so the caller may free
    the source right after it (no event needed).
    """
    if src.is_cuda:   # cuda_streams Note 14: a clear error instead of CUDA's mid-copy
        refuse_graph_capture("a blocking device-to-host copy", torch.cuda.is_current_stream_capturing())
    start = time.perf_counter()
    dst.copy_(src)
    stats.d2h_clock.add(time.perf_counter() - start)
    stats.d2h_bytes += src.numel()


def sync_h2d(src: torch.Tensor, device: torch.device, stats) -> torch.Tensor:
    """Blocking host-to-device copy of a flat uint8 buffer; complete when it returns."""
    if device.type == "cuda":   # cuda_streams Note 14
        refuse_graph_capture("a blocking host-to-device copy", torch.cuda.is_current_stream_capturing())
    start = time.perf_counter()
    out = torch.empty(src.numel(), dtype=torch.uint8, device=device)
    out.copy_(src)
    stats.h2d_clock.add(time.perf_counter() - start)
    stats.h2d_bytes += src.numel()
    return out
