"""Free space of the nvme tier's directories, as the striped store can use it.

NOTE [Striped room] The NVMe store gives each of its n directories an equal slab of
capacity / n bytes (csrc/nvme_store.cpp; tiers/nvme_space.py first rounds the capacity down
to whole stripes). A file system holding k of the directories must so find k * capacity / n
bytes, and the most the directories can hold together is the least, over their file
systems, of free * n / k: the file system with the least free space per slab sets it. The
sum of the free space overshoots as soon as the file systems differ (the small one runs out:
ENOSPC when the store opens). A percentage of OFFLOAD_NVME_BYTES is of this figure, so it
always fits; an absolute size is checked against every file system's part of it.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from typing import Iterable

from ..errors import StorageError

__all__ = ["FileSystemRoom", "StripedRoom", "striped_room", "RAM_FS_TYPES", "fs_type"]


@dataclass(frozen=True)
class FileSystemRoom:
    """One file system under the store: the directories on it and the bytes they may take."""

    device: int             # st_dev
    dirs: tuple[str, ...]   # the store's directories on it, in the order given
    free_bytes: int         # free now, plus what this process would give back first


@dataclass(frozen=True)
class StripedRoom:
    """What a store striped evenly over `n_dirs` directories can reserve (NOTE [Striped room])."""

    file_systems: tuple[FileSystemRoom, ...]
    n_dirs: int

    def limit_bytes(self, fs: FileSystemRoom) -> int:
        """The largest capacity whose slabs on `fs` fit in its free space."""
        return fs.free_bytes * self.n_dirs // len(fs.dirs)

    def share_bytes(self, fs: FileSystemRoom, capacity_bytes: int) -> int:
        """Bytes a store of `capacity_bytes` puts on `fs`."""
        return capacity_bytes * len(fs.dirs) // self.n_dirs

    @property
    def capacity_bytes(self) -> int:
        """The largest capacity that fits on every file system."""
        return min(self.limit_bytes(fs) for fs in self.file_systems)

    def short_for(self, capacity_bytes: int) -> FileSystemRoom | None:
        """The file system with the least room per slab, if `capacity_bytes` does not fit."""
        tightest = min(self.file_systems, key=self.limit_bytes)
        return tightest if capacity_bytes > self.limit_bytes(tightest) else None

    @property
    def key(self) -> str:
        """Names the layout, so ranks agree on a total only for the same one (ranks.py)."""
        return "disk-" + ",".join(f"{fs.device}x{len(fs.dirs)}" for fs in
                                  sorted(self.file_systems, key=lambda fs: fs.device))


def striped_room(dirs: Iterable[str], held: Iterable[tuple[str, int]] = ()) -> StripedRoom:
    """Read the free space of the file systems holding `dirs` (one statvfs each).

    Args:
        dirs: The store's directories; several on one file system are counted together.
        held: (directory, bytes) of slabs this process holds that would be given back before
            a store of `dirs` reserves its own (tiers/nvme_space.py), counted as free.
    """
    dirs = tuple(dirs)
    found: dict[int, tuple[list[str], int]] = {}
    for path in dirs:
        try:
            device, free = _read_free(path)
        except OSError as exc:   # gone since the settings were checked (removed, unmounted)
            raise StorageError(exc.errno or 0, "the NVMe directory cannot be read now "
                               f"({exc.strerror}); make it a directory this process can "
                               "read again, or point OFFLOAD_NVME_DIR / nvme_dir= at one",
                               path) from exc
        found.setdefault(device, ([], free))[0].append(path)
    back: dict[int, int] = {}
    for path, nbytes in held:
        try:
            device = os.stat(path).st_dev
        except OSError:   # its directory is gone: where its slab is cannot be told
            continue
        back[device] = back.get(device, 0) + nbytes
    rooms = tuple(FileSystemRoom(device, tuple(paths), free + back.get(device, 0))
                  for device, (paths, free) in found.items())
    return StripedRoom(rooms, len(dirs))


def _read_free(path: str) -> tuple[int, int]:
    """(st_dev, free bytes) of the file system holding `path` (tests replace it)."""
    return os.stat(path).st_dev, shutil.disk_usage(path).free


# File systems whose files are RAM: what the nvme tier writes there stays in host memory
# (shmem), whatever O_DIRECT does (tmpfs accepts O_DIRECT since Linux 6.6), and RSS does not
# count it.
RAM_FS_TYPES = frozenset({"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"})   # (/dev is devtmpfs)


_OCTAL_ESCAPE = re.compile(rb"\\([0-7]{3})")


def fs_type(path: str) -> str | None:
    """The file system type of the mount holding `path` (Linux; None when unknown)."""
    try:
        with open("/proc/self/mountinfo", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    target = os.fsencode(os.path.realpath(path))
    best, best_len = None, -1
    for line in lines:
        left, sep, right = line.partition(b" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        # Mount points escape blanks, newlines and backslashes as octal (\040); the rest
        # is the path's own bytes, compared as bytes (a name need not be UTF-8).
        point = _OCTAL_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), fields[4])
        inside = target == point or target.startswith(point.rstrip(b"/") + b"/")
        if inside and len(point) >= best_len:  # the last of equal mounts is the visible one
            best, best_len = right.split()[0], len(point)
    return os.fsdecode(best) if best is not None else None
