"""Chrome-trace recorder for one training step (``OFFLOAD_TRACE=path``).

The file opens in Perfetto (ui.perfetto.dev) or chrome://tracing: one process "offload" with a
track (thread) per kind of work, so compute, copies and disk I/O line up on one time axis and
gaps and stalls are visible at a glance.

Two ways to record:

* ``with rec.span("layer3", track="forward"):`` around work done by the calling thread;
* ``rec.add(name, track, start_s, end_s)`` for work that finished elsewhere (an I/O thread, a
  GPU copy timed with events). Times are ``time.perf_counter()`` seconds, the recorder's clock.

A disabled recorder (:data:`NULL_RECORDER`) has the same methods and does nothing: ``span``
returns one shared no-op object, so a disabled trace costs one method call per span.

Perfetto's JSON importer needs the slices of one track to nest properly. Spans of one thread
do; copies and I/O finished on worker threads may overlap. :meth:`TraceRecorder.to_dict`
therefore spreads each track over as many lanes ("nvme write", "nvme write #2", ...) as it
needs so that every lane nests.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any, Callable, Mapping

from .never_compiled import never_compiled
from .output_files import write_output_file

__all__ = ["TRACKS", "TraceRecorder", "NullRecorder", "NULL_RECORDER"]

_log = logging.getLogger("offload")

# Display order of the well-known tracks; any other name gets a track after these.
TRACKS = ("compute", "forward", "backward", "d2h", "h2d", "nvme write", "nvme read", "stall")


class _Span:
    """Context manager of one span; records itself on exit (also when the body raised)."""

    __slots__ = ("_rec", "_name", "_category", "_track", "_args", "_start_s")

    def __init__(self, rec: "TraceRecorder", name: str, category: str, track: str,
                 args: dict[str, Any] | None):
        self._rec = rec
        self._name = name
        self._category = category
        self._track = track
        self._args = args
        self._start_s = 0.0

    def __enter__(self) -> "_Span":
        self._start_s = self._rec.clock()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._rec.add(self._name, self._track, self._start_s, self._rec.clock(),
                      category=self._category, args=self._args)


@never_compiled   # the core's I/O adds its events from inside unpacks: NOTE [Never compiled]
class TraceRecorder:
    """Thread-safe collector of complete ("X") events for one step.

    Args:
        clock: Seconds-valued clock shared by every caller (default ``time.perf_counter``).
        process_name: Name of the single trace process.

    Example:
        >>> rec = TraceRecorder()
        >>> with rec.span("block 0", track="forward"):
        ...     pass
        >>> rec.add("write 1 MiB", "nvme write", t0, t1)   # from an I/O thread
        >>> rec.write("/tmp/step.json")
    """

    enabled = True

    def __init__(self, *, clock: Callable[[], float] = time.perf_counter,
                 process_name: str = "offload"):
        self.clock = clock
        self.process_name = process_name
        self.origin_s = clock()
        self._lock = threading.Lock()
        # (track, name, category, start_s, end_s, args); kept raw, formatted once in to_dict
        self._events: list[tuple[str, str, str, float, float, dict | None]] = []
        self._counters: list[tuple[str, float, dict[str, float]]] = []

    def now(self) -> float:
        """The recorder's clock, for callers that time work themselves and call :meth:`add`."""
        return self.clock()

    def span(self, name: str, category: str = "offload", track: str = "compute",
             **args: Any) -> _Span:
        """Context manager recording the time spent in its body on ``track``."""
        return _Span(self, name, category, track, args or None)

    def add(self, name: str, track: str, start_s: float, end_s: float, *,
            category: str = "offload", args: Mapping[str, Any] | None = None) -> None:
        """Record work that ran from ``start_s`` to ``end_s`` (recorder clock seconds)."""
        if end_s < start_s:
            # A clock read on two threads can be off by a few ns; never emit a negative
            # duration (Perfetto drops the slice).
            end_s = start_s
        event = (track, name, category, start_s, end_s, dict(args) if args else None)
        with self._lock:
            self._events.append(event)

    def counter(self, name: str, values: Mapping[str, float], t_s: float | None = None) -> None:
        """Record a counter sample, e.g. ``counter("in flight", {"d2h": 3, "h2d": 1})``."""
        t_s = self.clock() if t_s is None else t_s
        with self._lock:
            self._counters.append((name, t_s, dict(values)))

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

    def to_dict(self) -> dict[str, Any]:
        """The Chrome-trace JSON object: ``{"traceEvents": [...], "displayTimeUnit": "ms"}``."""
        with self._lock:
            events = list(self._events)
            counters = list(self._counters)
        pid = 1
        out: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
             "args": {"name": self.process_name}},
        ]
        by_track: dict[str, list[tuple]] = {}
        for ev in events:
            by_track.setdefault(ev[0], []).append(ev)
        order = [t for t in TRACKS if t in by_track] + sorted(t for t in by_track if t not in TRACKS)
        tid = 0
        for track in order:
            for lane_no, lane in enumerate(_nesting_lanes(by_track[track])):
                tid += 1
                label = track if lane_no == 0 else f"{track} #{lane_no + 1}"
                out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                            "args": {"name": label}})
                out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                            "args": {"sort_index": tid}})
                for _, name, cat, start_s, end_s, args in lane:
                    ev = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid,
                          "ts": self._us(start_s), "dur": round((end_s - start_s) * 1e6, 3)}
                    if args:
                        ev["args"] = args
                    out.append(ev)
        for name, t_s, values in counters:
            out.append({"name": name, "ph": "C", "pid": pid, "tid": 0, "ts": self._us(t_s),
                        "args": values})
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike) -> str:
        """Write the trace (output_files.write_output_file: a file is replaced at once, so a
        reader never sees half of it and a failure leaves an older one as it was; a FIFO or
        /dev/stdout is written in place).

        Returns:
            The path written.
        """
        path = write_output_file(path, lambda f: json.dump(
            self.to_dict(), f, separators=(",", ":"), default=str))
        _log.info("offload: wrote trace of %d events to %s (open in ui.perfetto.dev)",
                  len(self), path)
        return path

    def _us(self, t_s: float) -> float:
        return round((t_s - self.origin_s) * 1e6, 3)


