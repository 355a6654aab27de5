"""Fork safety: a forked child (a DataLoader worker) holds none of our files or arenas.

A child inherits the parent's descriptors and memory. Were it to keep a slab file's
descriptor, a slab the parent closes (after an exception, or `offload.empty_cache()`) would
keep its disk space for as long as the child lives. So, in the child, right after fork:

- every NVMe store is abandoned: its slab descriptors closed, its I/O threads (not forked)
  never touched (tiers/nvme_space.py); a step the child runs opens its own store;
- the stores and arenas pooled for the next step are set aside, never reused or freed there
  (freeing pinned memory would call into CUDA, which a forked child cannot use); arena memory
  itself is not shared with the child at all (MADV_WIPEONFORK / MADV_DONTFORK, csrc/host_arena.cpp);
- glibc's heap settings of a step in progress go back to normal for the child;
- the process's CUDA copy streams (cuda_streams.py Note 13) are forgotten: a child cannot
  use the parent's CUDA state, and one that initializes CUDA itself makes its own.

Registered with `os.register_at_fork` when offload is imported, so forks made through Python
(multiprocessing, DataLoader, os.fork) are covered; slabs are also opened O_CLOEXEC, so an
exec'd program never inherits them.
"""
from __future__ import annotations

import os

from . import cuda_streams
from .tiers import heap, nvme_space, pool

__all__ = ["after_fork_in_child"]


def after_fork_in_child() -> None:
    nvme_space.after_fork_in_child()
    pool.after_fork_in_child()
    heap.HeapSettings.after_fork_in_child()
    cuda_streams.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=after_fork_in_child)
