"""The tier interface: a tier stores and loads flat byte payloads.

The runtime (offload/runtime/) turns tensors into flat uint8 payloads (one per storage) and
back, so a tier never sees dtypes, shapes or views. A tier is chosen per storage by
offload/runtime/placement.py; spilling to the next tier happens when `store` returns None.

Life of a payload, every step a call of the tier's (NOTE [One owner]): `store` (forward; may
copy asynchronously) → optional `prefetch` (starts the load early: the prefetcher) → `fetch`
(backward; waits only for this payload) → `release` (when autograd frees the last saved
tensor of the storage). `release` never blocks on I/O: a tier defers freeing space that an
in-flight transfer still uses.

NOTE [One owner] A payload is the tier's handle for one storage's bytes: it calls nothing.
The tier owns every transfer and every byte of capacity; the runtime hands the payload back
to the tier's methods (`tier.fetch(payload)`), and nothing a tier does calls back into the
runtime. Tiers register here by name (`offload.tiers.open_tiers`); their name, capacity and
figures (`report`) are theirs.
"""
from __future__ import annotations

import abc
import time
from typing import Any, Callable

import torch

from ..util.never_compiled import never_compiled
from .cuda_backend import refuse_graph_capture

__all__ = ["Tier", "Payload", "on_cuda", "flat_bytes", "sync_d2h", "sync_h2d"]

# torch.device.type builds a new string at every read (~0.7 us, as much as the rest of a
# host store on a CPU run); a tier asks once per stored storage.
_ON_CUDA: dict[torch.device, bool] = {}


def on_cuda(device: torch.device) -> bool:
    """Whether `device` is a CUDA device (remembered per device)."""
    cuda = _ON_CUDA.get(device)
    if cuda is None:
        cuda = _ON_CUDA[device] = device.type == "cuda"
    return cuda


class Payload:
    """One storage's bytes held by a tier (its handle; see NOTE [One owner])."""

    __slots__ = ("nbytes", "device", "__weakref__")

    #: True when the bytes still occupy the compute device's memory (host.py: a CPU tensor held by reference).
    resident = False

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = nbytes
        self.device = device  # where the bytes came from and must go back to


