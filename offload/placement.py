"""Where one saved storage goes: keep it, or an ordered list of tiers to try.

`Placement.decide` is the single decision point. Today it applies OFFLOAD_POLICY,
OFFLOAD_MIN_BYTES and `no_offload()`; the scheduler (recompute vs offload per tensor and op,
via torch.utils.checkpoint's context_fn) replaces it with a subclass that also looks at the
hints (op, block, position in the step). Capacity is not decided here: the hook layer tries
the targets in order and a full tier spills to the next (see offload/hooks.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .config import Config

__all__ = ["TensorInfo", "Decision", "Placement"]


class TensorInfo:
    """What the decision may look at. `nbytes` is the whole storage (what would be freed).

    A slotted class, not a dataclass: one is built per saved storage, on the hot path.
    """

    __slots__ = ("nbytes", "device", "dtype", "no_offload", "hints")

    def __init__(self, nbytes: int, device: torch.device, dtype: torch.dtype,
                 no_offload: bool = False, hints: Mapping[str, Any] | None = None) -> None:
        self.nbytes = nbytes
        self.device = device
        self.dtype = dtype
        self.no_offload = no_offload
        self.hints = hints


@dataclass(frozen=True)
class Decision:
    """`targets` empty: keep in place. Otherwise tiers to try in order (spill order)."""

    targets: tuple[str, ...]
    reason: str

    @property
    def keep(self) -> bool:
        return not self.targets


class Placement:
    """The default decision: every eligible storage goes to OFFLOAD_TIERS in order."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._min_bytes = config.min_bytes
        # Decisions are immutable: build each once (decide runs once per saved storage).
        self._by_policy = Decision((), f"policy={config.policy}")
        self._no_offload = Decision((), "no_offload")
        self._small = Decision((), "below min_bytes")
        self._offload = Decision(config.tiers, "offload") if config.policy == "offload" else None

    def decide(self, info: TensorInfo) -> Decision:
        if self._offload is None:
            return self._by_policy
        if info.no_offload:
            return self._no_offload
        if info.nbytes < self._min_bytes:
            return self._small
        return self._offload
