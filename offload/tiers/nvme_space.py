"""One NVMe budget per directory set for the whole process, shared by every context.

NOTE [One budget] `OFFLOAD_NVME_BYTES` bounds what this process keeps in its NVMe
directories, not what each context reserves. Every `NvmeTier` of the same directories uses
the one `NvmeStore` (its slab files, range allocator and I/O threads) kept here: a second
context alive at the same time (a training loop that keeps each step's graph, two
interleaved micro-batches) shares the space instead of reserving another 50 % of whatever
is left, and when the shared budget is full the tiers spill / keep / raise `TierFullError`
as `OFFLOAD_STRICT` says, like any full tier.

The store outlives its users (opening one reserves the slabs with fallocate: costly), so
the next step finds it. An idle store never blocks a new context: a context with other
settings (capacity, I/O workers) closes an idle store and opens its own, and capacities
given as a percentage are resolved after that, so our own idle reservation is not mistaken
for someone else's use of the disk. While a store is in use its settings stand; a context
that asks for others shares it and says so once (a warning naming the settings), except
that a store without checksums is never shared with a context that asks for them: that
context's NVMe reads would go unchecked, so it raises ConfigError instead. At most the idle
stores of the directories last used stay open: opening any new store closes every idle one
first.

`close_idle()` closes the stores no context uses (offload.empty_cache(), and after an
exception). In a forked child every inherited store is abandoned (see `after_fork_in_child`).
"""
from __future__ import annotations

import atexit
import errno
import logging
import os
import threading
from typing import Any, Callable, Hashable

__all__ = ["acquire", "acquire_sized", "release", "close_idle", "open_stores", "slabs_given_back",
           "after_fork_in_child", "CHUNK_BYTES", "MIN_STORE_BYTES"]

log = logging.getLogger("offload")

# Engine chunk (and stripe) size. Every chunk that completes wakes an I/O thread, which on a
# machine with few cores preempts a compute thread: fewer, larger chunks (no loss of disk
# throughput; docs/benchmarks.md, *Why the runtime's constants*).
CHUNK_BYTES = 4 << 20

# A store smaller than one 1 MiB stripe per directory is not worth reserving: the tier
# then has no room (full from the start), instead of failing to open.
MIN_STORE_BYTES = 1 << 20
SMALL_CHUNK_BYTES = 1 << 20   # the chunk of a store too small for CHUNK_BYTES ones


class _Entry:
    __slots__ = ("store", "settings", "users", "source")

    def __init__(self, store: Any, settings: Hashable, source: str) -> None:
        self.store = store
        self.settings = settings
        self.users = 1
        self.source = source    # what its capacity was taken of (Stats' capacity_source)


_lock = threading.Lock()          # guards _entries
_open_lock = threading.Lock()     # one store opened at a time (it stats and reserves the disk)
_entries: dict[tuple[str, ...], _Entry] = {}


def acquire(dirs: tuple[str, ...], settings: tuple[tuple[str, Hashable], ...],
            open_store: Callable[[], Any], source: str = "") -> Any:
    """The process's store for `dirs`, opened with `open_store()` if there is none.

    Args:
        dirs: The directories (the store stripes over them), as configured.
        settings: What `open_store` depends on besides `dirs`, as (setting's name, value)
            pairs; an idle store made with other settings is closed and replaced.
        open_store: Makes the store; called without the registry lock, may raise.
        source: What a new store's capacity is taken of (`capacity_source`).

    Raises:
        ConfigError: the store is in use without checksums and `settings` ask for them.
    """
    with _open_lock:
        with _lock:
            entry = _entries.get(dirs)
            if entry is not None and (entry.users > 0 or entry.settings == settings):
                if entry.settings != settings:
                    _share(dirs, entry, settings)
                entry.users += 1
                return entry.store
            # A new store: first close every idle one (of these directories with other
            # settings, or of others that may share the file system), so that no idle
            # reservation counts against the free space the new one is sized from.
            stale = [d for d, e in _entries.items() if e.users == 0]
            stale = [_entries.pop(d).store for d in stale]
        for store in stale:
            store.close()  # idle: no I/O in flight, nothing of it is referenced
        store = open_store()
        with _lock:
            _entries[dirs] = _Entry(store, settings, source)
        return store


