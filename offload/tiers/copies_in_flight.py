"""The copies in flight on one device's offload and prefetch streams: what each holds until
its event completed, when it is retired, and the counters (copies.py's Notes 2, 3, 8, 9 and 11
are this module's subject).

`CopyStreams` issues a copy and adds its `_Pending` entry here; a ticket (copy_tickets.py)
asks this object, never the streams, whether its copy finished, or waits here. One lock,
which CopyStreams takes too: a copy is issued and added under it, so entries of one stream
are in issue order, which is their completion order.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from ..util.trace import NullRecorder, TraceRecorder
from .cuda_backend import refuse_graph_capture

__all__ = ["CopyStats", "InFlight"]


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


class InFlight:
    """The pending copies of one CopyStreams, and its counters (`stats`).

    Args:
        backend: The CUDA calls (cuda_backend.TorchCuda, or a test's stand-in).
        device: The streams' device.
        trace: Recorder for copy spans and stalls; when on, copy times are placed on its
            clock through one anchor event, waited for once here.
    """

    def __init__(self, backend: Any, device: Any, trace: TraceRecorder | NullRecorder) -> None:
        self.backend = backend
        self.device = device
        self.trace = trace
        self.now = trace.now   # one clock for stall counters and trace spans
        self.stats = CopyStats()
        self.lock = threading.RLock()
        self._d2h: deque[_Pending] = deque()   # in issue order = completion order (one stream)
        self._h2d: deque[_Pending] = deque()
        self._chained: list[_Pending] = []     # engine-submitted: complete in any order
        self.held_bytes = 0   # sources held by pending D2H copies (Notes 2, 11)
        self._anchor = None
        if trace.enabled:
            # Map GPU event times onto the host clock: one wait on one event, at context
            # entry, and only when tracing.
            self._anchor = backend.new_event(timing=True)
            backend.record(self._anchor, backend.current_stream(device))
            backend.synchronize(self._anchor)
            self._anchor_s = trace.now()

    # ---------------------------------------------------------------- adding (lock held)
    def add_d2h(self, p: _Pending) -> None:
        self._d2h.append(p)
        self.held_bytes += p.nbytes
        s = self.stats
        s.max_d2h_inflight = max(s.max_d2h_inflight, len(self._d2h))
        s.max_held_source_bytes = max(s.max_held_source_bytes, self.held_bytes)

    def add_h2d(self, p: _Pending, *, chained: bool = False) -> None:
        (self._chained if chained else self._h2d).append(p)
        self.stats.max_h2d_inflight = max(self.stats.max_h2d_inflight,
                                          len(self._h2d) + len(self._chained))

    def hold_at_most(self, max_bytes: int) -> None:
        """Note 11: wait on the host for the oldest D2H copies until their sources held
        are within `max_bytes`."""
        while self.held_bytes > max_bytes and self._d2h:
            t0 = self.now()
            self._wait_pending(self._d2h[0])
            self.stalled("backpressure_wait_s", t0, "wait d2h (back-pressure)")
            self.sweep()

    # ---------------------------------------------------------------- retiring
    def sweep(self) -> None:
        """Finish completed copies. Caller holds the lock."""
        b = self.backend
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

    def poll_one(self, p: _Pending) -> bool:
        """Whether `p` finished (one event query; none while a graph is captured, Note 14)."""
        if p.complete:
            return True
        if self.backend.capturing():   # Note 14: no query; it has not been seen done
            return False
        with self.lock:
            if not p.complete and (p.future is None or p.future.done()) \
                    and self.backend.query(p.event):
                self._finish(p)
            return p.complete

    def wait_one(self, p: _Pending, counter: str) -> float:
        """Wait on the host for `p`; its seconds are added to `stats.<counter>`."""
        if p.complete:
            return 0.0
        refuse_graph_capture(f"{'D2HTicket' if p.kind == 'd2h' else 'H2DTicket'}.wait()",
                             self.backend.capturing())   # Note 14
        t0 = self.now()
        with self.lock:
            self._wait_pending(p)
            self.sweep()
        return self.stalled(counter, t0, f"wait {p.kind}")

    def drain(self) -> None:
        """Wait for every pending copy; raises the first failure after waiting for all."""
        error = None
        if self.pending:
            refuse_graph_capture("CopyStreams.drain()", self.backend.capturing())   # Note 14
        with self.lock:
            for p in list(self._d2h) + list(self._h2d) + list(self._chained):
                try:
                    self._wait_pending(p)
                except Exception as exc:   # keep draining; report the first failure
                    error = error or exc
                    self._finish(p)
            self.sweep()
        if error is not None:
            raise error

    def stalled(self, counter: str, t0: float, what: str) -> float:
        """Count the host's wait since `t0` in `stats.<counter>` and the trace."""
        t1 = self.now()
        setattr(self.stats, counter, getattr(self.stats, counter) + (t1 - t0))
        if self.trace.enabled:
            self.trace.add(what, "stall", t0, t1, category="stall")
        return t1 - t0

    @property
    def pending(self) -> bool:
        return bool(self._d2h or self._h2d or self._chained)

    def depths(self) -> dict[str, int]:
        with self.lock:
            return {"d2h": len(self._d2h), "h2d": len(self._h2d) + len(self._chained),
                    "held_source_bytes": self.held_bytes}

    def _wait_pending(self, p: _Pending) -> None:
        if p.complete:
            return
        if p.future is not None:
            p.future.wait()   # Note 7: the engine recorded the event before this returns
        self.backend.synchronize(p.event)
        self._finish(p)

    def _finish(self, p: _Pending) -> None:
        if p.complete:
            return
        p.complete = True
        s = self.stats
        if p.kind == "d2h":
            self.held_bytes -= p.nbytes
            s.d2h_bytes += p.nbytes
            s.d2h_copies += 1
        else:
            s.h2d_bytes += p.nbytes
            s.h2d_copies += 1
        if p.start_event is not None and (p.future is None or p.future.done()):
            try:
                busy_s = self.backend.elapsed_s(p.start_event, p.event)
            except RuntimeError:   # e.g. the event was never reached after an error
                busy_s = 0.0
            if p.kind == "d2h":
                s.d2h_busy_s += busy_s
            else:
                s.h2d_busy_s += busy_s
            if self._anchor is not None:
                end_s = self._anchor_s + self.backend.elapsed_s(self._anchor, p.event)
                self.trace.add(f"{p.kind} {p.nbytes} B", p.kind, end_s - busy_s, end_s,
                               category="copy", args={"bytes": p.nbytes})
        # Everything the copy kept alive may go now (Notes 2, 3, 8, 9).
        p.src = p.block = p.host = p.dst = None
