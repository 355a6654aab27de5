"""Measured figures of this machine, cached per machine, device and NVMe file system.

    figures = probe.figures_for(config, torch.device("cuda"))

Groups, each measured only when the run needs it and OFFLOAD_PROBE does not give all of
its figures (offload/schedule/measure.py does the measuring):

| group   | figures                                              | cache key                        |
|---------|------------------------------------------------------|----------------------------------|
| compute | compute_gflops, dispatch_op_s                        | host, device name, torch version |
| pcie    | d2h_gbps, h2d_gbps, d2h_small_gbps, copy_issue_s     | host, device name, torch version |
| nvme    | nvme_write_gbps, nvme_read_gbps, nvme_issue_s        | host, the directories' file systems, I/O workers |

The cache is one JSON file under the user's cache directory (`$XDG_CACHE_HOME/offload`,
default `~/.cache/offload`), versioned by `PROBE_VERSION`: a figure measured by an older
probe is measured again, never misread. Ranks of one host (torchrun) take an exclusive
file lock around look-up-or-measure, so the first rank measures and the others read its
result. `OFFLOAD_PROBE=refresh` measures again; `name=value` figures win over everything.
OFFLOAD_NVME_MAX_BW caps the NVMe figures (the disk's own speed stays in the cache).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
from typing import Any, Callable, Iterator

import torch

from ..util.figures import Figures

__all__ = ["PROBE_VERSION", "GROUPS", "cache_path", "figures_for", "measure_groups"]

log = logging.getLogger("offload")

# Bump when a measurement changes meaning (what it moves, how it is timed).
PROBE_VERSION = 1

GROUPS: dict[str, tuple[str, ...]] = {
    "compute": ("compute_gflops", "dispatch_op_s"),
    "pcie": ("d2h_gbps", "h2d_gbps", "d2h_small_gbps", "copy_issue_s"),
    "nvme": ("nvme_write_gbps", "nvme_read_gbps", "nvme_issue_s"),
}


def cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "offload", f"probe-v{PROBE_VERSION}.json")


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu {platform.processor() or platform.machine()} x{os.cpu_count()}"


def _key(group: str, device: torch.device, dirs: tuple[str, ...], workers: int) -> str:
    host = socket.gethostname()
    if group == "nvme":
        # The file system's device, not the path: the speed is the disk's, and training
        # scripts and offload-bench make a fresh scratch directory per run on it.
        where = ";".join(f"dev {os.stat(d).st_dev}" for d in dirs)
        return f"nvme|{host}|{where}|workers={workers}"
    torch_ver = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return f"{group}|{host}|{_device_name(device)}|torch {torch_ver}"


def _needed_groups(device: torch.device, tiers: tuple[str, ...]) -> list[str]:
    groups = ["compute"]
    if device.type == "cuda":
        groups.append("pcie")
    if "nvme" in tiers:
        groups.append("nvme")
    return groups


@contextlib.contextmanager
def _locked(path: str) -> Iterator[bool]:
    """Exclusive lock next to the cache file; yields False when the cache dir is unusable."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        log.warning("offload: cannot use the probe cache %s (%s); measuring without it",
                    path, exc)
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes, also if we crash
        yield True
    finally:
        os.close(fd)


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("offload: ignoring the unreadable probe cache %s (%s)", path, exc)
        return {}
    if data.get("version") != PROBE_VERSION or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def _write(path: str, entries: dict[str, Any]) -> None:
    tmp = f"{path}.{os.getpid()}.part"
    with open(tmp, "w") as f:
        json.dump({"version": PROBE_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # readers never see half a file


def measure_groups(groups: list[str], device: torch.device, dirs: tuple[str, ...],
                   workers: int) -> dict[str, dict[str, float]]:
    """Measure `groups` now (no cache); group -> figures."""
    from . import measure

    out: dict[str, dict[str, float]] = {}
    for group in groups:
        t0 = time.perf_counter()
        if group == "compute":
            out[group] = measure.compute_figures(device)
        elif group == "pcie":
            from .._ext import load_core

            out[group] = measure.pcie_figures(device, load_core())
        elif group == "nvme":
            from .._ext import load_core

            out[group] = measure.nvme_figures(dirs, workers, load_core())
        log.info("offload: probe measured %s in %.1f s: %s", group, time.perf_counter() - t0,
                 out[group])
    return out


def figures_for(config, device: torch.device, *,
                measure_fn: Callable[..., dict[str, dict[str, float]]] = measure_groups
                ) -> Figures:
    """The figures `auto` plans with on `device` under `config` (see module doc).

    Args:
        config: The run's Config (tiers, nvme_dir, io_workers, probe, nvme_max_bw).
        device: The compute device.
        measure_fn: Replaced in tests to count or fake measurements.
    """
    setting = config.probe
    dirs = tuple(config.nvme_dir)
    wanted = [g for g in _needed_groups(device, config.tiers)
              if not all(name in setting.overrides for name in GROUPS[g])]
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    if wanted:
        path = cache_path()
        with _locked(path) as usable:
            entries = _read(path) if usable else {}
            keys = {g: _key(g, device, dirs, config.io_workers) for g in wanted}
            missing = [g for g in wanted if setting.refresh or keys[g] not in entries]
            if missing:
                measured = measure_fn(missing, device, dirs, config.io_workers)
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                for g in missing:
                    entries[keys[g]] = {"figures": measured[g], "measured_at": stamp}
                if usable:
                    try:
                        _write(path, entries)
                    except OSError as exc:
                        log.warning("offload: could not write the probe cache %s: %s", path, exc)
            for g in wanted:
                entry = entries[keys[g]]
                source = "measured" if g in missing else f"cached {entry.get('measured_at', '')}"
                for name in GROUPS[g]:
                    if entry["figures"].get(name) is not None:
                        values[name] = float(entry["figures"][name])
                        sources[name] = source.strip()
    for name, value in setting.overrides.items():
        values[name], sources[name] = value, "OFFLOAD_PROBE"
    cap = config.nvme_max_bw
    if cap:
        for name in ("nvme_write_gbps", "nvme_read_gbps"):
            if name not in values or values[name] > cap / 1e9:
                values[name] = cap / 1e9
                sources[name] = "OFFLOAD_NVME_MAX_BW"
    return Figures(**values, sources=sources)
