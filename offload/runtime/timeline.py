"""When each stored storage of a step was packed and unpacked: what the round-trip plan and
`auto` learn from.

Rows live in flat arrays (no Python object per storage: the garbage collector walks every
tracked object again and again while a step holds thousands). A record keeps its row's index
and marks its first unpack; `rows()` gives `[key, nbytes, pack_s, unpack_s]` per row, the key
being (position among the step's stored storages, nbytes), as placement sees it,
`columns()` the same without an object per row, and `round_trip_keep()` the keys the
round-trip plan keeps next step (what the step end learns).

`Timeline` is the compiled core's (csrc/timeline.cpp: a row costs no Python frame, the
core's Unpacker marks it without a Python call, and the round-trip plan is chosen in C,
csrc/round_trip.cpp), or without the core `PyTimeline`, the same in Python.
"""
from __future__ import annotations

import math
from array import array

from .._ext import core_available, load_core
from .round_trip import LinkSpeed, choose_kept

__all__ = ["Timeline", "PyTimeline"]


class PyTimeline:
    """The compiled core's `Timeline` for a process without it."""

    __slots__ = ("_position", "_nbytes", "_pack_s", "_unpack_s")

    def __init__(self) -> None:
        self._position = array("q")
        self._nbytes = array("q")
        self._pack_s = array("d")
        self._unpack_s = array("d")

    def add(self, position: int, nbytes: int, pack_s: float) -> int:
        """A row for a storage packed at `pack_s`; returns its index. A whole row or none
        (the values are checked before any column grows), as the core's."""
        sizes, pack_s = array("q", (position, nbytes)), float(pack_s)   # may raise: none added
        self._position.append(sizes[0])
        self._nbytes.append(sizes[1])
        self._pack_s.append(pack_s)
        self._unpack_s.append(math.nan)
        return len(self._pack_s) - 1

    def unpacked(self, index: int, now_s: float) -> None:
        """The storage's first unpack (later ones do not move it)."""
        if not 0 <= index < len(self._unpack_s):
            raise IndexError(f"offload: Timeline row {index} out of range "
                             f"({len(self._unpack_s)} rows)")
        if math.isnan(self._unpack_s[index]):
            self._unpack_s[index] = now_s

    def rows(self) -> list[list]:
        positions, nbytes, pack_s, unpack_s = self.columns()
        return [[(p, b), b, s, u] for p, b, s, u in zip(positions, nbytes, pack_s, unpack_s)]

    def columns(self) -> tuple:
        """(positions, nbytes, pack_s, unpack_s): the rows as columns, unpack_s None where
        never unpacked (no object per row)."""
        unpack_s = [None if math.isnan(u) else u for u in self._unpack_s]
        # Copies, as the core's: later rows do not grow what was handed out.
        return array("q", self._position), array("q", self._nbytes), array("d", self._pack_s), \
            unpack_s

    def round_trip_keep(self, out_bytes_per_s: float, in_bytes_per_s: float,
                        latency_s: float, safety: float, max_fraction: float) -> frozenset:
        """The keys (position, nbytes) of the rows the round-trip plan keeps next step
        (RoundTripPlan.learn_timeline)."""
        return choose_kept(*self.columns(), LinkSpeed(out_bytes_per_s, in_bytes_per_s,
                                                      latency_s), safety, max_fraction)

    def __len__(self) -> int:
        return len(self._pack_s)


Timeline = load_core().Timeline if core_available() else PyTimeline
