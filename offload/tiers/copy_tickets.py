"""What `CopyStreams` hands out for one copy, and the hand-off of one reload to more streams
(`SharedReload`, Note 12); the Notes are copies.py's.

A `D2HTicket` is the forward's handle on a copy out; an `H2DTicket` the backward's on a
copy back. Each holds its `_Pending` entry and the `InFlight` that retires it
(copies_in_flight.py), and asks that, never the streams, whether its copy is done.
"""
from __future__ import annotations

from typing import Any

import torch

from .copies_in_flight import InFlight, _Pending
from .cuda_backend import TorchCuda as _TorchCuda, refuse_graph_capture

__all__ = ["D2HTicket", "H2DTicket", "SharedReload"]


class D2HTicket:
    """A D2H copy in flight. Dropping the ticket is safe: the copy keeps what it needs."""

    __slots__ = ("_flight", "_p", "nbytes", "event", "block")

    def __init__(self, flight: InFlight, pending: _Pending):
        self._flight = flight
        self._p = pending
        self.nbytes = pending.nbytes
        self.event = pending.event   # torch.cuda.Event; .cuda_event is the handle for the engine
        self.block = pending.block   # the caller's block (an engine writing it out needs it)

    def done(self) -> bool:
        """Whether the copy finished (non-blocking); the source is dropped once it has."""
        return self._flight.poll_one(self._p)

    def wait(self) -> float:
        """Block until the copy finished; returns the seconds waited."""
        return self._flight.wait_one(self._p, "d2h_wait_s")

    def device_tensor_if_held(self) -> torch.Tensor | None:
        """The source bytes while the copy is still pending, else None.

        Unpack can use them instead of a reload when the tensor is needed again before its
        offload finished (a bounce): the source is still alive (Note 2) and unchanged.
        """
        return None if self._p.complete else self._p.src

    @property
    def event_handle(self) -> int:
        """The raw handle of ``event`` (completes when the copy has landed in the block),
        for an engine that waits on it; keep ``event`` alive meanwhile (Note 4)."""
        return self._flight.backend.event_handle(self.event)


class H2DTicket:
    """An H2D copy in flight. ``tensor_for_use()`` hands the uint8 device tensor to a stream."""

    __slots__ = ("_flight", "_p", "_dst", "nbytes", "event")

    def __init__(self, flight: InFlight, pending: _Pending, dst: torch.Tensor):
        self._flight = flight
        self._p = pending
        self._dst = dst
        self.nbytes = pending.nbytes
        self.event = pending.event

    def tensor_for_use(self) -> torch.Tensor:
        """The reloaded bytes, safe to use on the current stream (Notes 6 and 7).

        Only the current stream waits, on the GPU; the host waits only for a chained NVMe
        read that has not been submitted to the GPU yet (counted as stall).

        Raises:
            StorageError: the chained NVMe read failed.
        """
        flight = self._flight
        backend = flight.backend
        refuse_graph_capture("H2DTicket.tensor_for_use()", backend.capturing())   # Note 14
        self._wait_io()
        consumer = backend.current_stream(flight.device)
        backend.wait_event(consumer, self.event)   # Note 7
        backend.record_stream(self._dst, consumer)  # Note 6
        return self._dst

    def done(self) -> bool:
        return self._flight.poll_one(self._p)

    def wait(self) -> float:
        """Block until the copy finished (host); returns the seconds waited."""
        return self._flight.wait_one(self._p, "h2d_wait_s")

    def _wait_io(self) -> None:
        future = self._p.future
        if future is not None and not future.done():
            t0 = self._flight.now()
            future.wait()
            self._flight.stalled("h2d_wait_s", t0, "wait nvme read")
        elif future is not None:
            future.wait()   # raises the read's StorageError, if any


class SharedReload:
    """A reloaded device storage served to more than one stream (Note 12).

    Created right after the first consumer got the storage (its stream already waits for
    the copy); ``use_on_current_stream`` makes any later consumer's stream safe. Holds no
    reference to the storage, so the hooks' weak cache stays weak. Every CUDA reload gets
    one, and nearly all are only ever used on one stream: the event is made only when a
    second stream shows up, recorded then on the first stream (behind its wait for the
    copy, so it also completes after the copy; it may wait for more of that stream's work
    than needed, which only this rare case pays).
    """

    __slots__ = ("_backend", "_first", "_ready", "_served")

    def __init__(self, device: torch.device, _backend: Any = None):
        self._backend = _backend if _backend is not None else _TorchCuda()
        self._first = self._backend.current_stream(device)
        self._ready = None
        self._served = {self._backend.stream_handle(self._first)}

    def use_on_current_stream(self, storage: torch.UntypedStorage, offset: int) -> None:
        """Make the current stream wait for the reload and keep the block for its kernels.

        `offset`: where the reloaded bytes start in `storage` (a byte of them is the handle
        `record_stream` is given; the allocator finds the block from it).
        """
        b = self._backend
        stream = b.current_stream(storage.device)
        handle = b.stream_handle(stream)
        if handle in self._served:  # its earlier wait is already ahead in stream order
            return
        if self._ready is None:
            self._ready = b.new_event(timing=False)
            b.record(self._ready, self._first)
        b.wait_event(stream, self._ready)
        one_byte = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
            storage, offset, (1,))
        b.record_stream(one_byte, stream)
        self._served.add(handle)
