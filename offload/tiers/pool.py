"""Keep the expensive tier resources between steps (one per kind).

Opening an NvmeStore reserves its slabs (fallocate) and a fresh HostArena faults in every
page it touches again, per step (docs/benchmarks.md, *Why the runtime's constants*).
Pinned memory is worse (cudaHostAlloc costs ms per call). So a clean tier hands its store / arena back here when
its step ends and the next step with the same settings takes it again.

One slot per kind: a resource with different settings evicts (closes) the previous one,
so at most one store and one arena of each kind outlive a step. A checked-out resource is
not in the pool, so two contexts alive at once never share one. `clear()` closes all
(also called at interpreter exit); a step that ends with an exception never returns its
resources.
"""
from __future__ import annotations

import atexit
import threading
from typing import Any, Callable, Hashable

__all__ = ["take", "give_back", "clear"]

_lock = threading.Lock()
_slots: dict[str, tuple[Hashable, Any]] = {}


def take(kind: str, key: Hashable, create: Callable[[], Any]) -> Any:
    """The pooled resource of `kind` if it was made with `key`, else a new one."""
    with _lock:
        slot = _slots.get(kind)
        if slot is not None and slot[0] == key:
            del _slots[kind]
            return slot[1]
    return create()


def give_back(kind: str, key: Hashable, resource: Any) -> None:
    """Offer a clean resource for the next step; evicts (closes) what held the slot."""
    with _lock:
        old = _slots.get(kind)
        _slots[kind] = (key, resource)
    if old is not None and old[1] is not resource:
        _close(old[1])


def clear() -> None:
    """Close every pooled resource now."""
    with _lock:
        items = list(_slots.values())
        _slots.clear()
    for _, resource in items:
        _close(resource)


def _close(resource: Any) -> None:
    close = getattr(resource, "close", None)
    if close is not None:
        close()


def after_fork_in_child() -> None:
    """In a forked child: set the parent's resources aside (offload/process.py), never reuse or free them."""
    global _lock
    _lock = threading.Lock()  # the parent may have held it at fork time
    _inherited.extend(_slots.values())
    _slots.clear()


# Resources a forked child inherited: kept referenced so that nothing frees them there.
_inherited: list = []

atexit.register(clear)