@never_compiled
class Tier(abc.ABC):
    """A place for payloads with a capacity. `store` returns None when it is full."""

    name: str = "?"
    # `store` for a CPU storage as a core callable, `store_cpu(storage, device)`, or None:
    # the core's packer then stores plain CPU activations through it, without a Python
    # frame (hooks.py NOTE [Move path in C]). A tier that sets it returns the core's
    # StorageRef (resident: the host tier's) or payloads that are not resident and are
    # prefetchable (the nvme tier's), and sets it back to None when it closes; its class
    # says so (`stores_cpu_in_core`), so a step whose tiers never do pays nothing for it.
    store_cpu: Callable[[torch.UntypedStorage, torch.device], Payload | None] | None = None
    stores_cpu_in_core: bool = False
    # The core's NvmeTransfers that read this tier's CPU payloads (the nvme tier's), or None:
    # the core's prefetcher then starts, waits on and hands out their reads itself, with no
    # Python call (offload/runtime/prefetch.py). Its reads are what `prefetch`, `fetch`,
    # `prefetched` and `released` do for such a payload.
    cpu_reads: Any = None

    def __init_subclass__(cls, **kwargs) -> None:
        # The core and the hooks call a tier's methods from inside ops that save or unpack
        # tensors, also where torch.compile runs a part eagerly: NOTE [Never compiled].
        super().__init_subclass__(**kwargs)
        never_compiled(cls)

    @classmethod
    @abc.abstractmethod
    def open(cls, config, stats, copies: Callable[[torch.device], Any]) -> "Tier":
        """The tier for one step, from the settings (`config`), the step's `stats` and its
        CopyStreams provider (`copies(device)`, for CUDA sources)."""

    @abc.abstractmethod
    def store(self, storage: torch.UntypedStorage, device: torch.device) -> Payload | None:
        """Take a copy of (or a reference to) the bytes of `storage`, which lives on `device`.

        Returns None when the tier has no room; the caller spills to the next tier.
        """

    def prefetchable(self, payload: Payload) -> bool:
        """Whether `prefetch` would start a real transfer (the prefetcher tracks those)."""
        return False

    def prefetch(self, payload: Payload) -> bool:
        """Start bringing the bytes back without waiting; True if a transfer was started.

        False when none is needed: a load is in flight or done already (`prefetched`), the
        payload was released, or the tier has nothing to start early. The prefetcher counts
        hits and skips payloads by this answer alone.
        """
        return False

    def prefetched(self, payload: Payload) -> bool:
        """Whether a load is in flight or done (so `fetch` will not start one)."""
        return False

    def released(self, payload: Payload) -> bool:
        return False

    @abc.abstractmethod
    def fetch(self, payload: Payload) -> torch.Tensor:
        """The bytes as a 1-D uint8 tensor on the payload's device; waits for it only.

        The returned tensor owns (keeps alive) whatever memory holds the bytes; the tier
        drops its own reference, so the memory returns when the caller drops the tensor.
        May be called more than once (retain_graph): it then loads again.
        """

    @abc.abstractmethod
    def release(self, payload: Payload) -> None:
        """Free the payload's space; idempotent; never waits for I/O."""

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
        from ..util.sizes import format_bytes

        return (f"{self.name} {format_bytes(self.used_bytes)} of "
                f"{format_bytes(self.capacity_bytes)} used")

    def poll(self) -> None:
        """Retire finished transfers (called often; must be cheap)."""

    def flush(self) -> None:
        """Start every transfer held back to be batched (the block is over)."""

    def drain(self) -> None:
        """Wait for every transfer in flight (end of step, before closing)."""

    def abort(self) -> None:
        """Free every payload now (the step failed): a later `fetch` of one raises
        UsedAfterCloseError, `released` says so."""

    def fold(self, stats) -> None:
        """Bring what the tier counted outside Python (its transfers) into `stats` (whenever
        the step's Stats are read; idempotent)."""

    def report(self, stats) -> None:
        """Put the tier's end-of-step figures into `stats` (space still used, peaks)."""
        stats.tier(self.name).exit_used_bytes = self.used_bytes

    def close(self, reuse: bool = True) -> None:
        """Free every resource; payloads still alive afterwards fail on `fetch`.

        With `reuse`, expensive resources (stores, arenas) that are clean may go back to
        offload/tiers/pool.py for the next step instead of being destroyed.
        """


def flat_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage's bytes as a 1-D uint8 tensor (zero-copy, keeps the storage alive)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def sync_d2h(src: torch.Tensor, dst: torch.Tensor, stats) -> None:
    """Blocking device-to-host copy, the fallback when no CopyStreams exist.

    A blocking `copy_` returns only when the bytes are on the host, so the caller may free
    the source right after it (no event needed).
    """
    if src.is_cuda:   # copies Note 14: a clear error instead of CUDA's mid-copy
        refuse_graph_capture("a blocking device-to-host copy", torch.cuda.is_current_stream_capturing())
    start = time.perf_counter()
    dst.copy_(src)
    stats.d2h_clock.add(time.perf_counter() - start)
    stats.d2h_bytes += src.numel()


def sync_h2d(src: torch.Tensor, device: torch.device, stats) -> torch.Tensor:
    """Blocking host-to-device copy of a flat uint8 buffer; complete when it returns."""
    if device.type == "cuda":   # copies Note 14
        refuse_graph_capture("a blocking host-to-device copy", torch.cuda.is_current_stream_capturing())
    start = time.perf_counter()
    out = torch.empty(src.numel(), dtype=torch.uint8, device=device)
    out.copy_(src)
    stats.h2d_clock.add(time.perf_counter() - start)
    stats.h2d_bytes += src.numel()
    return out
