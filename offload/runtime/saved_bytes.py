"""What a step's saves hold: the bytes of saved activations resident on the device, their
peak, and the records holding tier space.

A step's `SavedBytes` meter is counted into by its records (records.py) and by the small
saves of both hook paths (hooks.py NOTE [Handles in C]): the compiled core's
(csrc/saved_bytes.hpp), or without the core `PySavedBytes`, with the same figures.
"""
from __future__ import annotations

import collections
import threading
import time

from .._ext import core_available, load_core

__all__ = ["PySavedBytes", "saved_bytes_meter"]


class PySavedBytes:
    """The compiled core's `SavedBytes` (csrc/saved_bytes.hpp) for a process without it: the
    same figures (no C path, so `take_counts` counts no packed saves: the Python hooks
    count those into Stats themselves); `PyRecord` counts itself in and out through
    `record_made` / `record_freed`, as the core's records do in C.

    A small save dies on whatever thread autograd drops it, and inside the garbage collector
    in the middle of counting another: `small_freed` only queues its key (deque.append is
    atomic), applied before the next small save and when the figures are taken (under
    `_lock`: `ctx.stats` takes them on whatever thread reads it). The id is
    safe: an entry's storage is held by a live save until its count drops to 0; a storage
    that reuses the id was made after that save died, so its free is already queued when it
    is saved. Resident bytes are shared with records, freed on any thread: under `_lock`,
    as are the records holding tier space (`live_records`) and their payloads' release.
    """

    __slots__ = ("resident", "peak", "live_records", "idle_since_s", "_lock", "_count",
                 "_bytes", "_frees", "_storages", "_saved_bytes", "_kept_bytes", "_tier_bytes")

    def __init__(self) -> None:
        self.resident = 0
        self.peak = 0
        self.live_records = 0   # records holding tier space (the step ends at 0)
        self.idle_since_s: float | None = None   # when the last of them died
        # Reentrant, as the core's release lock: a release that frees another record on this
        # thread takes it again.
        self._lock = threading.RLock()
        self._count: dict[int, int] = {}   # small storage id -> saves alive
        self._bytes: dict[int, int] = {}   # small storage id -> its bytes
        self._frees: collections.deque = collections.deque()
        # Counted since the last `take_counts`: storages saved (small ones and records'),
        # their bytes, of those the bytes kept on the device.
        self._storages = 0
        self._saved_bytes = 0
        self._kept_bytes = 0
        self._tier_bytes: dict = {}   # tier -> bytes stored in it

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.resident += nbytes
            if self.resident > self.peak:
                self.peak = self.resident

    def sub(self, nbytes: int) -> None:
        with self._lock:
            self.resident -= nbytes

    def record_made(self, nbytes: int, resident: bool, tier) -> None:
        """A record was made (`PyRecord`, one per stored storage): its bytes if they stay
        resident, and the tier whose space it holds (None: its bytes were kept)."""
        with self._lock:
            if resident:
                self.add(nbytes)
            self._storages += 1
            self._saved_bytes += nbytes
            if tier is None:
                self._kept_bytes += nbytes
            else:
                self.live_records += 1
                self._tier_bytes[tier] = self._tier_bytes.get(tier, 0) + nbytes

    def record_freed(self, tier, payload, nbytes: int, resident: bool) -> None:
        """A record died (its last save did): its payload goes back to its tier (one release
        at a time), then it is counted out."""
        with self._lock:
            if resident:
                self.resident -= nbytes
            if payload is not None:
                try:
                    tier.release(payload)
                finally:   # counted out even when its tier refused (closed): as in the core
                    self.live_records -= 1
                    if self.live_records == 0:
                        self.idle_since_s = time.perf_counter()

    def small_saved(self, key: int, nbytes: int) -> None:
        with self._lock:
            if self._frees:
                self._apply_frees()
            count = self._count.get(key, 0)
            self._count[key] = count + 1
            if count == 0:
                self._bytes[key] = nbytes
                self._storages += 1
                self._saved_bytes += nbytes
                self._kept_bytes += nbytes
                self.add(nbytes)

    def small_freed(self, key: int) -> None:
        self._frees.append(key)

    def take_counts(self) -> tuple:
        """As the core's: (0, 0, storages saved, their bytes, of those kept, [(tier, bytes
        stored in it)]) since the last call."""
        self._apply_frees()
        with self._lock:
            out = (0, 0, self._storages, self._saved_bytes, self._kept_bytes,
                   list(self._tier_bytes.items()))
            self._storages = self._saved_bytes = self._kept_bytes = 0
            self._tier_bytes = {}
        return out

    def _apply_frees(self) -> None:
        with self._lock:
            frees, count = self._frees, self._count
            freed = 0
            while frees:
                key = frees.popleft()
                left = count[key] - 1
                if left:
                    count[key] = left
                else:
                    del count[key]
                    freed += self._bytes.pop(key)
            if freed:
                self.sub(freed)


_CoreSavedBytes = load_core().SavedBytes if core_available() else None


def saved_bytes_meter():
    """The core's `SavedBytes` when the core is built (the small saves' C path counts into
    it), else the Python one."""
    return _CoreSavedBytes() if _CoreSavedBytes is not None else PySavedBytes()
