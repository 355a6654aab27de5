"""How much host memory this process may still use: the RAM available, or less in a cgroup.

NOTE [Memory limits] Kubernetes, Slurm and Docker run jobs in a memory cgroup. Inside one,
`psutil.virtual_memory()` still reports the host's RAM, and pinning memory past the cgroup's
limit ends in an OOM kill instead of a spill to the next tier. So a percentage of host
memory (OFFLOAD_HOST_BYTES="50%") is a share of the smaller of

* the RAM available (`psutil.virtual_memory().available`), and
* for the process's memory cgroup and each of its ancestors that has a limit: the limit
  minus what the cgroup uses, not counting inactive file cache (the kernel reclaims that
  before it kills; Docker's "available" is computed the same way).

Both cgroup versions are read: v2 (`memory.max`, `memory.current`, `memory.stat`
inactive_file) and v1 (`memory.limit_in_bytes`, `memory.usage_in_bytes`, `memory.stat`
total_inactive_file). The process's cgroup comes from /proc/self/cgroup and where its
controller is mounted from /proc/self/mountinfo (in a container with a cgroup namespace the
path is "/" and the mount is the container's own cgroup). Anything unreadable counts as no
limit: the RAM figure then applies, as before.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from .sizes import format_bytes

__all__ = ["MemoryLimit", "available_memory", "memory_total_bytes", "memory_floor_bytes"]

# A v1 limit at or above this is "unlimited" (the kernel writes PAGE_COUNTER_MAX pages).
_V1_UNLIMITED = 1 << 62


@dataclass(frozen=True)
class MemoryLimit:
    """What this process may still use, and which figure decided it."""

    available_bytes: int
    total_bytes: int   # the limit itself (or the machine's RAM): a ceiling for settings
    source: str        # "RAM available" or "cgroup v2 /job (limit 2 GiB, 1.1 GiB in use)"


@dataclass(frozen=True)
class _Cgroup:
    version: int
    directory: str     # the process's cgroup directory in the mounted hierarchy
    mount_point: str
    path: str          # as /proc/self/cgroup names it


def available_memory(proc: str = "/proc") -> MemoryLimit:
    """The RAM available to this process now (NOTE [Memory limits])."""
    cgroups = _limited_cgroups(proc)
    ram = _ram(proc)
    if not cgroups:   # the RAM reading alone: one object per reading (made every step)
        seen = _ram_limits.get(proc)
        if seen is None or seen[0] is not ram:
            seen = _ram_limits[proc] = (ram, MemoryLimit(ram[0], ram[1], "RAM available"))
        return seen[1]
    best = MemoryLimit(ram[0], ram[1], "RAM available")
    for version, directory, shown in cgroups:
        room = _room(version, directory)
        if room is not None and room[0] < best.available_bytes:
            limit, usage = room[1], room[2]
            best = MemoryLimit(room[0], limit,
                               f"cgroup v{version} {shown} (limit {format_bytes(limit)}, "
                               f"{format_bytes(usage)} in use)")
    return best


_RAM_FRESH_S = 0.1  # a reading this recent stands (a context is entered every step)
_ram_seen: dict[str, tuple[float, tuple[int, int]]] = {}
_ram_limits: dict[str, tuple[tuple[int, int], MemoryLimit]] = {}  # proc -> (reading, its limit)


def _ram(proc: str) -> tuple[int, int]:
    """(available, total) RAM: MemAvailable / MemTotal of meminfo (psutil's figures; read
    directly, as a context is made every step and psutil parses every line)."""
    now = time.monotonic()
    seen = _ram_seen.get(proc)
    if seen is not None and now - seen[0] < _RAM_FRESH_S:
        return seen[1]
    value = _read_ram(proc)
    _ram_seen[proc] = (now, value)
    return value


def _read_ram(proc: str) -> tuple[int, int]:
    text = _read(os.path.join(proc, "meminfo"))
    if text:
        values = {}
        for line in text.splitlines():
            name, _, rest = line.partition(":")
            if name in ("MemAvailable", "MemTotal"):
                values[name] = int(rest.split()[0]) * 1024
                if len(values) == 2:
                    return values["MemAvailable"], values["MemTotal"]
    import psutil

    vm = psutil.virtual_memory()
    return vm.available, vm.total


# (pid, proc root) -> the cgroups (and ancestors) that had a memory limit when looked up:
# where they are is read once per process (a context is made every step; the hierarchy does
# not move under a running job), what they hold at every call.
_found: dict[tuple[int, str], list[tuple[int, str, str]]] = {}


def _limited_cgroups(proc: str) -> list[tuple[int, str, str]]:
    key = (os.getpid(), proc)   # a forked child looks again (it may be moved elsewhere)
    found = _found.get(key)
    if found is None:
        found = []
        for group in _memory_cgroups(proc):
            for directory in _ancestors(group.directory, group.mount_point):
                if _room(group.version, directory) is None:
                    continue
                rel = os.path.relpath(directory, group.mount_point)
                shown = group.path if directory == group.directory \
                    else "/" + ("" if rel == "." else rel)
                found.append((group.version, directory, shown))
        _found[key] = found
    return found


def memory_total_bytes(proc: str = "/proc") -> int:
    """The most memory this process could ever use: RAM, or a smaller cgroup limit."""
    return available_memory(proc).total_bytes


_floor: dict[tuple[int, str], int] = {}


def memory_floor_bytes(proc: str = "/proc") -> int:
    """A size below every limit this process had when first asked (cached per process): a
    setting under it needs no look at the limits (config validation, every step)."""
    key = (os.getpid(), proc)
    floor = _floor.get(key)
    if floor is None:
        floor = _floor[key] = memory_total_bytes(proc) // 2
    return floor


def _room(version: int, directory: str) -> tuple[int, int, int] | None:
    """(limit - usage + inactive file cache, limit, usage) of one cgroup, None if no limit."""
    if version == 2:
        limit_text = _read(os.path.join(directory, "memory.max"))
        usage_text = _read(os.path.join(directory, "memory.current"))
        cache_key = "inactive_file"
    else:
        limit_text = _read(os.path.join(directory, "memory.limit_in_bytes"))
        usage_text = _read(os.path.join(directory, "memory.usage_in_bytes"))
        cache_key = "total_inactive_file"
    if limit_text is None or usage_text is None or limit_text == "max":
        return None
    try:
        limit, usage = int(limit_text), int(usage_text)
    except ValueError:
        return None
    if version == 1 and limit >= _V1_UNLIMITED:
        return None
    cache = _stat(os.path.join(directory, "memory.stat"), cache_key)
    return max(0, limit - max(0, usage - cache)), limit, usage


def _memory_cgroups(proc: str) -> list[_Cgroup]:
    """The process's memory cgroup in each mounted hierarchy that has the controller."""
    paths: dict[int, str] = {}
    text = _read(os.path.join(proc, "self", "cgroup"))
    for line in (text or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            paths.setdefault(2, parts[2])
        elif "memory" in parts[1].split(","):
            paths[1] = parts[2]
    groups = []
    for version, root, mount_point in _mounts(proc):
        path = paths.get(version)
        if path is None:
            continue
        rel = path[len(root):] if root != "/" and path.startswith(root) else path
        directory = os.path.normpath(mount_point + "/" + rel.lstrip("/"))
        if not os.path.isdir(directory):  # a namespaced view: the mount is our own cgroup
            directory = mount_point
        if version == 2 and not os.path.exists(os.path.join(directory, "memory.max")) \
                and directory == mount_point and not _has_memory_controller(mount_point):
            continue
        groups.append(_Cgroup(version, directory, mount_point, path))
    return groups


def _mounts(proc: str) -> list[tuple[int, str, str]]:
    """(cgroup version, mount root, mount point) of every cgroup mount with memory."""
    found = []
    for line in (_read(os.path.join(proc, "self", "mountinfo")) or "").splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, mount_point, fstype, options = fields[3], fields[4], tail[0], tail[2]
        if fstype == "cgroup2":
            found.append((2, root, mount_point))
        elif fstype == "cgroup" and "memory" in options.split(","):
            found.append((1, root, mount_point))
    return found


def _has_memory_controller(mount_point: str) -> bool:
    controllers = _read(os.path.join(mount_point, "cgroup.controllers")) or ""
    return "memory" in controllers.split()


def _ancestors(directory: str, mount_point: str) -> list[str]:
    """`directory` and its parents up to and including the mount point."""
    out = [directory]
    while directory != mount_point and directory.startswith(mount_point.rstrip("/") + "/"):
        directory = os.path.dirname(directory)
        out.append(directory)
    return out


def _read(path: str) -> str | None:
    try:   # (mountinfo holds mount points as their bytes, which need not be UTF-8)
        with open(path, errors="surrogateescape") as f:
            return f.read().strip()
    except OSError:
        return None


def _stat(path: str, key: str) -> int:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0
