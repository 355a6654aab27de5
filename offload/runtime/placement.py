"""Where one saved storage goes: keep it, or an ordered list of tiers to try.

`Placement.decide` is the single decision point. It applies OFFLOAD_POLICY,
OFFLOAD_MIN_BYTES and `no_offload()`; under `auto` the scheduler's subclass
(`SchedulePlacement`, offload/schedule/session.py) adds the plan: keep or which tier, looked
up by where in the step the storage was saved. Capacity is not decided here: the hook layer
tries the targets in order and a full tier spills to the next (see offload/runtime/hooks.py).

Keep what would not pay off: a storage saved at the end of the forward is needed again at
the start of the backward; moving it out and back costs two transfers (and a backward
stall) for a free window of almost nothing. The step's `RoundTripPlan` (round_trip.py),
learned from the previous step's measured times and speeds, names the storages to keep.

NOTE [Standing decision] `Placement.standing` is what `decide` returns for a storage that
none of its tests keeps (the tiers of OFFLOAD_TIERS), and None where no such answer holds
for every storage: while a decision is `forced`, under a policy that does not move, and for
the scheduler's placement (its answer depends on where the storage was saved). The core's
packer reads it to store a plain CPU activation without calling `decide` (hooks.py NOTE
[Move path in C]); it redoes every other test of `decide` first (no_offload, backward,
min_bytes, the round-trip plan), so both give the same answer (tests/test_move_path.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Hashable

import torch

from ..config import Config
from .round_trip import RoundTripPlan

__all__ = ["TensorInfo", "Decision", "Placement"]


class TensorInfo:
    """What the decision may look at. `nbytes` is the whole storage (what would be freed).

    A slotted class, not a dataclass: one is built per saved storage, on the hot path.
    """

    __slots__ = ("nbytes", "no_offload", "in_backward", "key", "storage")

    def __init__(self, nbytes: int, no_offload: bool = False, in_backward: bool = False,
                 key: Hashable = None, storage: torch.UntypedStorage | None = None) -> None:
        self.nbytes = nbytes
        self.no_offload = no_offload
        self.in_backward = in_backward  # saved while a backward runs
        self.key = key  # (position among the step's stored storages, nbytes): round trip
        self.storage = storage  # the scheduler finds the op that made it (schedule/)


@dataclass(frozen=True)
class Decision:
    """`targets` empty: keep in place. Otherwise tiers to try in order (spill order)."""

    targets: tuple[str, ...]
    reason: str

    @property
    def keep(self) -> bool:
        return not self.targets


# Decisions are immutable: each is built once (decide runs once per saved storage, and a
# Placement is made every step), and the hooks tell some apart by identity.
_ROUND_TRIP = Decision((), "round trip would not pay off")
_NO_OFFLOAD = Decision((), "no_offload")
# Saved while a backward runs (reentrant checkpoint's recompute, double backward): needed
# again within the same backward, so moving it out and back is pure waste.
_IN_BACKWARD = Decision((), "saved during backward")
_SMALL = Decision((), "below min_bytes")
_by_settings: dict[tuple, tuple[Decision, Decision]] = {}   # (policy, tiers) -> the two below


def _setting_decisions(policy: str, tiers: tuple[str, ...]) -> tuple[Decision, Decision]:
    """(keep by the policy, move to `tiers`) for these settings."""
    key = (policy, tiers)
    made = _by_settings.get(key)
    if made is None:
        made = _by_settings[key] = (Decision((), f"policy={policy}"), Decision(tiers, "offload"))
    return made


class Placement:
    """The default decision: every eligible storage goes to OFFLOAD_TIERS in order."""

    round_trip_decision = _ROUND_TRIP
    backward_decision = _IN_BACKWARD

    def __init__(self, config: Config, round_trip: RoundTripPlan | None = None,
                 moves: bool | None = None) -> None:
        self.config = config
        self.round_trip = round_trip
        self._forced: Decision | None = None
        self._min_bytes = config.min_bytes
        self._by_policy, offload = _setting_decisions(config.policy, config.tiers)
        # `moves`: the scheduler's policies move too (default: only under `offload`).
        moves = config.policy == "offload" if moves is None else moves
        self._offload = offload if moves else None
        self.standing: Decision | None = self._offload   # NOTE [Standing decision]

    @contextlib.contextmanager
    def forced(self, decision: Decision):
        """The next decisions are `decision` (an op output the scheduler stores,
        schedule/recompute.py)."""
        self._forced, standing, self.standing = decision, self.standing, None
        try:
            yield
        finally:
            self._forced, self.standing = None, standing

    def decide(self, info: TensorInfo) -> Decision:
        if self._forced is not None:
            return self._forced
        if self._offload is None:
            return self._by_policy
        if info.no_offload:
            return _NO_OFFLOAD
        if info.in_backward:
            return _IN_BACKWARD
        if info.nbytes < self._min_bytes:
            return _SMALL
        if self.round_trip is not None and info.key in self.round_trip.keep:
            return _ROUND_TRIP
        return self._offload
