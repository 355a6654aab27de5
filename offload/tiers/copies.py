"""The GPU copy path: D2H into the pinned arena on an offload stream, H2D back on a prefetch stream.

This module is about device copies and events only: what chains NVMe I/O to them lives with
the NVMe tier (offload/tiers/nvme_device.py). One :class:`CopyStreams` per step and device
holds that step's copies in flight and their counters; the two CUDA streams themselves are
the process's, one pair per device, reused by every step (Note 13). The runtime calls

* :meth:`CopyStreams.offload` in pack: it returns a :class:`D2HTicket` at once, the forward
  goes on while the copy runs (its event, ``D2HTicket.event_handle``, is what an engine can
  wait on);
* :meth:`CopyStreams.reload` (host tier) or :meth:`CopyStreams.reload_chained` (an H2D that
  another engine enqueues, e.g. after an NVMe read) when the prefetcher decides a tensor is
  due; it returns an :class:`H2DTicket` at once;
* :meth:`H2DTicket.tensor_for_use` in unpack, and :meth:`CopyStreams.close` at the step's end.

Copy engine: torch's ``copy_(non_blocking=True)`` on torch streams, not ``_C.copy_d2h/h2d``.
For a same-dtype contiguous copy between a CUDA tensor and a CPU tensor, torch issues exactly
one ``cudaMemcpyAsync`` on the *current* stream (aten/src/ATen/native/cuda/Copy.cu) and then
offers the host pointer to its CachingHostAllocator, which ignores pointers it did not
allocate (``record_event`` returns false): lifetime stays ours (Notes 3 and 8). Pinning is a
property of the pages known to the driver, so memory pinned by our statically linked cudart is
DMA'd directly by torch's copies (the core allocates it through the very runtime torch
loaded, csrc/cudart.hpp; the arena is allocated with ``cudaHostAllocPortable``, so that holds
for every device). Torch's path handles the
device guard, the caching allocator and event objects the rest of torch understands; the raw
``_C`` calls would add lazily created handles and a second place that tracks the current
device for nothing. The ``_C`` engine is used where it does something Python cannot: chaining
NVMe I/O after or before a copy (``write_after_event``, ``read_then_h2d``; the NVMe tier's
nvme_device.py). If a block is not
pinned, torch's copies are still correct (CUDA stages pageable memory, and a D2H into pageable
memory returns only when done) but synchronous; a warning says so once.

Every cross-stream hand-off has a numbered note; the code points back to it.

Note 1 (producer before D2H): ``offload`` records an event on the current (compute) stream and
makes the offload stream wait on it, on the GPU, so the copy reads the tensor only after the
kernel that produced it. The host never waits.

Note 2 (the D2H source stays alive): the copy reads the source after ``offload`` returned, while
the caching allocator hands a freed block to the next allocation *on the same stream* at once,
trusting stream order; our copy runs on another stream, so the compute stream could overwrite
the bytes first. The pending copy holds a Python reference to the source until its event is
seen complete (polled on every call, or waited for). We chose this over
``src.record_stream(offload_stream)``: that frees the block only after *all* work queued on the
offload stream when the tensor dies has finished (later than needed, and at a time that
depends on the allocator's polling), while the reference frees it at a known point and lets
us bound the bytes held (Note 11).

Note 3 (the pinned destination of a D2H stays alive): the arena returns a block's memory only
when the HostBlock object is garbage (``release()`` of a block whose buffer was exported is
deferred to then). ``torch.frombuffer`` keeps a reference to that object, not a buffer export
(verified: a bytearray behind a frombuffer view can still be resized), so whoever holds the
view or the block keeps the memory. The pending copy holds both until its event completed;
the runtime may drop its own references at any time.

Note 4 (an engine waiting on a D2H event): the D2H ``done`` events are created with
``blocking=True``, so that an engine thread waiting on one (the NVMe write-behind,
offload/tiers/nvme_device.py) sleeps instead of spinning on cores the Python thread needs to
launch kernels. Whoever hands ``D2HTicket.event_handle`` to an engine must keep
``D2HTicket.event`` alive until the engine is done with it (destroying an event a thread may
still wait on is undefined): nvme_device.WriteBehind does.

Note 5 (host tier: D2H before H2D): when a tensor comes back before its D2H has been seen to
finish, ``reload(..., after=d2h_ticket)`` makes the prefetch stream wait on the D2H event on the
GPU. Without it the H2D could read the block before the offload stream wrote it.

Note 6 (allocation stream of a reloaded tensor): the device tensor is allocated while the
prefetch stream is current, so it comes from that stream's pool and the H2D may start at
once. (Allocated on the compute stream, it could be a block that compute kernels still queued
are using, so the H2D would have to wait for all queued compute: no overlap.) It is used on
the compute stream, so ``tensor_for_use`` calls ``record_stream(consumer)``: when autograd frees
it, the allocator keeps the block until the consumer's queued kernels are done instead of
handing it to the next reload at once.

Note 7 (H2D before use): ``tensor_for_use`` makes the *current* stream (in unpack: the stream
autograd runs the backward node on) wait on the H2D event, on the GPU, not the host. For a
copy chained in an engine (``reload_chained``) the event is recorded by an engine thread;
a stream wait only covers records made before the wait is enqueued, so ``tensor_for_use``
first waits for the I/O future (complete once the record was made), then enqueues the wait.

Note 8 (the pinned source of an H2D stays alive): the pending copy holds the block until the H2D
event completed. Released earlier, the arena could give the bytes to the next D2H, whose copy
on the offload stream is not ordered with the H2D on the prefetch stream.

Note 9 (chained H2D destination stays alive): with ``reload_chained`` the engine enqueues the
copy later, from its own thread. Were the destination freed before that (ticket dropped), the
allocator could give its block to a later allocation whose copy is queued on the prefetch
stream *before* the engine's: the pending copy holds the tensor until the future is done.

Note 10 (event handles for the engine): torch creates a CUDA event at its first ``record``; its
``cuda_event`` is 0 before. ``reload_chained`` records the event once on the prefetch stream
so the handle exists; the engine records it again after its copy (Note 7 orders the wait).

Note 11 (back-pressure without a device sync): when the sources held by pending D2H copies
exceed ``max_inflight_bytes``, ``offload`` waits on the host for the oldest copy's event only.
The GPU keeps running; the Python thread stops queuing work until memory is really free.

Note 12 (one reload, several consumer streams): the hooks read a storage once and serve its
other saved tensors from a cache (runtime/records.py NOTE [Unpack cache]). Autograd runs each backward
node on the stream its forward ran on, so a second saved tensor of the storage can be used on
another stream than the first. Only the first consumer went through ``tensor_for_use``
(Notes 6, 7). When another stream asks, :class:`SharedReload` records an event on the first
stream (behind its wait for the H2D, so it completes after the copy); that stream waits on
the event, on the GPU, and is added to the block's streams by ``record_stream`` so the block
outlives its kernels there.

Notes 13 (the streams, one pair per device and process) and 14 (CUDA graph capture) are
in cuda_backend.py, with the calls they are about; the tickets are in copy_tickets.py, and
what holds and retires the copies in flight (Notes 2, 3, 8, 9, 11) in copies_in_flight.py.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from ..errors import UsedAfterCloseError
from ..util.trace import NULL_RECORDER, NullRecorder, TraceRecorder
from .copies_in_flight import CopyStats, InFlight, _Pending
from .copy_tickets import D2HTicket, H2DTicket, SharedReload
from .cuda_backend import GraphCaptureError, TorchCuda as _TorchCuda, refuse_graph_capture

__all__ = ["CopyStreams", "D2HTicket", "H2DTicket", "CopyStats", "SharedReload",
           "DEFAULT_MAX_INFLIGHT_BYTES", "GraphCaptureError", "refuse_graph_capture"]

_log = logging.getLogger("offload")

DEFAULT_MAX_INFLIGHT_BYTES = 1 << 30

class CopyStreams:
    """Offload and prefetch streams of one device, with the copies in flight on them.

    Args:
        device: The CUDA device (default: the current one).
        max_inflight_bytes: Source bytes that pending D2H copies may hold before ``offload``
            waits for the oldest (Note 11).
        timing: Time each copy with CUDA events (achieved GB/s in ``stats``; needed for the
            trace's d2h/h2d tracks).
        trace: Recorder for copy spans and stalls (:data:`offload.util.trace.NULL_RECORDER`: off).

    Example:
        >>> copies = CopyStreams(torch.device("cuda"))
        >>> t = copies.offload(x_bytes, block)            # pack
        >>> r = copies.reload(block, x_bytes.numel(), after=t)
        >>> y_bytes = r.tensor_for_use()                  # unpack
        >>> copies.close()
    """

    def __init__(self, device: Any = None, *, max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
                 timing: bool = True, trace: TraceRecorder | NullRecorder = NULL_RECORDER,
                 _backend: Any = None):
        if max_inflight_bytes <= 0:
            raise ValueError(f"CopyStreams(max_inflight_bytes={max_inflight_bytes}): must be > 0")
        self._backend = _backend or _TorchCuda()
        self.device = self._backend.device(device)
        self.max_inflight_bytes = int(max_inflight_bytes)
        self.trace = trace
        self.timing = bool(timing or trace.enabled)
        self.offload_stream, self.prefetch_stream = self._backend.copy_streams(self.device)  # Note 13
        self._ready = self._backend.new_event(timing=False)   # reused: see Note 1 in offload()
        self._flight = InFlight(self._backend, self.device, trace)
        self.stats: CopyStats = self._flight.stats
        self._lock = self._flight.lock   # issue and add under one lock: see copies_in_flight
        self._checked_pinned = False
        self._closed = False

    # ---------------------------------------------------------------- forward side
    def offload(self, src: torch.Tensor, block) -> D2HTicket:
        """Start copying ``src`` (a contiguous device tensor) into the pinned ``block``.

        Returns at once. ``block`` (a HostBlock, or a uint8 CPU view of one) must have room
        for ``src``'s bytes; the caller may drop its references at any time, the copy holds
        what it needs (Notes 2 and 3).

        Raises:
            ValueError: ``src`` is not contiguous, empty, or on another device, or ``block``
                is too small.
        """
        b = self._backend
        refuse_graph_capture("CopyStreams.offload()", b.capturing())   # Note 14
        src = self._bytes_of(src)
        nbytes = src.numel()
        host = self._host_view(block, nbytes, "offload")
        flight = self._flight
        with self._lock:
            self._check_open()
            flight.sweep()
            timing = self.timing
            start = b.new_event(timing=True) if timing else None
            done = b.new_event(timing=timing, blocking=True)   # blocking: Note 4
            b.record(self._ready, b.current_stream(self.device))
            # Note 1. Reusing one event is safe: a stream wait captures the record made
            # before it, later records don't change it; the lock keeps record+wait paired.
            b.wait_event(self.offload_stream, self._ready)
            if start is not None:
                b.record(start, self.offload_stream)
            b.copy(host, src, self.offload_stream)
            b.record(done, self.offload_stream)
            p = _Pending("d2h", nbytes, done, start, src=src, block=block, host=host)  # Notes 2, 3
            flight.add_d2h(p)
            flight.hold_at_most(self.max_inflight_bytes)   # Note 11
        return D2HTicket(flight, p)

    # ---------------------------------------------------------------- backward side
    def reload(self, block, nbytes: int, *, after: D2HTicket | None = None) -> H2DTicket:
        """Start copying the first ``nbytes`` of ``block`` into a new uint8 device tensor.

        Args:
            block: The pinned block holding the bytes (held until the copy is done, Note 8).
            nbytes: How many bytes to copy.
            after: The D2H that filled ``block``, if it may not have finished (Note 5).
        """
        b = self._backend
        refuse_graph_capture("CopyStreams.reload()", b.capturing())   # Note 14
        host = self._host_view(block, nbytes, "reload")
        with self._lock:
            self._check_open()
            self._flight.sweep()
            if after is not None and not after._p.complete:
                b.wait_event(self.prefetch_stream, after.event)   # Note 5
            dst = b.empty(nbytes, self.device, self.prefetch_stream)   # Note 6
            start = b.new_event(timing=True) if self.timing else None
            done = b.new_event(timing=self.timing)
            if start is not None:
                b.record(start, self.prefetch_stream)
            b.copy(dst, host, self.prefetch_stream)
            b.record(done, self.prefetch_stream)
            p = _Pending("h2d", nbytes, done, start, block=block, host=host)   # Note 8
            self._flight.add_h2d(p)
        return H2DTicket(self._flight, p, dst)

    def reload_chained(self, nbytes: int, submit: Callable[[int, int, int], Any], *,
                       keep: Any = None) -> H2DTicket:
        """An H2D into a new uint8 device tensor that another engine enqueues later.

        Args:
            nbytes: Size of the destination.
            submit: Called at once with (destination pointer, prefetch stream handle, event
                handle); returns a future (``done()``, ``wait()``) that completes once the
                engine has enqueued the copy on that stream and recorded the event after it
                (or failed: ``wait()`` raises). The NVMe tier's read → H2D
                (offload/tiers/nvme_device.py) is one.
            keep: Held until the copy is done, e.g. the pinned block the copy reads (Note 8).

        GPU copy time is not measured on this path.
        """
        b = self._backend
        refuse_graph_capture("CopyStreams.reload_chained()", b.capturing())   # Note 14
        with self._lock:
            self._check_open()
            self._flight.sweep()
            dst = b.empty(nbytes, self.device, self.prefetch_stream)   # Note 6
            done = b.new_event(timing=False)
            b.record(done, self.prefetch_stream)   # Note 10
            future = submit(dst.data_ptr(), b.stream_handle(self.prefetch_stream),
                            b.event_handle(done))
            p = _Pending("h2d", nbytes, done, None, block=keep, dst=dst, future=future)  # Notes 8, 9
            self._flight.add_h2d(p, chained=True)
        return H2DTicket(self._flight, p, dst)

    # ---------------------------------------------------------------- bookkeeping
    def poll(self) -> None:
        """Let go of what finished copies held (cheap: one event query per pending copy).

        Does nothing while the current stream captures a CUDA graph (Note 14)."""
        if self._backend.capturing():
            return
        with self._lock:
            self._flight.sweep()

    def drain(self) -> None:
        """Wait for every pending copy (these streams' events only, never the whole device).

        Raises:
            StorageError: a chained NVMe read failed (the first error, after waiting for all).
        """
        self._flight.drain()

    def close(self) -> None:
        """Drain and refuse new copies. Idempotent."""
        if self._closed:
            return
        try:
            self.drain()
        finally:
            self._closed = True

    def __enter__(self) -> "CopyStreams":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except Exception:
            if exc_type is None:
                raise
            _log.exception("offload: error while draining copies after another error")

    @property
    def inflight(self) -> dict[str, int]:
        """Queue depths now: pending D2H and H2D copies, and source bytes held."""
        return self._flight.depths()

    # ---------------------------------------------------------------- internals
    def _bytes_of(self, src: torch.Tensor) -> torch.Tensor:
        if src.device != self.device:
            raise ValueError(f"CopyStreams.offload(src): src is on {src.device}, these streams "
                             f"belong to {self.device} (use one CopyStreams per device)")
        if not src.is_contiguous():
            raise ValueError(f"CopyStreams.offload(src): src must be contiguous (size "
                             f"{tuple(src.shape)}, stride {src.stride()}); pass a uint8 view of "
                             "the bytes to move")
        if src.numel() == 0:
            raise ValueError("CopyStreams.offload(src): src is empty; keep empty tensors as they are")
        if src.dtype != torch.uint8:
            src = src.reshape(-1).view(torch.uint8)
        return src

    def _host_view(self, block, nbytes: int, who: str) -> torch.Tensor:
        if isinstance(block, torch.Tensor):   # a uint8 view of a block is fine too
            if block.device.type != "cpu" or block.dtype != torch.uint8 \
                    or not block.is_contiguous():
                raise ValueError(f"CopyStreams.{who}(block): a tensor block must be a contiguous "
                                 f"uint8 CPU tensor, got {block.dtype} on {block.device}")
            size = block.numel()
        else:
            size = getattr(block, "nbytes", None)
            if size is None:
                size = memoryview(block).nbytes
        if nbytes <= 0 or nbytes > size:
            raise ValueError(f"CopyStreams.{who}(): nbytes={nbytes} does not fit the block of "
                             f"{size} bytes (allocate the block with at least that many)")
        if isinstance(block, torch.Tensor):
            host = block[:nbytes]
        else:
            host = torch.frombuffer(block, dtype=torch.uint8, count=nbytes)
        if not self._checked_pinned:
            self._checked_pinned = True
            if not self._backend.is_pinned(host):
                _log.warning("offload: host blocks are not page-locked, so copies between the "
                             "GPU and the host tier are synchronous and slow (build offload._C "
                             "with the CUDA toolkit so the arena is pinned)")
        return host

    def _check_open(self) -> None:
        if self._closed:
            raise UsedAfterCloseError("CopyStreams is closed (its activations() context has exited)")
