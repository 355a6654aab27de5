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
           "RoundTripPlan", "plan_for"]

DEFAULT_SAFETY = ROUND_TRIP_SAFETY


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


def pays_off(gap_s: float, out_s: float, in_s: float, *, safety: float = DEFAULT_SAFETY,
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
    items = list(timings)
    windows: dict[Hashable, tuple[float, float]] = {}
    out_done: dict[Hashable, float] = {}
    busy_until = -math.inf
    for t in sorted(items, key=lambda t: t.pack_s):
        start = max(t.pack_s, busy_until)
        busy_until = out_done[t.key] = start + link.out_s(t.nbytes)
    free_from = math.inf   # the in-link is free before this time (filled backwards)
    in_start: dict[Hashable, float] = {}
    for t in sorted(items, key=lambda t: -math.inf if t.unpack_s is None else t.unpack_s,
                    reverse=True):
        if t.unpack_s is None:
            in_start[t.key] = math.inf
            continue
        finish = min(t.unpack_s, free_from)
        free_from = in_start[t.key] = finish - link.in_s(t.nbytes)
    for t in items:
        windows[t.key] = (out_done[t.key], in_start[t.key])
    return windows


def keep_on_device(timings: Iterable[TensorTiming], link: LinkSpeed, *,
                   safety: float = DEFAULT_SAFETY, min_free_s: float = 0.0) -> set[Hashable]:
    """Keys of the tensors that should stay where they are: their round trip would not pay off.

    A tensor is worth moving when, in the simulated queues of :func:`free_windows`, its
    memory is free for at least ``max(min_free_s, (safety - 1) * round_trip_s)``. While
    some tensors fail, the failing half with the shortest pack-to-unpack gaps (the end of
    the forward) is kept and the queues are simulated again without them, which can only
    widen the other windows. Each round keeps at least one tensor, so this ends; the set
    returned is valid (every tensor still moved passes) though not necessarily minimal.
    """
    _check_safety(safety)
    moving = {t.key: t for t in timings}
    keep: set[Hashable] = set()
    while moving:
        windows = free_windows(moving.values(), link)
        failing = []
        for key, t in moving.items():
            done_s, start_s = windows[key]
            need_s = max(min_free_s, (safety - 1.0) * (link.out_s(t.nbytes) + link.in_s(t.nbytes)))
            if start_s - done_s < need_s:
                failing.append(t)
        if not failing:
            break
        failing.sort(key=_gap_s)
        for t in failing[:max(1, len(failing) // 2)]:
            keep.add(t.key)
            del moving[t.key]
    return keep


def _gap_s(t: TensorTiming) -> float:
    return math.inf if t.unpack_s is None else t.unpack_s - t.pack_s


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
        self.safety = safety
        self.max_fraction = max_fraction
        self.keep: frozenset = frozenset()
        self.link: LinkSpeed | None = None

    def learn(self, timings: Iterable[TensorTiming], link: LinkSpeed | None) -> None:
        """Plan the next step from this step's moved storages and measured speeds."""
        timings = list(timings)
        self.link = link
        if link is None or not timings:
            self.keep = frozenset()
            return
        keep = keep_on_device(timings, link, safety=self.safety)
        # Shortest pack → unpack gaps first, up to the cap.
        budget = self.max_fraction * sum(t.nbytes for t in timings)
        chosen, total = set(), 0
        for t in sorted((t for t in timings if t.key in keep), key=_gap_s):
            if total + t.nbytes > budget:
                continue   # a smaller one with a longer gap may still fit
            chosen.add(t.key)
            total += t.nbytes
        self.keep = frozenset(chosen)


def plan_for(model: Any, key: Hashable) -> RoundTripPlan | None:
    """The plan shared by the contexts of one model's training loop (same settings `key`),
    so a fresh `offload.activations(model=...)` per step still learns from the previous
    step; it dies with the model. None without a model (the context then keeps its own)."""
    if model is None:
        return None
    return per_model.state_for(model, ("round_trip", key), RoundTripPlan)
