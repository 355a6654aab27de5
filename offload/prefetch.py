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

from .stats import Stats
from .tiers.base import Payload

__all__ = ["Prefetcher"]


class Prefetcher:
    def __init__(self, budget_bytes: int, stats: Stats) -> None:
        self.budget_bytes = budget_bytes
        self._stats = stats
        # Pack order. Strong references are fine: a payload object is small and released
        # payloads (their space already freed) are skipped; the list dies with the step.
        self._order: list[Payload] = []
        self._cursor: int | None = None           # next position to prefetch (walking down)
        self._inflight: dict[int, Payload] = {}   # order position -> prefetched, not fetched
        self._inflight_bytes = 0
        self._lock = threading.Lock()  # unpack may run on autograd's device threads

    def register(self, payload: Payload) -> None:
        """Remember a prefetchable payload's place in pack order."""
        payload.order_pos = len(self._order)
        self._order.append(payload)

    @property
    def inflight_bytes(self) -> int:
        return self._inflight_bytes

    def fetch(self, payload: Payload) -> torch.Tensor:
        """Load `payload` (waiting only for it) after queueing read-ahead behind it."""
        with self._lock:
            pos = payload.order_pos
            if pos >= 0:
                if payload.prefetched:
                    self._stats.prefetch_hits += 1
                else:
                    self._stats.prefetch_misses += 1
                    payload.prefetch()
                if self._inflight.pop(pos, None) is not None:
                    self._inflight_bytes -= payload.nbytes
                self._top_up(pos)
        return payload.fetch()

    def start(self) -> None:
        """Backward began: start reading ahead from the last payload packed (if the cursor
        has not started yet)."""
        with self._lock:
            if self._cursor is None and self._order:
                self._top_up(len(self._order))

    def _top_up(self, pos: int) -> None:
        if self._cursor is None or pos - 1 < self._cursor:
            self._cursor = pos - 1
        if self._inflight_bytes >= self.budget_bytes:
            self._prune()
        while self._cursor >= 0 and (self._inflight_bytes < self.budget_bytes
                                     or not self._inflight):
            p = self._order[self._cursor]
            self._cursor -= 1
            if p.prefetched or p.released:
                continue
            p.prefetch()
            self._inflight[p.order_pos] = p
            self._inflight_bytes += p.nbytes
        if self._inflight_bytes > self._stats.peak_prefetch_bytes:
            self._stats.peak_prefetch_bytes = self._inflight_bytes

    def _prune(self) -> None:
        # A prefetched payload released before its fetch (its saved tensor was never
        # needed) no longer holds read memory: stop counting it.
        for pos, p in list(self._inflight.items()):
            if p.released or not p.prefetched:
                del self._inflight[pos]
                self._inflight_bytes -= p.nbytes

    def clear(self) -> None:
        self._order.clear()
        self._inflight.clear()
        self._inflight_bytes = 0
