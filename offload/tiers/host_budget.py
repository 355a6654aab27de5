"""One host budget for the whole process, shared by every host tier alive at once.

NOTE [One host budget] `OFFLOAD_HOST_BYTES` bounds what this process keeps in the host tier
(README: "a size is per process"), not what each step may keep: steps whose graphs are alive
at once (micro-batches kept across contexts, a pipeline's 1F1B order, a loss stored for
later) share it, as the nvme tier's steps share their store (nvme_space.py NOTE [One
budget]). Each host tier keeps its own ledger (its bytes, and the CPU payloads `abort`
frees); the ledger counts into the budget too, and fits into the budget's capacity
(csrc/storage_ref.cpp `HostLedger(capacity, budget=...)`), which counts its ledgers.

The budget is made by the first tier that opens when none is in use, with that tier's
capacity; while it is in use its capacity stands. A tier whose setting is the same (the
same OFFLOAD_HOST_BYTES, though a percentage of the RAM available now resolves to other
bytes) shares it silently; one that asks for another shares it too and is told so once (a
warning). A tier's ledger lets go of it when the tier closes (`detach`)
or the ledger dies, taking what it still counts out of it. In a forked child the parent's
budget is forgotten: its tiers are not the child's.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Hashable

__all__ = ["ledger_for", "after_fork_in_child", "forget_warnings"]

log = logging.getLogger("offload")

_lock = threading.Lock()
_budget: Any = None         # the HostLedger every open host tier's ledger counts into
_key: Hashable = None       # the setting it was made for (OFFLOAD_HOST_BYTES's spec)
_source = ""                # what its capacity was taken of (Stats' capacity_source)
_told: set = set()          # settings already told they share another's budget


def ledger_for(key: Hashable, capacity_bytes: int, new_ledger: Callable[..., Any],
               source: str = "") -> tuple[Any, str]:
    """A new tier's ledger, counting into the process's budget, and what the budget's
    capacity was taken of. The budget is the one in use (some ledger counts into it: its
    `ledgers`), or a new one of `capacity_bytes` for setting `key`. The ledger is made here,
    under the lock, so no other tier can replace an idle budget between the two. A ledger
    lets go of its budget with `detach` (its tier closed) or when it dies."""
    global _budget, _key, _source
    with _lock:
        budget = _budget
        other = _key is not key and _key != key   # (a step's config is the last one's)
        # (A budget of another kind of ledger: a test's stand-in for the core's.)
        if budget is None or type(budget) is not new_ledger or (not budget.ledgers and (
                other or budget.capacity_bytes != capacity_bytes)):
            budget = _budget = new_ledger(capacity_bytes)
            _key, _source = key, source
        elif other and key not in _told:
            _told.add(key)
            log.warning("offload: the host tier's budget is in use by another step of this "
                        "process, made for OFFLOAD_HOST_BYTES=%s (yours: %s); this step "
                        "shares it. Yours applies once no step uses it (give every context "
                        "of a process the same host_bytes)", _shown(_key), _shown(key))
        return new_ledger(capacity_bytes, budget), _source


def _shown(key: Hashable) -> str:
    from ..util.sizes import format_bytes

    return format_bytes(key) if isinstance(key, int) else str(key)


def after_fork_in_child() -> None:
    global _budget, _lock
    _budget, _lock = None, threading.Lock()   # the lock may have been held at the fork


def forget_warnings() -> None:
    _told.clear()
