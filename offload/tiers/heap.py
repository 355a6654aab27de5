"""glibc heap settings while CPU activations stream out to NVMe (and helpers to trim it).

On a CPU-only run the nvme tier frees each activation's RAM as soon as its write lands, and
the next layer allocates about as much again. The cheapest outcome is that glibc hands the
freed chunks straight back to the next allocation: no system call, no page fault. Two glibc
defaults work against that:

- the *dynamic* mmap threshold starts at 128 KiB, so until a large block has been freed every
  tensor above 128 KiB is its own mmap, returned to the OS on free and faulted in (and zeroed
  by the kernel) again on the next allocation;
- automatic trimming: whenever the free chunk at the top of the heap exceeds the trim
  threshold (dynamic: twice the mmap threshold, at most 64 MiB) `free` gives it back to the
  OS, so the forward, which frees a layer's activations and allocates the next layer's, pays
  for those pages over and over.

`HeapSettings` therefore sets, for the duration of an offload step on CPU, the trim threshold
to 2 GiB (no automatic trimming during the step) and the mmap threshold by OFFLOAD_CPU_HEAP:

- `reuse` (default): 32 MiB, glibc's own ceiling for the dynamic value. Freed activations
  stay in the heap and serve the next allocations; peak RSS is the heap's high-water mark,
  the live bytes plus whatever fragmentation the allocation pattern leaves.
- `release`: 1 MiB. Every activation-sized block is its own mapping, returned to the OS the
  moment it is freed: RSS follows the live bytes, and each allocation faults its pages in.

When the last such step ends the trim threshold goes back to 64 MiB, the value glibc's
dynamic rule ends up with (setting either value turns glibc's dynamic adjustment off for the
process, so the mmap threshold keeps the value set).

`reuse` is the default because trimming returns pages that the same step faults in again
(docs/benchmarks.md, *Why the runtime's constants*: page faults, peak RSS and step time of
each mode).

A no-op where glibc is not the allocator (`mallopt` missing).

Huge pages. torch's own `THP_MEM_ALLOC_ENABLE=1` (read once, at torch's first CPU
allocation: set it before Python starts) aligns every CPU allocation to a page and advises
huge pages (madvise) for those of 2 MiB or more. For this tier that means: every activation
starts page-aligned, so it is written in place with at most a partial last sector bounced
(NOTE [Phase] in nvme.py), and both faulting in new activations and pinning them for
O_DIRECT work on 2 MiB pages (faster and lower peak RSS: docs/benchmarks.md). The runtime
cannot switch it on for a process that already imported torch, so
`torch_thp_enabled` only lets it say so once (INFO) when a CPU step starts without it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

__all__ = ["HeapSettings", "trim_heap", "torch_thp_enabled"]

log = logging.getLogger("offload")

# glibc's <malloc.h> parameter numbers.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = {  # per OFFLOAD_CPU_HEAP mode
    "reuse": 32 << 20,    # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
    "release": 1 << 20,   # every activation-sized block is its own mapping
}
STEP_TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # mallopt takes an int: the largest value
AFTER_TRIM_THRESHOLD_BYTES = 64 << 20  # 2 x the mmap threshold, glibc's dynamic rule


def _load_libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim, mallopt = libc.malloc_trim, libc.mallopt
    except (OSError, AttributeError):
        return None, None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return trim, mallopt


_TRIM, _MALLOPT = _load_libc()


def torch_thp_enabled() -> bool:
    """Whether this process started with torch's huge-page CPU allocation (see module doc)."""
    return os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"


class HeapSettings:
    """Process-wide: glibc settings for CPU offload steps, counted across contexts and threads.

    The first holder's mode applies until the last holder lets go.
    """

    _lock = threading.Lock()
    _holders = 0
    _thp_hinted = False
    _generation = 0  # bumped in a forked child (after_fork_in_child)

    def __init__(self, mode: str = "reuse") -> None:
        if mode not in MMAP_THRESHOLD_BYTES:
            raise ValueError(f"HeapSettings: mode must be one of {sorted(MMAP_THRESHOLD_BYTES)}, "
                             f"got {mode!r}")
        self.mode = mode
        self._held = False

    @classmethod
    def active(cls) -> bool:
        """Whether some step holds the settings now."""
        return cls._holders > 0

    def acquire(self) -> None:
        """Apply the step settings (the first holder does); idempotent per instance."""
        if self._held:  # the nvme tier calls this for every CPU tensor it stores
            return
        if not HeapSettings._thp_hinted and not torch_thp_enabled():
            HeapSettings._thp_hinted = True
            log.info("offload: CPU activations to NVMe without THP_MEM_ALLOC_ENABLE=1; set it "
                     "before starting Python for page-aligned, huge-page activations (on the "
                     "dev VM: the step went from 1.05x to 0.97x of no offload, peak RSS from "
                     "1.36 to 1.02 GiB)")
        if _MALLOPT is None:
            return
        with HeapSettings._lock:
            if HeapSettings._holders == 0:
                ok = _MALLOPT(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES[self.mode]) and \
                    _MALLOPT(_M_TRIM_THRESHOLD, STEP_TRIM_THRESHOLD_BYTES)
                if not ok:
                    log.debug("offload: mallopt refused the heap settings; left as they are")
            HeapSettings._holders += 1
            self._held = True
            self._generation = HeapSettings._generation

    @classmethod
    def after_fork_in_child(cls) -> None:
        """A forked child is not in a step: back to glibc's normal trimming (offload/process.py)."""
        cls._lock = threading.Lock()
        if cls._holders > 0 and _MALLOPT is not None:
            _MALLOPT(_M_TRIM_THRESHOLD, AFTER_TRIM_THRESHOLD_BYTES)
        cls._holders = 0
        cls._generation += 1

    def release(self) -> None:
        """Undo `acquire` (the last holder restores the trim threshold); idempotent."""
        if not self._held:
            return
        with HeapSettings._lock:
            self._held = False
            if self._generation != HeapSettings._generation:
                return  # acquired by the parent before a fork; the child's count was reset
            HeapSettings._holders -= 1
            if HeapSettings._holders == 0:
                _MALLOPT(_M_TRIM_THRESHOLD, AFTER_TRIM_THRESHOLD_BYTES)


def trim_heap() -> bool:
    """Call malloc_trim(0) now (freed heap pages go back to the OS, so RSS shows live memory).

    Returns:
        False where glibc's malloc_trim is not available (nothing was done).
    """
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
