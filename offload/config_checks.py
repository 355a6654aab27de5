"""What a Config's values mean on this machine: the cross-checks that look at the file
system and the memory (`validate`, read-only: nothing is created before they pass), and
the tiers' capacities in bytes (a percentage of the memory or the disk, shared among the
processes of this host).

Config's methods of the same names are these functions (`config` below is the Config;
config.py: what the settings are and where they come from; here: what they come to).
Nothing here imports config.py, so the two make no circle.
"""
from __future__ import annotations

import os
from typing import Callable

from .config_parse import knob, unset, warn_once as _warn_once
from .errors import ConfigError
from .tiers import nvme_space
from .util.disk_space import RAM_FS_TYPES, StripedRoom, fs_type, striped_room
from .util.memory_limits import available_memory, memory_floor_bytes
from .util.ranks import agreed_total
from .util.sizes import SizeSpec, format_bytes

__all__ = ["validate", "check_nvme_dirs", "host_capacity", "nvme_capacity_bytes",
           "nvme_capacity_source", "DROP_NVME", "forget_warnings"]

DROP_NVME = "drop 'nvme' from the tiers"   # validate()'s default: the runtime's own fix


def forget_warnings() -> None:
    """Say the once-per-process warnings again (offload.process.reset, via config.py; the
    warnings themselves are config_parse.warn_once's)."""
    global _host_seen
    _fs_types.clear()
    _host_seen = None


# The kernel's own file systems: no file can be made in them, whatever the permission bits
# say (root passes os.access there).
VIRTUAL_FS_TYPES = frozenset({"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs",
                              "securityfs", "configfs", "devpts", "bpf", "pstore", "efivarfs"})

# Directory -> its file system type, read once: /proc/self/mountinfo costs ~90 us with 20
# mounts, and a context is often built every step.
_fs_types: dict[str, str | None] = {}


def _fs_type_of(path: str) -> str | None:
    real = os.path.realpath(path)
    if real not in _fs_types:
        _fs_types[real] = fs_type(real)
    return _fs_types[real]


# (config, the MemoryLimit it read, its host capacity): the last answer of `host_capacity`.
_host_seen: tuple | None = None


def validate(config, *, nvme_dir_alternative: str | None = DROP_NVME) -> None:
    """Cross-checks that need more than one knob or a look at the file system.

    Read-only: stats the NVMe directories but creates nothing.

    Args:
        nvme_dir_alternative: what a message about an unusable NVMe directory offers
            besides pointing it elsewhere (the runtime's: drop 'nvme' from the tiers;
            a CLI says its own, None offers nothing else).

    Raises:
        ConfigError: naming the variable, the value and what to do.
    """
    if not config.enabled:
        return  # turned off: nothing else may stop the run (OFFLOAD_ENABLED)
    if "nvme" in config.tiers and config.policy != "keep":
        check_nvme_dirs(config, nvme_dir_alternative)
        _validate_nvme_size(config)
    if config.trace is not None:
        _validate_trace(config)
    if config.budget is not None and config.policy != "auto":
        _warn_once(f"budget_unused_{config.policy}",
                   f"offload: {config.where('budget')} applies to policy='auto' only; under "
                   f"{config.where('policy')} it is not used")
    _validate_host_sizes(config)
    if "nvme" in config.tiers and config.prefetch_bytes > config.staging_bytes:
        _warn_once("prefetch_over_staging",
                   f"offload: {config.where('prefetch_bytes')} is more than "
                   f"{config.where('staging_bytes')}: read-ahead beyond the staging arena "
                   "lands in buffers allocated per read (more allocations and RSS); lower "
                   "the first or raise the second")


def _validate_host_sizes(config) -> None:
    if max(config.staging_bytes, config.prefetch_bytes) <= memory_floor_bytes():
        return  # below any limit this process has: no need to look now
    limit = available_memory()
    for name, what in (("staging_bytes", "the staging arena"),
                       ("prefetch_bytes", "what is read ahead")):
        value = getattr(config, name)
        if value > limit.total_bytes:
            where = "this machine's RAM" if limit.source == "RAM available" \
                else f"this process's memory limit ({limit.source})"
            raise ConfigError(
                f"{config.where(name)}: more than {where} ({format_bytes(limit.total_bytes)}); "
                f"{what} lives in host memory (give a size such as \"256MiB\")")


