"""One host budget for the whole process, shared by every host tier alive at once.

NOTE [One host budget] `OFFLOAD_HOST_BYTES` bounds what this process keeps in the host tier
(README: "a size is per process"), not what each step may keep: steps whose graphs are alive
at once (micro-batches kept across contexts, a pipeline's 1F1B order, a loss stored for
later) share it, as the nvme tier's steps share their store (nvme_space.py NOTE [One
budget]). Each host tier keeps its own ledger (its bytes, and the CPU payloads `abort`
frees); the ledger counts into the budget too, and fits into the budget's capacity
(csrc/storage_ref.cpp `HostLedger(capacity, budget=...)`).

The budget is made by the first tier that opens when none is in use, with that tier's
capacity; while it is in use its capacity stands, and a tier that asks for another shares it
and says so once (a warning). A tier lets go of it when it closes (`release`), taking what
it still counts out of it. In a forked child the parent's budget is forgotten: its tiers
are not the child's.
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Callable

__all__ = ["acquire", "release", "after_fork_in_child", "forget_warnings"]

log = logging.getLogger("offload")

_lock = threading.Lock()
_budget: Any = None        # the HostLedger every open host tier counts into
# The open tiers that hold it; weak, so a tier dropped without `close` (built by hand) does
# not hold the budget's size for ever.
_users: "weakref.WeakSet[Any]" = weakref.WeakSet()
_told: set[int] = set()    # capacities already told they share another's


def acquire(tier: Any, capacity_bytes: int, new_ledger: Callable[..., Any]) -> Any:
    """The process's host budget for `tier`: the one in use, or a new one of
    `capacity_bytes` made with `new_ledger(capacity_bytes)` when no tier uses one."""
    global _budget
    with _lock:
        if _budget is None or not _users:
            _budget = new_ledger(capacity_bytes)
        elif _budget.capacity_bytes != capacity_bytes and capacity_bytes not in _told:
            _told.add(capacity_bytes)
            from ..util.sizes import format_bytes

            log.warning("offload: the host tier's budget is in use by another step of this "
                        "process, with OFFLOAD_HOST_BYTES=%s (yours: %s); this step shares it. "
                        "Yours applies once no step uses it (give every context of a process "
                        "the same host_bytes)", format_bytes(_budget.capacity_bytes),
                        format_bytes(capacity_bytes))
        _users.add(tier)
        return _budget


def release(tier: Any) -> None:
    """`tier` closed (its ledger was detached from the budget)."""
    with _lock:
        _users.discard(tier)


def after_fork_in_child() -> None:
    global _budget, _users
    _budget, _users = None, weakref.WeakSet()


def forget_warnings() -> None:
    _told.clear()