CHECKSUM = "OFFLOAD_NVME_CHECKSUM"


def _share(dirs: tuple[str, ...], entry: _Entry, asked: tuple) -> None:
    """A context asks for other settings than the store in use has: it shares the store,
    and is told once per process which of its settings wait (they apply once no context
    uses it); but checksums asked for are never dropped (its reads would go unchecked,
    silently)."""
    in_use, wanted = dict(entry.settings), dict(asked)
    if wanted.get(CHECKSUM) and not in_use.get(CHECKSUM):
        from ..errors import ConfigError

        raise ConfigError(
            f"nvme_checksum / {CHECKSUM} asks for checksums, but the NVMe store of "
            f"{', '.join(dirs)} is in use by another context "
            "of this process, opened without checksums, and a store's checksums are set "
            "when it opens (give every context of the process the same nvme_checksum, or "
            "let the other context's graph go first)")
    told = (dirs, entry.settings, asked)
    if told in _said_shared:   # once per process: two contexts alternating every step
        return                 # would say it at every step
    _said_shared.add(told)
    differ = ", ".join(f"{name}={_shown(in_use.get(name))} (yours: {_shown(value)})"
                       for name, value in asked if in_use.get(name) != value)
    log.warning("offload: the NVMe store of %s is in use by another context of this process; "
                "this context shares it with that one's settings: %s. Yours apply once no "
                "context uses it (give every context of a process the same NVMe settings)",
                ", ".join(dirs), differ)


def _shown(value: Any) -> str:
    """A setting's value as its variable would be written."""
    if value is None:
        return "unset"
    return str(int(value)) if isinstance(value, bool) else str(value)


def capacity_source(dirs: tuple[str, ...]) -> str:
    """What the capacity of the process's store for `dirs` was taken of ("" if none)."""
    with _lock:
        entry = _entries.get(dirs)
        return entry.source if entry is not None else ""


class _NoRoom(Exception):
    """The resolved capacity is below MIN_STORE_BYTES."""


def smallest_store_bytes(n_dirs: int) -> int:
    """The least capacity a store over `n_dirs` directories opens with: a whole small
    chunk (1 MiB) per directory, and MIN_STORE_BYTES in all (`acquire_sized`)."""
    return max(MIN_STORE_BYTES, SMALL_CHUNK_BYTES * n_dirs)


def acquire_sized(dirs: tuple[str, ...], capacity_bytes: Callable[[], int], core, *,
                  workers: int, checksum: bool, max_bytes_per_s: int,
                  capacity_key: Hashable, source: str = "") -> Any | None:
    """`acquire` with the engine's store for an NvmeTier: slabs of whole chunks per
    directory, `capacity_bytes()` resolved only when a new store is made (it stats the
    disk). None, with a warning, when that leaves less than MIN_STORE_BYTES: the tier then
    has no room (its tensors spill, stay or raise TierFullError as OFFLOAD_STRICT says).

    `capacity_key` (what the capacity came from: the OFFLOAD_NVME_BYTES spec), `workers`,
    `checksum` and `max_bytes_per_s` decide whether an idle store fits.
    """
    room: list[int] = []
    # A percentage is of the free space when measured; another process (another rank's
    # store, any writer) may take some before the reservation lands: measured again once.
    remeasure = getattr(capacity_key, "fraction", None) is not None

    def open_store():
        for attempt in (1, 2):
            capacity = capacity_bytes()
            # The slabs are whole chunks per directory (a small store keeps 1 MiB chunks).
            # Round down, never up: N ranks each reserving a chunk more than their share
            # would overrun the host's share between them (ranks.py NOTE [Host share]).
            chunk = CHUNK_BYTES if capacity >= 64 * CHUNK_BYTES * len(dirs) else \
                SMALL_CHUNK_BYTES
            capacity -= capacity % (chunk * len(dirs))
            if capacity < smallest_store_bytes(len(dirs)):
                room.append(capacity)
                raise _NoRoom
            try:
                return core.NvmeStore(list(dirs), capacity, workers=workers, chunk_bytes=chunk,
                                      checksum=checksum, throttle_bytes_per_s=max_bytes_per_s)
            except OSError as exc:
                if exc.errno != errno.ENOSPC or not remeasure or attempt == 2:
                    raise
                log.info("offload: the free space in %s shrank before the nvme tier's "
                         "reservation (%s); measuring it again", ", ".join(dirs), exc)

    try:
        settings = (("OFFLOAD_NVME_BYTES", capacity_key), ("OFFLOAD_IO_WORKERS", workers),
                    (CHECKSUM, checksum), ("OFFLOAD_NVME_MAX_BW", max_bytes_per_s))
        return acquire(dirs, settings, open_store, source)
    except _NoRoom:
        from ..util.sizes import format_bytes

        if dirs in _said_no_room:   # every step would say it again
            return None
        _said_no_room.add(dirs)
        log.warning("offload: the nvme tier has no room in %s (room for %s, OFFLOAD_NVME_BYTES "
                    "or the free disk space if less, under the %s minimum); activations that "
                    "would go there spill to the next tier or stay where they are (raise "
                    "OFFLOAD_NVME_BYTES, free disk space, or drop 'nvme' from OFFLOAD_TIERS)",
                    ", ".join(dirs),
                    format_bytes(room[0]) if room else "?", format_bytes(MIN_STORE_BYTES))
        return None