def _validate_trace(config) -> None:
    where = config.where("trace")
    directory = os.path.dirname(os.path.abspath(config.trace))
    fix = f"point it at a file in an existing, writable directory, or {unset(where, 'trace')}"
    if os.path.isdir(config.trace):
        raise ConfigError(f"{where}: {config.trace!r} is a directory ({fix})")
    if not os.path.isdir(directory):
        raise ConfigError(f"{where}: directory {directory!r} does not exist ({fix})")
    kind = _fs_type_of(directory)
    if kind in VIRTUAL_FS_TYPES:   # (root passes the access check there)
        raise ConfigError(f"{where}: directory {directory!r} is on {kind}, a virtual file "
                          f"system where no file can be made ({fix})")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: directory {directory!r} is not writable by this "
                          f"process ({fix})")


def check_nvme_dirs(config, alternative: str | None = DROP_NVME) -> None:
    """The NVMe directories' checks of `validate` (they exist, are writable, on a disk),
    whatever the policy; `alternative` as validate()'s `nvme_dir_alternative`."""
    tiers = config.where("tiers")
    if alternative is DROP_NVME:
        alternative = f"drop 'nvme' from {knob(tiers, 'tiers')}"
    if not config.nvme_dir:
        unset, fix = ("OFFLOAD_NVME_DIR is not set", "set OFFLOAD_NVME_DIR to") \
            if tiers.startswith("OFFLOAD_") else \
            ("nvme_dir= is not given (nor OFFLOAD_NVME_DIR set)", "pass nvme_dir=")
        raise ConfigError(
            f"{unset} but {tiers} includes 'nvme' ({fix} a writable directory on a "
            f"local SSD, or drop 'nvme' from {knob(tiers, 'tiers')})")
    where = config.where("nvme_dir")
    for path in config.nvme_dir:
        fix = "point it at a writable directory on a local SSD" + \
            (f", or {alternative}" if alternative else "")
        if not os.path.exists(path):
            raise ConfigError(f"{where}: {path!r} does not exist ({fix})")
        if not os.path.isdir(path):
            raise ConfigError(f"{where}: {path!r} is not a directory ({fix})")
        fs = os.statvfs(path)
        if fs.f_blocks == 0:   # its free space cannot be known; ramfs is RAM besides
            raise ConfigError(
                f"{where}: {path!r} is on a file system that reports no size (ramfs, "
                "which keeps files in RAM, or a virtual one such as /proc or /sys); the "
                f"nvme tier needs a disk-backed directory ({fix})")
        if fs.f_flag & os.ST_RDONLY:
            raise ConfigError(f"{where}: {path!r} is on a read-only file system ({fix})")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{where}: {path!r} is not writable by this process ({fix})")
        kind = _fs_type_of(path)
        if kind in RAM_FS_TYPES:   # ramfs reports no size: refused above
            _warn_once(f"nvme_dir_in_ram:{os.path.realpath(path)}",
                       f"offload: {where}: {path!r} is on {kind}, whose files are RAM: "
                       f"the nvme tier reserves its capacity ({config.nvme_bytes}) there "
                       "in host memory, and nothing it writes leaves RAM (fine for a "
                       "test; for training point it at a directory on a local SSD)")


# -------------------------------------------------------------------- capacities
def host_capacity(config) -> tuple[int, str]:
    """Capacity of the host tier in bytes, and what it was taken of: a percentage is of
    the memory this process may use now (the RAM available, or less in a memory cgroup:
    memory_limits NOTE [Memory limits]), divided among the processes of this host
    (NOTE [Host share] in ranks.py)."""
    global _host_seen
    if config.host_bytes.fraction is None:
        return config.host_bytes.nbytes, "OFFLOAD_HOST_BYTES"
    limit = available_memory()   # the same object while its reading stands
    seen = _host_seen
    if seen is not None and seen[0] is config and seen[1] is limit:
        return seen[2]   # asked every step: worked out once per reading
    capacity = (_resolve_share(config, config.host_bytes, lambda: limit.available_bytes, "ram"),
                f"{config.host_bytes} of {limit.source}")
    _host_seen = (config, limit, capacity)
    return capacity


