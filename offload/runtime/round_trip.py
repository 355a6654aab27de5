"""The round-trip plan: keep a storage where it is when moving it out and back cannot free
memory.

A tensor saved near the end of the forward is needed again near the start of the backward.
Offloading it costs the copy out plus the copy back, and the device memory is only free
between the end of the first and the start of the second. When that window is short or
negative, both copies are paid, nothing is saved, and backward may stall on it. This module
decides from *measured* times (a previous step's pack/unpack clock and the transfer speeds
seen on this machine), never from a fixed count of layers.

The same logic serves every tier: on a GPU "out" is D2H and "in" is H2D; on a CPU-only run
with NVMe, "out" is the SSD write and "in" the read. `RoundTripPlan` learns it from one step
for the next; storages are recognised by (pack position, size), so a step that saves
something else than the last one only loses the benefit, never correctness.

Example:
    >>> link = LinkSpeed(out_bytes_per_s=50e9, in_bytes_per_s=50e9)
    >>> pays_off(gap_s=0.004, out_s=link.out_s(64 << 20), in_s=link.in_s(64 << 20))
    False
    >>> keep = keep_on_device(timings_from_last_step, link)   # keys that should stay
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Hashable, Iterable

from ..util import per_model
from ..util.constants import ROUND_TRIP_MAX_KEPT_FRACTION, ROUND_TRIP_SAFETY

__all__ = ["LinkSpeed", "TensorTiming", "pays_off", "free_windows", "keep_on_device",
           "RoundTripPlan", "choose_kept", "plan_for"]


@dataclass(frozen=True)
class LinkSpeed:
    """Measured speeds of one tier's path.

    Attributes:
        out_bytes_per_s: Achieved bandwidth moving out (D2H, or RAM to SSD).
        in_bytes_per_s: Achieved bandwidth moving back (H2D, or SSD to RAM).
        latency_s: Fixed cost per transfer (launch, event, I/O submission).
    """

    out_bytes_per_s: float
    in_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self):
        for name in ("out_bytes_per_s", "in_bytes_per_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"LinkSpeed.{name}={value!r}: must be a positive, finite number "
                                 "of bytes per second (measure it, e.g. with the probe)")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"LinkSpeed.latency_s={self.latency_s!r}: must be >= 0 seconds")

    def out_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.out_bytes_per_s

    def in_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.in_bytes_per_s


@dataclass(frozen=True)
class TensorTiming:
    """When one saved tensor was packed and unpacked in a measured step.

    Attributes:
        key: Whatever identifies the tensor from one step to the next (e.g. pack index).
        nbytes: Bytes that would move.
        pack_s: Time of the pack (step clock, seconds).
        unpack_s: Time of the unpack, or None if backward never asked for it.
    """

    key: Hashable
    nbytes: int
    pack_s: float
    unpack_s: float | None


def pays_off(gap_s: float, out_s: float, in_s: float, *, safety: float = ROUND_TRIP_SAFETY,
             min_free_s: float = 0.0) -> bool:
    """Whether one tensor, on an otherwise idle link, is worth moving out and back.

    Args:
        gap_s: Pack-to-unpack time measured in the previous step.
        out_s: Time to move it out (its size over the measured bandwidth, plus latency).
        in_s: Time to bring it back.
        safety: The round trip must fit this many times into the gap, to absorb jitter
            and queueing (>= 1).
        min_free_s: The memory must also be free at least this long.

    Returns:
        True when ``gap_s >= safety * (out_s + in_s)`` and the free window
        ``gap_s - out_s - in_s`` is at least ``min_free_s``.
    """
    _check_safety(safety)
    roundtrip_s = out_s + in_s
    return gap_s >= safety * roundtrip_s and gap_s - roundtrip_s >= min_free_s


def free_windows(timings: Iterable[TensorTiming], link: LinkSpeed
                 ) -> dict[Hashable, tuple[float, float]]:
    """Simulate one step's copy queues; return ``key -> (out_done_s, in_start_s)``.

    Copies out run one after another in pack order, each starting when its tensor is packed
    or when the previous copy ends. Copies back are placed as late as possible (just in
    time, the way a prefetcher with enough budget would issue them), one after another,
    each finishing by its tensor's unpack. The device memory of a tensor is free from
    ``out_done_s`` to ``in_start_s``; a window that is short or negative means it bounces.
    Tensors never unpacked get ``in_start_s = inf``.
    """
    cols = _Columns.of(timings, link)
    out_done, in_start = cols.windows([True] * len(cols.keys))
    return {key: (out_done[i], in_start[i]) for i, key in enumerate(cols.keys)}


def keep_on_device(timings: Iterable[TensorTiming], link: LinkSpeed, *,
                   safety: float = ROUND_TRIP_SAFETY, min_free_s: float = 0.0) -> set[Hashable]:
    """Keys of the tensors that should stay where they are: their round trip would not pay off.

    A tensor is worth moving when, in the simulated queues of :func:`free_windows`, its
    memory is free for at least ``max(min_free_s, (safety - 1) * round_trip_s)``. While
    some tensors fail, the failing half with the shortest pack-to-unpack gaps (the end of
    the forward) is kept and the queues are simulated again without them, which can only
    widen the other windows. Each round keeps at least one tensor, so this ends; the set
    returned is valid (every tensor still moved passes) though not necessarily minimal.
    """
    _check_safety(safety)
    cols = _Columns.of(timings, link)
    return {cols.keys[i] for i in cols.keep(safety, min_free_s)}


class _Columns:
    """Timings as parallel lists, each tensor an index (in first-seen key order), with both
    queue orders sorted once: the step end runs this over thousands of storages, so a round
    makes no object per tensor. The arithmetic is the plain sequential one, in the same
    order as written in the docs above (no vectorized re-association: same floats)."""

    __slots__ = ("keys", "nbytes", "pack_s", "unpack_s", "out_s", "in_s", "by_pack",
                 "by_unpack")

    def __init__(self, keys, nbytes, pack_s, unpack_s: list, link: LinkSpeed) -> None:
        self.keys, self.nbytes, self.pack_s, self.unpack_s = keys, nbytes, pack_s, unpack_s
        self.out_s = [link.out_s(b) for b in nbytes]
        self.in_s = [link.in_s(b) for b in nbytes]
        n = len(keys)
        self.by_pack = sorted(range(n), key=pack_s.__getitem__)
        # Latest unpack first; never unpacked (None) last. Stable: ties keep key order.
        self.by_unpack = sorted(range(n), key=lambda i: -math.inf if unpack_s[i] is None
                                else unpack_s[i], reverse=True)

    @classmethod
    def of(cls, timings: Iterable[TensorTiming], link: LinkSpeed) -> "_Columns":
        # Keys are unique; a repeated one counts once (its last timing, in its first place).
        last = {t.key: t for t in timings}
        items = list(last.values())
        return cls([t.key for t in items], [t.nbytes for t in items],
                   [t.pack_s for t in items], [t.unpack_s for t in items], link)

    def windows(self, moving: list[bool]) -> tuple[list[float], list[float]]:
        """`free_windows` of the tensors with `moving[i]`: (out_done_s, in_start_s)."""
        n = len(self.keys)
        out_done = [0.0] * n
        in_start = [math.inf] * n
        pack_s, unpack_s, out_s, in_s = self.pack_s, self.unpack_s, self.out_s, self.in_s
        busy_until = -math.inf
        for i in self.by_pack:
            if moving[i]:
                start = max(pack_s[i], busy_until)
                busy_until = out_done[i] = start + out_s[i]
        free_from = math.inf   # the in-link is free before this time (filled backwards)
        for i in self.by_unpack:
            if moving[i]:
                unpack = unpack_s[i]
                if unpack is None:
                    continue   # in_start stays inf
                finish = min(unpack, free_from)
                free_from = in_start[i] = finish - in_s[i]
        return out_done, in_start

    def gap_s(self, i: int) -> float:
        unpack = self.unpack_s[i]
        return math.inf if unpack is None else unpack - self.pack_s[i]

    def keep(self, safety: float, min_free_s: float) -> list[int]:
        """`keep_on_device`, as indices in the order they were kept."""
        n = len(self.keys)
        need = [max(min_free_s, (safety - 1.0) * (self.out_s[i] + self.in_s[i]))
                for i in range(n)]
        moving = [True] * n
        left = n
        kept: list[int] = []
        while left:
            out_done, in_start = self.windows(moving)
            failing = [i for i in range(n)
                       if moving[i] and in_start[i] - out_done[i] < need[i]]
            if not failing:
                break
            failing.sort(key=self.gap_s)
            for i in failing[:max(1, len(failing) // 2)]:
                kept.append(i)
                moving[i] = False
                left -= 1
        return kept


def _check_safety(safety: float) -> None:
    if not safety >= 1.0:
        raise ValueError(f"safety={safety!r}: must be >= 1 (the round trip has to fit into "
                         "the pack-to-unpack gap at least once)")


class RoundTripPlan:
    """Storages to keep in the next step because their round trip would not pay off.

    Kept bytes are capped at `max_fraction` of the moved bytes: the measured speeds are
    lower bounds (completion seen when polled), so the plan errs towards keeping, and
    keeping costs device memory.
    """

    def __init__(self, safety: float = ROUND_TRIP_SAFETY,
                 max_fraction: float = ROUND_TRIP_MAX_KEPT_FRACTION) -> None:
        _check_safety(safety)
        self.safety = safety
        self.max_fraction = max_fraction
        self.keep: frozenset = frozenset()
        self.link: LinkSpeed | None = None

    def learn(self, timings: Iterable[TensorTiming], link: LinkSpeed | None) -> None:
        """Plan the next step from this step's moved storages and measured speeds."""
        self.link = link
        if link is None:
            self.keep = frozenset()
            return
        cols = _Columns.of(timings, link)
        self.keep = frozenset(cols.keys[i] for i in _choose(cols, self.safety,
                                                              self.max_fraction))

    def learn_timeline(self, timeline, link: LinkSpeed | None) -> None:
        """Plan the next step from a step's Timeline (runtime/timeline.py), whose
        `round_trip_keep` makes the choice of `choose_kept` over its rows: the core's in C
        (csrc/round_trip.cpp, the same rows float for float, no object per row), the
        Python one through `choose_kept` itself."""
        self.link = link
        if link is None:
            self.keep = frozenset()
            return
        self.keep = timeline.round_trip_keep(link.out_bytes_per_s, link.in_bytes_per_s,
                                             link.latency_s, self.safety, self.max_fraction)


