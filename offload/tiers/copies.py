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
other saved tensors from a cache (hooks.py NOTE [Unpack cache]). Autograd runs each backward
node on the stream its forward ran on, so a second saved tensor of the storage can be used on
another stream than the first. Only the first consumer went through ``tensor_for_use``
(Notes 6, 7). When another stream asks, :class:`SharedReload` records an event on the first
stream (behind its wait for the H2D, so it completes after the copy); that stream waits on
the event, on the GPU, and is added to the block's streams by ``record_stream`` so the block
outlives its kernels there.

Note 13 (streams reused across steps): the offload and prefetch streams are made once per
device and process (``_TorchCuda.copy_streams``), not per step. Reloaded tensors are
allocated on the prefetch stream (Note 6), and the caching allocator keeps a freed block for
reuse on the stream it was allocated on: with a new prefetch stream each step (torch hands
out its pool's 32 streams in turn) each step's reloads took fresh blocks, and reserved memory
grew step after step. Two contexts alive at once share the streams: their copies then queue
behind each other, while each CopyStreams still tracks only its own events.

Note 14 (CUDA graph capture): while the current stream captures a graph, work queued on it,
or on a stream that waits on an event recorded in the capture, is recorded into the graph
instead of running, and (in the default global capture mode) an event query or wait on the
host is refused and invalidates the capture. Offloading a captured step cannot work: the
copies would run only at replay, into blocks the arena has long reused. So every entry point
that queues a copy or waits raises :class:`GraphCaptureError` first (naming the way out), and
``poll`` (which only queries) does nothing while the stream captures, so a captured region
under ``offload.no_offload()`` stays legal. The engine's threads wait on our own events in
relaxed capture mode (csrc/cuda_copy.hpp ``enter_engine_thread``), so a capture on the
training thread neither fails their waits nor is invalidated by them.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from offload.errors import OffloadError, UsedAfterCloseError
from offload.util.trace import NULL_RECORDER, NullRecorder, TraceRecorder

__all__ = ["CopyStreams", "D2HTicket", "H2DTicket", "CopyStats", "SharedReload",
           "DEFAULT_MAX_INFLIGHT_BYTES", "GraphCaptureError", "refuse_graph_capture"]

_log = logging.getLogger("offload")

DEFAULT_MAX_INFLIGHT_BYTES = 1 << 30

_streams_lock = threading.Lock()
_streams: dict[torch.device, tuple] = {}   # Note 13


class GraphCaptureError(OffloadError, RuntimeError):
    """Offloaded tensors were to be moved while the current CUDA stream captures a graph."""


def refuse_graph_capture(what: str, capturing: bool) -> None:
    """Raise GraphCaptureError for `what` (the call, for the message) when `capturing` (Note 14)."""
    if capturing:
        raise GraphCaptureError(
            f"offload: {what} was called while the current CUDA stream is capturing a CUDA "
            "graph; saved tensors cannot be offloaded inside a captured region (their copies "
            "and the waits for them would be recorded into the graph instead of running). "
            "Capture the graph outside offload.activations(), or wrap the captured region in "
            "offload.no_offload()")


def after_fork_in_child() -> None:
    """A forked child cannot use the parent's CUDA streams (nor CUDA at all): forget them."""
    global _streams_lock
    _streams_lock = threading.Lock()
    _streams.clear()


def forget_streams() -> None:
    """Forget the process's copy streams (offload.process.reset); the next step makes new."""
    with _streams_lock:
        _streams.clear()


class _TorchCuda:
    """Every torch.cuda call of this module, in one place (tests substitute a simulated GPU)."""

    def device(self, device: Any) -> torch.device:
        device = torch.device("cuda" if device is None else device)
        if device.type != "cuda":
            raise ValueError(f"CopyStreams(device={str(device)!r}): needs a CUDA device "
                             "(on a CPU-only run the runtime keeps host tensors in place)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def copy_streams(self, device) -> tuple:
        """The process's offload and prefetch streams of `device` (Note 13)."""
        with _streams_lock:
            pair = _streams.get(device)
            if pair is None:
                pair = _streams[device] = (torch.cuda.Stream(device=device),
                                           torch.cuda.Stream(device=device))
            return pair

    def current_stream(self, device):
        return torch.cuda.current_stream(device)

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def new_event(self, timing: bool, blocking: bool = False):
        return torch.cuda.Event(enable_timing=timing, blocking=blocking)

    def record(self, event, stream) -> None:
        event.record(stream)

    def wait_event(self, stream, event) -> None:
        stream.wait_event(event)

    def query(self, event) -> bool:
        return event.query()

    def synchronize(self, event) -> None:
        event.synchronize()

    def elapsed_s(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3

    def empty(self, nbytes: int, device, stream) -> torch.Tensor:
        with torch.cuda.stream(stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)

    def is_pinned(self, host: torch.Tensor) -> bool:
        return host.is_pinned()

    def stream_handle(self, stream) -> int:
        return stream.cuda_stream

    def event_handle(self, event) -> int:
        return event.cuda_event


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


@dataclass
class CopyStats:
    """Counters of one CopyStreams; ``*_busy_s`` are GPU-timed copy durations (timing=True)."""

    d2h_bytes: int = 0
    d2h_copies: int = 0
    d2h_busy_s: float = 0.0
    h2d_bytes: int = 0
    h2d_copies: int = 0
    h2d_busy_s: float = 0.0
    d2h_wait_s: float = 0.0            # host waited in D2HTicket.wait()
    backpressure_wait_s: float = 0.0   # host waited for held sources (Note 11)
    h2d_wait_s: float = 0.0            # host waited for I/O in tensor_for_use / H2DTicket.wait
    max_d2h_inflight: int = 0
    max_h2d_inflight: int = 0
    max_held_source_bytes: int = 0

    @property
    def d2h_gbps(self) -> float:
        return self.d2h_bytes / self.d2h_busy_s / 1e9 if self.d2h_busy_s > 0 else 0.0

    @property
    def h2d_gbps(self) -> float:
        return self.h2d_bytes / self.h2d_busy_s / 1e9 if self.h2d_busy_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        out = asdict(self)
        out["d2h_gbps"] = self.d2h_gbps
        out["h2d_gbps"] = self.h2d_gbps
        return out


class _Pending:
    """One copy in flight and everything it must keep alive until its event completed."""

    __slots__ = ("kind", "nbytes", "event", "start_event", "src", "block", "host", "dst",
                 "future", "complete")

    def __init__(self, kind: str, nbytes: int, event, start_event, *, src=None, block=None,
                 host=None, dst=None, future=None):
        self.kind = kind
        self.nbytes = nbytes
        self.event = event
        self.start_event = start_event
        self.src = src          # D2H source (Note 2)
        self.block = block      # pinned block (Notes 3, 8)
        self.host = host        # frombuffer view of the block
        self.dst = dst          # chained H2D destination (Note 9)
        self.future = future    # engine future of a chained copy
        self.complete = False


class D2HTicket:
    """A D2H copy in flight. Dropping the ticket is safe: the copy keeps what it needs."""

    __slots__ = ("_owner", "_p", "nbytes", "event", "block")

    def __init__(self, owner: "CopyStreams", pending: _Pending):
        self._owner = owner
        self._p = pending
        self.nbytes = pending.nbytes
        self.event = pending.event   # torch.cuda.Event; .cuda_event is the handle for the engine
        self.block = pending.block   # the caller's block (an engine writing it out needs it)

    def done(self) -> bool:
        """Whether the copy finished (non-blocking); the source is dropped once it has."""
        return self._owner._poll_one(self._p)

    def wait(self) -> float:
        """Block until the copy finished; returns the seconds waited."""
        return self._owner._wait_one(self._p, "d2h_wait_s")

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
        return self._owner._backend.event_handle(self.event)


class H2DTicket:
    """An H2D copy in flight. ``tensor_for_use()`` hands the uint8 device tensor to a stream."""

    __slots__ = ("_owner", "_p", "_dst", "nbytes", "event")

    def __init__(self, owner: "CopyStreams", pending: _Pending, dst: torch.Tensor):
        self._owner = owner
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
        backend = self._owner._backend
        refuse_graph_capture("H2DTicket.tensor_for_use()", backend.capturing())   # Note 14
        self._wait_io()
        consumer = backend.current_stream(self._owner.device)
        backend.wait_event(consumer, self.event)   # Note 7
        backend.record_stream(self._dst, consumer)  # Note 6
        return self._dst

    def done(self) -> bool:
        return self._owner._poll_one(self._p)

    def wait(self) -> float:
        """Block until the copy finished (host); returns the seconds waited."""
        return self._owner._wait_one(self._p, "h2d_wait_s")

    def _wait_io(self) -> None:
        future = self._p.future
        if future is not None and not future.done():
            t0 = self._owner._now()
            future.wait()
            self._owner._stalled("h2d_wait_s", t0, "wait nvme read")
        elif future is not None:
            future.wait()   # raises the read's StorageError, if any


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
        self._now = trace.now   # one clock for stall counters and trace spans
        self.timing = bool(timing or trace.enabled)
        self.stats = CopyStats()
        self.offload_stream, self.prefetch_stream = self._backend.copy_streams(self.device)  # Note 13
        self._ready = self._backend.new_event(timing=False)   # reused: see Note 1 in offload()
        self._lock = threading.RLock()
        self._d2h: deque[_Pending] = deque()   # in issue order = completion order (one stream)
        self._h2d: deque[_Pending] = deque()
        self._chained: list[_Pending] = []     # engine-submitted: complete in any order
        self._held_bytes = 0
        self._checked_pinned = False
        self._closed = False
        self._anchor = None
        if self.trace.enabled:
            # Map GPU event times onto the host clock: one wait on one event, at context
            # entry, and only when tracing.
            self._anchor = self._backend.new_event(timing=True)
            self._backend.record(self._anchor, self._backend.current_stream(self.device))
            self._backend.synchronize(self._anchor)
            self._anchor_s = self.trace.now()

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
        with self._lock:
            self._check_open()
            self._sweep()
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
            self._d2h.append(p)
            self._held_bytes += nbytes
            s = self.stats
            s.max_d2h_inflight = max(s.max_d2h_inflight, len(self._d2h))
            s.max_held_source_bytes = max(s.max_held_source_bytes, self._held_bytes)
            while self._held_bytes > self.max_inflight_bytes and self._d2h:
                t0 = self._now()   # Note 11
                self._wait_pending(self._d2h[0])
                self._stalled("backpressure_wait_s", t0, "wait d2h (back-pressure)")
                self._sweep()
        return D2HTicket(self, p)

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
            self._sweep()
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
            self._h2d.append(p)
            self.stats.max_h2d_inflight = max(self.stats.max_h2d_inflight,
                                              len(self._h2d) + len(self._chained))
        return H2DTicket(self, p, dst)

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
            self._sweep()
            dst = b.empty(nbytes, self.device, self.prefetch_stream)   # Note 6
            done = b.new_event(timing=False)
            b.record(done, self.prefetch_stream)   # Note 10
            future = submit(dst.data_ptr(), b.stream_handle(self.prefetch_stream),
                            b.event_handle(done))
            p = _Pending("h2d", nbytes, done, None, block=keep, dst=dst, future=future)  # Notes 8, 9
            self._chained.append(p)
            self.stats.max_h2d_inflight = max(self.stats.max_h2d_inflight,
                                              len(self._h2d) + len(self._chained))
        return H2DTicket(self, p, dst)

    # ---------------------------------------------------------------- bookkeeping
    def poll(self) -> None:
        """Let go of what finished copies held (cheap: one event query per pending copy).

        Does nothing while the current stream captures a CUDA graph (Note 14)."""
        if self._backend.capturing():
            return
        with self._lock:
            self._sweep()

    def drain(self) -> None:
        """Wait for every pending copy (these streams' events only, never the whole device).

        Raises:
            StorageError: a chained NVMe read failed (the first error, after waiting for all).
        """
        error = None
        if self._d2h or self._h2d or self._chained:
            refuse_graph_capture("CopyStreams.drain()", self._backend.capturing())   # Note 14
        with self._lock:
            for p in list(self._d2h) + list(self._h2d) + list(self._chained):
                try:
                    self._wait_pending(p)
                except Exception as exc:   # keep draining; report the first failure
                    error = error or exc
                    self._finish(p)
            self._sweep()
        if error is not None:
            raise error

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
        with self._lock:
            return {"d2h": len(self._d2h), "h2d": len(self._h2d) + len(self._chained),
                    "held_source_bytes": self._held_bytes}

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

    def _sweep(self) -> None:
        """Finish completed copies. Caller holds the lock."""
        b = self._backend
        for queue in (self._d2h, self._h2d):
            # One stream per queue: events complete in issue order, stop at the first not done.
            while queue and (queue[0].complete or b.query(queue[0].event)):
                self._finish(queue.popleft())
        if self._chained:
            still = []
            for p in self._chained:
                if p.future.done() and b.query(p.event):
                    self._finish(p)
                else:
                    still.append(p)
            self._chained = still

    def _poll_one(self, p: _Pending) -> bool:
        if p.complete:
            return True
        if self._backend.capturing():   # Note 14: no query; it has not been seen done
            return False
        with self._lock:
            if not p.complete and (p.future is None or p.future.done()) \
                    and self._backend.query(p.event):
                self._finish(p)
            return p.complete

    def _wait_one(self, p: _Pending, counter: str) -> float:
        if p.complete:
            return 0.0
        refuse_graph_capture(f"{'D2HTicket' if p.kind == 'd2h' else 'H2DTicket'}.wait()",
                             self._backend.capturing())   # Note 14
        t0 = self._now()
        with self._lock:
            self._wait_pending(p)
            self._sweep()
        return self._stalled(counter, t0, f"wait {p.kind}")

    def _wait_pending(self, p: _Pending) -> None:
        if p.complete:
            return
        if p.future is not None:
            p.future.wait()   # Note 7: the engine recorded the event before this returns
        self._backend.synchronize(p.event)
        self._finish(p)

    def _finish(self, p: _Pending) -> None:
        if p.complete:
            return
        p.complete = True
        s = self.stats
        if p.kind == "d2h":
            self._held_bytes -= p.nbytes
            s.d2h_bytes += p.nbytes
            s.d2h_copies += 1
        else:
            s.h2d_bytes += p.nbytes
            s.h2d_copies += 1
        if p.start_event is not None and (p.future is None or p.future.done()):
            try:
                busy_s = self._backend.elapsed_s(p.start_event, p.event)
            except RuntimeError:   # e.g. the event was never reached after an error
                busy_s = 0.0
            if p.kind == "d2h":
                s.d2h_busy_s += busy_s
            else:
                s.h2d_busy_s += busy_s
            if self._anchor is not None:
                end_s = self._anchor_s + self._backend.elapsed_s(self._anchor, p.event)
                self.trace.add(f"{p.kind} {p.nbytes} B", p.kind, end_s - busy_s, end_s,
                               category="copy", args={"bytes": p.nbytes})
        # Everything the copy kept alive may go now (Notes 2, 3, 8, 9).
        p.src = p.block = p.host = p.dst = None

    def _stalled(self, counter: str, t0: float, what: str) -> float:
        t1 = self._now()
        setattr(self.stats, counter, getattr(self.stats, counter) + (t1 - t0))
        if self.trace.enabled:
            self.trace.add(what, "stall", t0, t1, category="stall")
        return t1 - t0