def nvme_capacity_bytes(config) -> int:
    """Capacity of the nvme tier in bytes, checked against the free space as the store
    stripes it (NOTE [Striped room] in util/disk_space.py: an equal share in each
    directory); a percentage is of what fits now, divided among the processes of this
    host.

    Raises:
        ConfigError: an absolute size whose share does not fit in some directory.
    """
    room = striped_room(config.nvme_dir)   # once: the share and the check read the same
    capacity = _resolve_share(config, config.nvme_bytes, lambda: room.capacity_bytes, room.key)
    _check_nvme_fits(config, capacity, room)
    return capacity


def nvme_capacity_source(config) -> str:
    """What `nvme_capacity_bytes` is taken of, in words (Stats' capacity_source)."""
    if config.nvme_bytes.fraction is None:
        return "OFFLOAD_NVME_BYTES"
    return f"{config.nvme_bytes} of the free space in {', '.join(config.nvme_dir)}"


def _validate_nvme_size(config) -> None:
    """An absolute OFFLOAD_NVME_BYTES must fit now; slabs of this process's own that
    opening the store gives back first count as free (nvme_space.slabs_given_back)."""
    if config.nvme_bytes.fraction is not None:
        return  # a percentage is of what fits when the store opens
    smallest = nvme_space.smallest_store_bytes(len(config.nvme_dir))
    if config.nvme_bytes.nbytes < smallest:
        raise ConfigError(
            f"{config.where('nvme_bytes')}: is under the nvme tier's smallest store, "
            f"{format_bytes(smallest)} (1 MiB per directory; give a size such as "
            "'64GiB' or a percentage such as '50%')")
    held = nvme_space.slabs_given_back(config.nvme_dir)
    _check_nvme_fits(config, config.nvme_bytes.nbytes, striped_room(config.nvme_dir, held))


def _check_nvme_fits(config, capacity: int, room: StripedRoom) -> None:
    short = room.short_for(capacity)
    if short is None:
        return
    where = config.where("nvme_bytes")
    ranks = config.ranks.local_world_size
    fix = (f"each of the {ranks} processes of this host takes this size: lower it, or "
           "give a percentage, which is divided among them" if ranks > 1 else
           "lower it, or give a percentage such as '50%'")
    free = format_bytes(short.free_bytes)
    if len(room.file_systems) == 1:
        raise ConfigError(f"{where}: only {free} free in {', '.join(config.nvme_dir)} ({fix})")
    # Striped over file systems of unequal room: name the one that is short.
    raise ConfigError(
        f"{where}: only {free} free in {' and '.join(map(repr, short.dirs))}, whose share "
        f"would be {format_bytes(room.share_bytes(short, capacity))}: the store puts an "
        f"equal share in each of the {room.n_dirs} directories of "
        f"{config.where('nvme_dir')}, so at most {format_bytes(room.capacity_bytes)} fits "
        f"({fix}; or free space there, or leave that directory out)")


def _resolve_share(config, spec: SizeSpec, measure: Callable[[], int],
                   what: str) -> int:
    """Bytes of `spec` for this process; a percentage of the host-wide total `measure`
    returns is divided among the local ranks (ranks.py NOTE [Host share])."""
    if spec.fraction is None:
        return spec.nbytes  # a size is per process, as given
    if config.ranks.local_size_unknown:
        _warn_once("local_size_unknown",
                   "offload: LOCAL_RANK is set but LOCAL_WORLD_SIZE is not, so percentage "
                   "capacities (OFFLOAD_HOST_BYTES, OFFLOAD_NVME_BYTES) are not divided "
                   "among the processes of this host; every process takes the whole "
                   "percentage (set LOCAL_WORLD_SIZE, launch with torchrun, or give sizes "
                   "per process such as '8GiB')")
    if config.ranks.local_world_size == 1:
        return spec.resolve(measure())
    now = measure()
    share = config.ranks.local_share(spec.resolve(agreed_total(what, lambda: now)))
    # The agreed total is from the job's first measurement: never take more than the
    # percentage of what is there now (the disk may have filled up since).
    return min(share, spec.resolve(now))
