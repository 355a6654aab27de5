"""Host capacity inside a memory cgroup (memory_limits NOTE [Memory limits]).

A real cgroup where this machine lets us make one (root, a memory controller: v1 here, v2
where it has one), and made-up /proc + cgroup trees for every layout the reader handles.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from offload.util.memory_limits import available_memory

GiB = 1 << 30

_CHILD = """
import json, offload
with offload.activations(tiers="host", host_bytes="50%", min_bytes=0) as ctx:
    pass
print(json.dumps({"capacity": ctx.stats.host_capacity_bytes,
                  "source": ctx.stats.host_capacity_source,
                  "summary": ctx.stats.summary()}))
"""


def _make_cgroup(version: int) -> tuple[str, str]:
    """A new memory cgroup with a 2 GiB limit: (its directory, the file taking a pid)."""
    if version == 1:
        parent = "/sys/fs/cgroup/memory"
        limit_file, limit = "memory.limit_in_bytes", str(2 * GiB)
    else:
        parent = "/sys/fs/cgroup"
        if not os.path.exists(os.path.join(parent, "cgroup.controllers")) or "memory" not in \
                open(os.path.join(parent, "cgroup.controllers")).read().split():
            pytest.skip("no cgroup v2 hierarchy with the memory controller at /sys/fs/cgroup "
                        "on this machine")
        limit_file, limit = "memory.max", str(2 * GiB)
    path = os.path.join(parent, f"offload-test-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, limit_file), "w") as f:
            f.write(limit)
    except OSError as exc:
        if os.path.isdir(path):
            os.rmdir(path)
        pytest.skip(f"cannot make a cgroup v{version} memory cgroup here ({exc}): needs root "
                    "and a writable memory controller")
    return path, os.path.join(path, "cgroup.procs")


@pytest.mark.parametrize("version", [1, 2])
def test_in_a_2gib_memory_cgroup_half_is_at_most_1gib(version):
    path, procs = _make_cgroup(version)
    try:
        # The child joins the cgroup before Python starts (sh writes its own pid, then execs).
        out = subprocess.run(
            ["sh", "-c", f'echo $$ > {procs} && exec "$0" -c "$1"', sys.executable, _CHILD],
            capture_output=True, text=True, timeout=120, check=True).stdout
    finally:
        os.rmdir(path)
    result = json.loads(out.strip().splitlines()[-1])
    assert 0 < result["capacity"] <= GiB
    assert result["source"].startswith(f"50% of cgroup v{version} /")
    assert "limit 2 GiB" in result["source"] and "host capacity" in result["summary"]


# --------------------------------------------------------------------------- made-up trees
def _tree(tmp_path, version: int, cgroup_path: str, levels: dict[str, dict[str, str]],
          mount_root: str = "/"):
    """A fake /proc/self (cgroup, mountinfo) and a cgroup mount with `levels` (relative
    directory -> files). Returns the fake proc root."""
    mount = tmp_path / "cgroup"
    for rel, files in levels.items():
        d = mount / rel if rel else mount
        d.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (d / name).write_text(text)
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    if version == 2:
        (proc / "cgroup").write_text(f"0::{cgroup_path}\n")
        mountinfo = f"30 25 0:26 {mount_root} {mount} rw,nosuid - cgroup2 cgroup2 rw\n"
    else:
        (proc / "cgroup").write_text(f"4:memory:{cgroup_path}\n1:cpu,cpuacct:/x\n0::/\n")
        mountinfo = (f"31 25 0:27 {mount_root} {mount} rw,nosuid - cgroup cgroup rw,memory\n"
                     f"32 25 0:28 / {tmp_path}/cpu rw - cgroup cgroup rw,cpu,cpuacct\n")
    (proc / "mountinfo").write_text(mountinfo)
    return str(tmp_path / "proc")


def _v2(limit: str, current: int, inactive: int = 0) -> dict[str, str]:
    return {"memory.max": limit, "memory.current": str(current),
            "memory.stat": f"anon 1\ninactive_file {inactive}\nactive_file 5\n"}


def _v1(limit: int, usage: int, inactive: int = 0) -> dict[str, str]:
    return {"memory.limit_in_bytes": str(limit), "memory.usage_in_bytes": str(usage),
            "memory.stat": f"cache 1\ntotal_inactive_file {inactive}\n"}


def test_v2_limit_minus_usage_not_counting_inactive_file_cache(tmp_path):
    proc = _tree(tmp_path, 2, "/job/step", {
        "": {"cgroup.controllers": "cpu memory"},
        "job": _v2("max", 5 * GiB),
        "job/step": _v2(str(2 * GiB), GiB, inactive=GiB // 2)})
    limit = available_memory(proc)
    assert limit.available_bytes == 2 * GiB - GiB // 2
    assert limit.total_bytes == 2 * GiB
    assert limit.source == "cgroup v2 /job/step (limit 2 GiB, 1 GiB in use)"


def test_v2_an_ancestors_smaller_room_wins(tmp_path):
    proc = _tree(tmp_path, 2, "/pod/container", {
        "": {"cgroup.controllers": "memory"},
        "pod": _v2(str(3 * GiB), int(2.5 * GiB)),
        "pod/container": _v2(str(2 * GiB), GiB)})
    limit = available_memory(proc)
    assert limit.available_bytes == GiB // 2 and limit.source.startswith("cgroup v2 /pod ")


def test_v2_in_a_cgroup_namespace_the_mount_is_the_containers_cgroup(tmp_path):
    proc = _tree(tmp_path, 2, "/", {"": {"cgroup.controllers": "memory",
                                         **_v2(str(GiB), GiB // 4)}})
    assert available_memory(proc).available_bytes == GiB - GiB // 4


def test_v1_hierarchy_and_unlimited(tmp_path):
    proc = _tree(tmp_path, 1, "/slurm/job_7", {
        "": _v1(9223372036854771712, 10 * GiB),
        "slurm": _v1(9223372036854771712, 10 * GiB),
        "slurm/job_7": _v1(4 * GiB, 3 * GiB, inactive=GiB)})
    limit = available_memory(proc)
    assert limit.available_bytes == 2 * GiB
    assert limit.source == "cgroup v1 /slurm/job_7 (limit 4 GiB, 3 GiB in use)"


def test_no_limit_or_unreadable_files_mean_the_ram_figure(tmp_path):
    proc = _tree(tmp_path, 2, "/job", {"": {"cgroup.controllers": "memory"},
                                        "job": _v2("max", GiB)})
    assert available_memory(proc).source == "RAM available"
    proc2 = tmp_path / "empty"
    (proc2 / "self").mkdir(parents=True)
    assert available_memory(str(proc2)).source == "RAM available"


def test_v1_mount_root_is_stripped_from_the_path(tmp_path):
    """A container whose v1 memory mount is rooted at its own cgroup (/docker/abc)."""
    proc = _tree(tmp_path, 1, "/docker/abc", {"": _v1(GiB, GiB // 2)}, mount_root="/docker/abc")
    assert available_memory(proc).available_bytes == GiB // 2


def test_a_new_ram_reading_gives_a_new_limit_and_host_capacity(tmp_path, monkeypatch):
    """The limit and the host tier's capacity are kept between steps only while their RAM
    reading stands (0.1 s): a reading taken after it gives the new figures."""
    import offload.config_checks as config_module
    from offload.config import Config
    from offload.util import memory_limits

    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)   # no cgroup: the RAM figure alone
    meminfo = proc / "meminfo"
    meminfo.write_text(f"MemTotal: {8 * GiB // 1024} kB\nMemAvailable: {4 * GiB // 1024} kB\n")
    first = available_memory(str(proc))
    assert available_memory(str(proc)) is first   # the reading stands: the same limit
    meminfo.write_text(f"MemTotal: {8 * GiB // 1024} kB\nMemAvailable: {2 * GiB // 1024} kB\n")
    assert available_memory(str(proc)).available_bytes == 4 * GiB
    monkeypatch.setattr(memory_limits, "_RAM_FRESH_S", 0.0)   # every call a new reading
    assert available_memory(str(proc)).available_bytes == 2 * GiB

    monkeypatch.setattr(config_module, "available_memory", lambda: limit)
    config = Config.from_env(env={}, host_bytes="50%")
    limit = first
    assert config.host_capacity() == (2 * GiB, "50% of RAM available")
    limit = available_memory(str(proc))
    assert config.host_capacity() == (GiB, "50% of RAM available")
