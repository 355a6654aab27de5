"""The probe's measurements: each returns a dict of figures (offload/util/figures.py).

Bounded and short: the compute group takes well under a second, the NVMe group moves
`NVME_PROBE_BYTES` each way through our own engine (so the figure includes our submission
path and O_DIRECT, not a tool's), the PCIe group a few hundred MiB through our copy path.
Medians of a few repetitions after a warm-up: the figures feed a plan, which must not
flip with one noisy sample.
"""
from __future__ import annotations

import errno
import shutil
import statistics
import time
from typing import Any

import torch

from ..errors import StorageError

__all__ = ["compute_figures", "nvme_figures", "pcie_figures", "NVME_PROBE_BYTES"]

# Bytes each way: enough to get past a disk's write cache (a short run reads faster than a
# training step's I/O sees; docs/benchmarks.md), little enough to take about a second.
# Less where the directories have less room (`_probe_bytes`), not under the minimum.
NVME_PROBE_BYTES = 256 << 20
_MIN_PROBE_BYTES = 8 << 20
_NVME_REQUEST_BYTES = 16 << 20
_ISSUE_REQUESTS = 64
_SLACK_BYTES = 8 << 20   # per directory, past the probe's bytes (slab rounding, issue test)


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations and lazy initialisation are not the rate
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _own_generator(device: torch.device) -> torch.Generator:
    """A generator of the probe's own for its operands. Not the default ones: `auto` runs
    the probe inside the user's step (its first plan on a machine), and a draw from the
    default generator there would shift every later random number of the user's (data
    order, dropout masks), so the run would differ from plain training."""
    return torch.Generator(device=device).manual_seed(0)


def compute_figures(device: torch.device) -> dict[str, float]:
    """Matmul rate and the extra host time per op of a Python dispatch mode."""
    from torch.utils._python_dispatch import TorchDispatchMode

    cuda = device.type == "cuda"
    n = 4096 if cuda else 1024
    dtype = torch.bfloat16 if cuda else torch.float32
    own = _own_generator(device)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=own)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=own)
    reps = 10 if cuda else 3

    def matmuls() -> None:
        for _ in range(reps):
            torch.mm(a, b)
        if cuda:
            torch.cuda.synchronize(device)

    gflops = 2 * n ** 3 * reps / _median_s(matmuls, 3) / 1e9

    class _PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.ones(16, device=device)
    ops = 2000

    def plain() -> None:
        for _ in range(ops):
            torch.add(x, x)

    def under_mode() -> None:
        with _PassThrough():
            for _ in range(ops):
                torch.add(x, x)

    # Host time only (launches are asynchronous on CUDA): that is what the mode adds.
    extra_s = max(0.0, _median_s(under_mode, 5) - _median_s(plain, 5)) / ops
    if cuda:
        torch.cuda.synchronize(device)
    return {"compute_gflops": gflops, "dispatch_op_s": extra_s}


