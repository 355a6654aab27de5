"""Backward read-ahead: follow reverse pack order, keep a byte budget of loads in flight.

Backward consumes saved tensors roughly in the reverse of the order the forward saved them.
The prefetcher keeps a cursor that walks the pack order downwards and, on every fetch, tops
up the loads in flight to `budget_bytes` (at least one). A fetch of a payload that was not
prefetched issues its own load first (so it is first in the engine's queue) and moves the
cursor just below it when the backward has jumped ahead of the cursor; payloads the cursor
skipped are loaded on demand when their turn comes.
"""
from __future__ import annotations

import threading

import torch

from .._ext import core_attr
from ..tiers.base import Payload, Tier
from ..util.ranges import PREFETCH, profiling, span
from ..util.stats import Stats

__all__ = ["Prefetcher", "new_prefetcher"]

# The same prefetcher in C (csrc/prefetcher.cpp): a nvme tier's CPU payloads are read
# through the tier's `cpu_reads` with no Python call; None without the core.
_CorePrefetcher = core_attr("Prefetcher")


def new_prefetcher(budget_bytes: int, stats: Stats):
    """The step's prefetcher: the core's when it is built, else `Prefetcher` (the same
    order, budget and figures)."""
    if _CorePrefetcher is None:
        return Prefetcher(budget_bytes, stats)
    return _CorePrefetcher(budget_bytes, stats, profiling, span, PREFETCH)


class Prefetcher:
    """Read-ahead over the payloads of tiers whose reloads are worth starting early (the
    core's `Prefetcher` is this, in C)."""

    def __init__(self, budget_bytes: int, stats: Stats) -> None:
        self.budget_bytes = budget_bytes
        self._stats = stats
        # Pack order: the payloads and their tiers, in two lists (a (tier, payload) pair
        # would be one more object per save for the garbage collector to walk). Strong
        # references are fine: a payload object is small and released payloads (their space
        # already freed) are skipped; the lists die with the step.
        self._payloads: list[Payload] = []
        self._tiers: list[Tier] = []
        self._position: dict[int, int] = {}       # id(payload) -> its place in pack order
        self._cursor: int | None = None           # next position to prefetch (walking down)
        self._inflight: dict[int, Payload] = {}   # order position -> prefetched, not fetched
        self._inflight_bytes = 0
        self._lock = threading.Lock()  # unpack may run on autograd's device threads

    def register(self, tier: Tier, payload: Payload) -> None:
        """Remember a prefetchable payload's place in pack order."""
        self._position[id(payload)] = len(self._payloads)
        self._payloads.append(payload)
        self._tiers.append(tier)

    def raise_budget(self, nbytes: int) -> None:
        """Read ahead at least `nbytes` from now on (`auto`'s plan asks for more when a
        block's reads are slow next to its backward)."""
        with self._lock:
            if nbytes > self.budget_bytes:
                self.budget_bytes = nbytes

    @property
    def inflight_bytes(self) -> int:
        return self._inflight_bytes

    def fetch(self, tier: Tier, payload: Payload) -> torch.Tensor:
        """Load `payload` (waiting only for it) after queueing read-ahead behind it."""
        with self._lock:
            pos = self._position.get(id(payload), -1)
            if pos >= 0:
                # `prefetch` starts a load only when none is in flight or done (the caller
                # checked that the payload was not released): that is a miss.
                if tier.prefetch(payload):
                    self._stats.prefetch_misses += 1
                else:
                    self._stats.prefetch_hits += 1
                if self._inflight.pop(pos, None) is not None:
                    self._inflight_bytes -= payload.nbytes
                self._top_up(pos)
        return tier.fetch(payload)

    def start(self) -> None:
        """Backward began: start reading ahead from the last payload packed (if the cursor
        has not started yet)."""
        with self._lock:
            if self._cursor is None and self._payloads:
                self._top_up(len(self._payloads))

    def _top_up(self, pos: int) -> None:
        if profiling():  # util/ranges.py
            with span(PREFETCH):
                self._issue(pos)
        else:
            self._issue(pos)

    def _issue(self, pos: int) -> None:
        if self._cursor is None or pos - 1 < self._cursor:
            self._cursor = pos - 1
        if self._inflight_bytes >= self.budget_bytes:
            self._prune()
        tiers, payloads, inflight = self._tiers, self._payloads, self._inflight
        while self._cursor >= 0 and (self._inflight_bytes < self.budget_bytes or not inflight):
            at = self._cursor
            self._cursor = at - 1
            p = payloads[at]
            # False when it is loading or loaded already, or was released: skipped.
            if tiers[at].prefetch(p):
                inflight[at] = p
                self._inflight_bytes += p.nbytes
        if self._inflight_bytes > self._stats.peak_prefetch_bytes:
            self._stats.peak_prefetch_bytes = self._inflight_bytes

    def _prune(self) -> None:
        # A prefetched payload released before its fetch (its saved tensor was never
        # needed) no longer holds read memory: stop counting it.
        for pos, p in list(self._inflight.items()):
            tier = self._tiers[pos]
            if tier.released(p) or not tier.prefetched(p):
                del self._inflight[pos]
                self._inflight_bytes -= p.nbytes

    def clear(self) -> None:
        self._payloads.clear()
        self._tiers.clear()
        self._position.clear()
        self._inflight.clear()
        self._inflight_bytes = 0