# Directory sets whose "no room" was said, and (directories, settings in use, settings
# asked) whose sharing was (once per process; offload.process.reset forgets).
_said_no_room: set[tuple[str, ...]] = set()
_said_shared: set[tuple] = set()


def forget_warnings() -> None:
    """Say "no room" and "in use by another context" again (offload.process.reset)."""
    _said_no_room.clear()
    _said_shared.clear()


def release(dirs: tuple[str, ...], store: Any, keep: bool) -> None:
    """One user is done with `store`. The last one closes it unless `keep` and it is empty."""
    with _lock:
        entry = _entries.get(dirs)
        if entry is None or entry.store is not store:  # abandoned after a fork, or closed
            return
        entry.users -= 1
        if entry.users > 0:
            return
        if keep and store.used_bytes == 0:
            return
        del _entries[dirs]
    store.close()


def close_idle() -> int:
    """Close every store no context uses; returns how many were closed."""
    with _lock:
        idle = [d for d, e in _entries.items() if e.users == 0]
        stores = [_entries.pop(d).store for d in idle]
    for store in stores:
        store.close()
    return len(stores)


def open_stores() -> dict[tuple[str, ...], tuple[Any, int]]:
    """Directories → (store, users) for every store open now (tests, diagnostics)."""
    with _lock:
        return {d: (e.store, e.users) for d, e in _entries.items()}


def slabs_given_back(dirs: tuple[str, ...]) -> list[tuple[str, int]]:
    """(directory, bytes) of each slab this process holds that a store of `dirs` would not
    count against the free space: `acquire` closes every idle store before it opens one, and
    a store of `dirs` in use is shared, not opened again. A store of other directories in
    use keeps its slabs."""
    dirs = tuple(os.path.realpath(d) for d in dirs)   # the registry's keys (NvmeTier)
    with _lock:
        stores = [e.store for d, e in _entries.items() if e.users == 0 or d == dirs]
    held = []
    for store in stores:
        paths = list(store.paths)
        held += [(path, store.capacity_bytes // len(paths)) for path in paths]
    return held


def after_fork_in_child() -> None:
    """In a forked child: let go of every inherited store without touching its I/O threads
    (they were not forked) and close its slab descriptors, so the parent closing a slab
    frees its disk space even while the child lives; a step in the child opens its own."""
    global _lock, _open_lock
    # A lock held by another parent thread at fork time stays locked in the child forever.
    _lock, _open_lock = threading.Lock(), threading.Lock()
    entries = list(_entries.values())
    _entries.clear()
    for entry in entries:
        entry.store._abandon_after_fork()


atexit.register(close_idle)