def _probe_bytes(dirs: tuple[str, ...]) -> tuple[int, int]:
    """(bytes each way, bytes per request): `NVME_PROBE_BYTES`, or half the room the
    directories have left (the nvme tier reserved its share when the context was built:
    by default half the disk), in equal shares. A disk with room for less than
    `_MIN_PROBE_BYTES` cannot be measured: StorageError, saying what to do instead."""
    free = {d: shutil.disk_usage(d).free for d in dirs}
    room = min(free.values()) - _SLACK_BYTES
    total = min(NVME_PROBE_BYTES, max(room, 0) * len(dirs) // 2)
    request = min(_NVME_REQUEST_BYTES, max(total // 8, 1 << 20) >> 20 << 20)
    total = total // request * request
    if total < _MIN_PROBE_BYTES:
        fullest = min(free, key=free.get)
        raise StorageError(
            errno.ENOSPC,
            f"offload: cannot measure the NVMe directory {fullest}: {free[fullest] >> 20} MiB "
            f"free there, and the probe needs "
            f"{(2 * _MIN_PROBE_BYTES // len(dirs) + _SLACK_BYTES) >> 20} MiB. Give "
            "`auto` the disk's figures instead (OFFLOAD_PROBE=nvme_write_gbps=...,"
            "nvme_read_gbps=...,nvme_issue_s=...; `offload-probe --nvme-dir` on a "
            "directory of that disk with room prints them); under `auto` the nvme tier "
            "reserved its share first, and a lower OFFLOAD_NVME_BYTES leaves the probe more",
            fullest)
    return total, request


def nvme_figures(dirs: tuple[str, ...], workers: int, core: Any) -> dict[str, float]:
    """Write and read `NVME_PROBE_BYTES` (less on a fuller disk: `_probe_bytes`) through an
    NvmeStore on `dirs` (private, unlinked slabs: nothing stays on disk), plus the host
    cost of submitting one request."""
    total, request = _probe_bytes(dirs)
    arena = core.HostArena(total, pinned=False)
    store = core.NvmeStore(list(dirs), total + len(dirs) * _SLACK_BYTES, workers=workers,
                           chunk_bytes=4 << 20)
    try:
        block = arena.allocate(total)
        buf = torch.frombuffer(memoryview(block), dtype=torch.uint8)
        # Not zeros: a device that compresses or dedups zero pages would flatter the figure.
        buf.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8,
                                generator=_own_generator(torch.device("cpu"))))
        extents = [store.allocate(request) for _ in range(total // request)]
        base = buf.data_ptr()

        def run(op) -> float:
            t0 = time.perf_counter()
            futures = [op(e, base + i * request, request) for i, e in enumerate(extents)]
            for f in futures:
                f.wait()
            return time.perf_counter() - t0

        run(store.write_ptr)  # warm-up: slab allocation, first-touch of the file's blocks
        write_s = statistics.median(run(store.write_ptr) for _ in range(2))
        read_s = statistics.median(run(store.read_ptr) for _ in range(2))
        small = store.allocate(4096 * _ISSUE_REQUESTS)
        t0 = time.perf_counter()
        futures = [store.write_ptr(small, base, 4096) for _ in range(_ISSUE_REQUESTS)]
        issue_s = (time.perf_counter() - t0) / _ISSUE_REQUESTS
        for f in futures:
            f.wait()
        for e in extents + [small]:
            e.release()
        del block, buf
    finally:
        store.close()
    return {"nvme_write_gbps": total / write_s / 1e9, "nvme_read_gbps": total / read_s / 1e9,
            "nvme_issue_s": issue_s}


def pcie_figures(device: torch.device, core: Any) -> dict[str, float]:
    """Pinned copies through our copy path (offload/tiers/copies.py's CopyStreams)."""
    from ..tiers.copies import CopyStreams

    big, small, count = 256 << 20, 1 << 20, 32
    arena = core.HostArena(big, pinned=True)
    block = arena.allocate(big)
    src = torch.randint(0, 256, (big,), dtype=torch.uint8, device=device,
                        generator=_own_generator(device))

    def d2h_rate(nbytes: int, n: int) -> tuple[float, float]:
        with CopyStreams(device, timing=True) as copies:
            t0 = time.perf_counter()
            for i in range(n):
                copies.offload(src[:nbytes], block)
            issue_s = (time.perf_counter() - t0) / n
            copies.drain()
            return copies.stats.d2h_gbps, issue_s

    def h2d_rate(nbytes: int, n: int) -> float:
        with CopyStreams(device, timing=True) as copies:
            for _ in range(n):
                copies.reload(block, nbytes).tensor_for_use()
            copies.drain()
            return copies.stats.h2d_gbps

    d2h_rate(small, 4)  # warm-up: streams, events, the pinned arena's first use
    d2h_big = statistics.median(d2h_rate(big, 1)[0] for _ in range(3))
    h2d_big = statistics.median(h2d_rate(big, 1) for _ in range(3))
    small_runs = [d2h_rate(small, count) for _ in range(3)]
    torch.cuda.synchronize(device)
    return {"d2h_gbps": d2h_big, "h2d_gbps": h2d_big,
            "d2h_small_gbps": statistics.median(r[0] for r in small_runs),
            "copy_issue_s": statistics.median(r[1] for r in small_runs)}