def _nesting_lanes(events: list[tuple]) -> list[list[tuple]]:
    """Split one track's events into lanes in which every pair is disjoint or nested.

    Greedy over events sorted by start (longer first on ties, so a parent precedes its
    children): an event joins the first lane where, after closing the intervals that ended
    before it starts, it lies inside the innermost open interval (or no interval is open).
    """
    lanes: list[list[tuple]] = []
    stacks: list[list[float]] = []  # per lane: end times of the open (enclosing) intervals
    for ev in sorted(events, key=lambda e: (e[3], -(e[4] - e[3]))):
        start_s, end_s = ev[3], ev[4]
        for lane, stack in zip(lanes, stacks):
            while stack and stack[-1] <= start_s:
                stack.pop()
            if not stack or end_s <= stack[-1]:
                stack.append(end_s)
                lane.append(ev)
                break
        else:
            lanes.append([ev])
            stacks.append([end_s])
    return lanes


class _NullSpan:
    __slots__ = ()

    def __enter__(self) -> "_NullSpan":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        return None


_NULL_SPAN = _NullSpan()


class NullRecorder:
    """The disabled recorder: every method is a no-op; ``span`` allocates nothing."""

    enabled = False
    clock = staticmethod(time.perf_counter)

    def now(self) -> float:
        return time.perf_counter()

    def span(self, name: str, category: str = "offload", track: str = "compute",
             **args: Any) -> _NullSpan:
        return _NULL_SPAN

    def add(self, name: str, track: str, start_s: float, end_s: float, *,
            category: str = "offload", args: Mapping[str, Any] | None = None) -> None:
        return None

    def counter(self, name: str, values: Mapping[str, float], t_s: float | None = None) -> None:
        return None

    def __len__(self) -> int:
        return 0

    def to_dict(self) -> dict[str, Any]:
        return {"traceEvents": [], "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike) -> None:
        return None


NULL_RECORDER = NullRecorder()
