"""Mount throwaway filesystems for tests (root only); skip with the reason when refused."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile

import pytest

MiB = 1 << 20


def free_bytes(path: str) -> int:
    """Free space of the file system holding `path`, as an unprivileged process sees it."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def mounted(fstype: str, options: str = "", size_bytes: int = 16 * MiB, name: str = "mnt"):
    """Mount a fresh filesystem on a temporary directory (called `name`); skip when
    mounting is refused.

    tmpfs / ramfs mount directly; "ext4" / "ext2" are built in an image file and mounted
    through a loop device. Always unmounts and removes what it created.
    """
    if os.geteuid() != 0:
        pytest.skip(f"mounting {fstype} needs root")
    work = tempfile.mkdtemp(prefix="offload-mnt-", dir="/var/tmp")
    point = os.path.join(work, name)
    os.mkdir(point)
    mounted = False
    try:
        if fstype in ("tmpfs", "ramfs"):
            opts = ",".join(o for o in (options, f"size={size_bytes}" if fstype == "tmpfs" else "") if o)
            cmd = ["mount", "-t", fstype] + (["-o", opts] if opts else []) + [fstype, point]
        else:
            image = os.path.join(work, "fs.img")
            with open(image, "wb") as f:
                f.truncate(size_bytes)
            mkfs = shutil.which(f"mkfs.{fstype}")
            if mkfs is None:
                pytest.skip(f"mkfs.{fstype} is not installed")
            subprocess.run([mkfs, "-q", "-F", image], check=True, capture_output=True)
            opts = ",".join(o for o in ("loop", options) if o)
            cmd = ["mount", "-t", fstype, "-o", opts, image, point]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount {fstype} here: {result.stderr.strip() or result.returncode}")
        mounted = True
        yield point
    finally:
        if mounted:
            subprocess.run(["umount", point], check=False, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
