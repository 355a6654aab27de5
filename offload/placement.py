"""Where one saved storage goes: keep it, or an ordered list of tiers to try.

`Placement.decide` is the single decision point. It applies OFFLOAD_POLICY,
OFFLOAD_MIN_BYTES and `no_offload()`; under `auto` the scheduler's subclass
(`SchedulePlacement`, offload/schedule/session.py) adds the plan: keep or which tier, looked
up by where in the step the storage was saved. Capacity is not decided here: the hook layer
tries the targets in order and a full tier spills to the next (see offload/hooks.py).

Don't bounce: a storage saved at the end of the forward is needed again at the start of the
backward; moving it out and back costs two transfers (and a backward stall) for a free
window of almost nothing. `BouncePlan` learns from the previous step (pack → unpack times of
every moved storage, and the speeds its tier achieved) which storages of the next step to
keep (offload/bounce.py decides). Storages are recognised by (pack position, size), so a
step that saves something else than the last one only loses the benefit, never correctness.
Kept bytes are capped at `max_fraction` of the moved bytes: the measured speeds are lower
bounds (completion seen when polled), so the plan errs towards keeping, and keeping costs
device memory.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Mapping

import torch

from .bounce import LinkSpeed, TensorTiming, keep_on_device
from .config import Config

__all__ = ["TensorInfo", "Decision", "Placement", "BouncePlan", "plan_for"]


class TensorInfo:
    """What the decision may look at. `nbytes` is the whole storage (what would be freed).

    A slotted class, not a dataclass: one is built per saved storage, on the hot path.
    """

    __slots__ = ("nbytes", "device", "dtype", "no_offload", "in_backward", "hints", "key",
                 "storage")

    def __init__(self, nbytes: int, device: torch.device, dtype: torch.dtype,
                 no_offload: bool = False, hints: Mapping[str, Any] | None = None,
                 key: Hashable = None, in_backward: bool = False,
                 storage: torch.UntypedStorage | None = None) -> None:
        self.key = key  # (position among the step's stored storages, nbytes): BouncePlan
        self.nbytes = nbytes
        self.device = device
        self.dtype = dtype
        self.no_offload = no_offload
        self.in_backward = in_backward  # saved while a backward runs
        self.hints = hints
        self.storage = storage  # the scheduler finds the op that made it (schedule/session.py)


@dataclass(frozen=True)
class Decision:
    """`targets` empty: keep in place. Otherwise tiers to try in order (spill order)."""

    targets: tuple[str, ...]
    reason: str

    @property
    def keep(self) -> bool:
        return not self.targets


class BouncePlan:
    """Storages to keep in the next step because moving them would bounce (module doc)."""

    def __init__(self, safety: float = 1.5, max_fraction: float = 0.1) -> None:
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
        # Shortest pack → unpack gaps first, up to the cap (see module doc).
        budget = self.max_fraction * sum(t.nbytes for t in timings)
        chosen, total = set(), 0
        for t in sorted((t for t in timings if t.key in keep),
                        key=lambda t: float("inf") if t.unpack_s is None
                        else t.unpack_s - t.pack_s):
            if total + t.nbytes > budget:
                continue   # a smaller one with a longer gap may still fit
            chosen.add(t.key)
            total += t.nbytes
        self.keep = frozenset(chosen)


_plans: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_plans_lock = threading.Lock()


def plan_for(model: torch.nn.Module | None, key: Hashable) -> BouncePlan | None:
    """The plan shared by the contexts of one model's training loop (same settings `key`),
    so a fresh `offload.activations(model=...)` per step still learns from the previous
    step; it dies with the model. None without a model (the context then keeps its own)."""
    if model is None:
        return None
    with _plans_lock:
        return _plans.setdefault(model, {}).setdefault(key, BouncePlan())


class Placement:
    """The default decision: every eligible storage goes to OFFLOAD_TIERS in order."""

    def __init__(self, config: Config, bounce: BouncePlan | None = None,
                 moves: bool | None = None) -> None:
        self.config = config
        self.bounce = bounce
        self.bounce_decision = Decision((), "would bounce")
        self._min_bytes = config.min_bytes
        # Decisions are immutable: build each once (decide runs once per saved storage).
        self._by_policy = Decision((), f"policy={config.policy}")
        self._no_offload = Decision((), "no_offload")
        # Saved while a backward runs (reentrant checkpoint's recompute, double backward):
        # needed again within the same backward, so moving it out and back is pure waste.
        self.backward_decision = Decision((), "saved during backward")
        self._small = Decision((), "below min_bytes")
        # `moves`: the scheduler's policies move too (default: only under `offload`).
        moves = config.policy == "offload" if moves is None else moves
        self._offload = Decision(config.tiers, "offload") if moves else None

    def decide(self, info: TensorInfo) -> Decision:
        if self._offload is None:
            return self._by_policy
        if info.no_offload:
            return self._no_offload
        if info.in_backward:
            return self.backward_decision
        if info.nbytes < self._min_bytes:
            return self._small
        if self.bounce is not None and info.key in self.bounce.keep:
            return self.bounce_decision
        return self._offload