def choose_kept(positions, nbytes, pack_s, unpack_s: list, link: LinkSpeed,
                safety: float = ROUND_TRIP_SAFETY,
                max_fraction: float = ROUND_TRIP_MAX_KEPT_FRACTION) -> frozenset:
    """The keys ``(positions[i], nbytes[i])`` of the rows a `RoundTripPlan` keeps, from a
    step's timeline as columns (Timeline.columns(); `unpack_s[i]` None when never
    unpacked): only the kept rows' keys are made (no object per row)."""
    _check_safety(safety)
    cols = _Columns(range(len(positions)), nbytes, pack_s, unpack_s, link)
    return frozenset((positions[i], nbytes[i]) for i in _choose(cols, safety, max_fraction))


def _choose(cols: _Columns, safety: float, max_fraction: float) -> list[int]:
    """Rows to keep: those whose round trip does not pay off, shortest pack → unpack gaps
    first, up to `max_fraction` of the bytes (csrc/round_trip.cpp does the same in C)."""
    if not cols.keys:
        return []
    budget = max_fraction * sum(cols.nbytes)
    chosen, total = [], 0
    # Row order, then by gap (stable): ties go to the earlier row.
    for i in sorted(sorted(cols.keep(safety, 0.0)), key=cols.gap_s):
        nbytes = cols.nbytes[i]
        if total + nbytes > budget:
            continue   # a smaller one with a longer gap may still fit
        chosen.append(i)
        total += nbytes
    return chosen


def plan_for(model: Any, key: Hashable) -> RoundTripPlan | None:
    """The plan shared by the contexts of one model's training loop (same settings `key`),
    so a fresh `offload.activations(model=...)` per step still learns from the previous
    step; it dies with the model. None without a model (the context then keeps its own)."""
    if model is None:
        return None
    return per_model.state_for(model, ("round_trip", key), RoundTripPlan)
