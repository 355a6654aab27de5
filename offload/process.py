"""Everything of offload's that outlives one step, and the one place that resets it.

NOTE [Process state] A step's own state dies with the step (runtime/step.py). What lives
longer is listed here, each piece kept by the module that uses it:

| state | kept by | `empty_cache()` | `reset()` (tests) | forked child |
|---|---|---|---|---|
| NVMe stores, one per directory set | tiers/nvme_space.py | idle ones closed | idle ones closed | abandoned: slab descriptors closed, I/O threads (not forked) untouched |
| the host tier's budget, one per process | tiers/host_budget.py | – | – | forgotten (the parent's tiers are not the child's) |
| stores and arenas pooled for the next step | tiers/pool.py | closed | closed | set aside, never reused or freed (freeing pinned memory would call CUDA) |
| CUDA copy streams per device (copies Note 13) | tiers/cuda_backend.py | kept | forgotten | forgotten (a child cannot use the parent's CUDA state) |
| glibc heap settings of a step in progress | tiers/heap.py | – | – | back to normal |
| saved-tensor hooks of a step in progress (torch's hook stack is the forking thread's) | runtime/hooks.py | – | – | hold every save as it is: the child's own autograd runs as without offload |
| hooks of a context exited on another thread, left on the entering thread's stack | runtime/hook_stack.py | – | – | – (retired: they hold every save as it is; that thread's next save, block call or enter takes them off) |
| exited steps whose saved tensors live on | runtime/step.py | finished if idle | finished if idle | – |
| per-model plans: round trip, `auto`'s sessions, buffer slots | util/per_model.py | kept | cleared | kept |
| `auto`'s probe figures and warnings said once | schedule/, config.py, runtime/subclasses.py, runtime/hooks.py, runtime/step.py, tiers/nvme_space.py | kept | cleared | kept |

Arena memory itself is never shared with a child (MADV_WIPEONFORK / MADV_DONTFORK,
csrc/host_arena.cpp) and slabs are opened O_CLOEXEC, so an exec'd program inherits none.
The fork handler is registered with `os.register_at_fork` when offload is imported, so
forks made through Python (multiprocessing, DataLoader workers, os.fork) are covered.
"""
from __future__ import annotations

import os

from . import config as _config
from .runtime import (hooks as _hooks, step as _step, storing as _storing,
                      subclasses as _subclasses)
from .schedule import reset as _schedule_reset
from .tiers import (cuda_backend as _copies, heap as _heap, host_budget as _host_budget,
                    nvme_space as _nvme_space, pool as _pool)
from .util import per_model as _per_model

__all__ = ["empty_cache", "reset", "after_fork_in_child"]


def empty_cache(stores: bool = True) -> None:
    """Close the idle NVMe stores (`stores`) and the pooled arenas now
    (`offload.empty_cache()`)."""
    _step.finish_pending()
    _pool.clear()
    if stores:
        _nvme_space.close_idle()


def reset() -> None:
    """Back to a freshly imported offload, as far as nothing in use is touched: tests call it
    between cases that must not see each other's plans, streams or warnings."""
    empty_cache()
    _copies.forget_streams()
    _per_model.clear()
    _schedule_reset()
    _config.forget_warnings()
    _subclasses.forget_warnings()
    _storing.forget_warnings()
    _nvme_space.forget_warnings()
    _host_budget.forget_warnings()
    _step.forget_warnings()


def after_fork_in_child() -> None:
    _hooks.after_fork_in_child()
    _nvme_space.after_fork_in_child()
    _host_budget.after_fork_in_child()
    _pool.after_fork_in_child()
    _heap.HeapSettings.after_fork_in_child()
    _copies.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=after_fork_in_child)
