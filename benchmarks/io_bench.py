#!/usr/bin/env python3
"""Sequential and activation-like I/O through offload's NVMe engine, next to fio (and
DeepSpeed's aio op when importable), in the same run on the same directory.

    python benchmarks/io_bench.py --dir /var/tmp --size 1GiB --json io.json

Method: the engine and fio run in every round, in alternating order (engine first on odd
rounds, last on even ones), and medians over --rounds are reported. All use O_DIRECT, the
same block size and the same queue depth (fio: one job with iodepth=N on libaio, else
io_uring, plus a psync run with N threads; the engine: --workers threads, N by default,
each with one block-size pread/pwrite in flight). Every pass writes into freshly
reserved space (the engine gets a new slab, fio's file is deleted before each write).
The engine writes a buffer as large as the pass, filled with fresh random bytes before
each round (untimed) so no piece repeats, and reads back into a zeroed buffer that is
CRC-checked after the clock stops; fio fills its buffers with its own scrambled data.
Around every pass the block device's sector counters (/sys/dev/block/MAJ:MIN/stat) are
read: a pass whose device traffic falls short of its size was (partly) served by a cache
and is flagged. Other processes' I/O on the same disk only adds to the counters, so the
check catches caching, not noise. The same counters give the requests the disk saw
(MiB/req): the block layer merges adjacent requests, and on a latency-bound (virtual)
disk fewer, larger requests move more. DeepSpeed and the trace run once. The trace phase
writes tensors of 1-64 MiB asynchronously as a forward pass would, then reads them back
in reverse order, checking each tensor's CRC-32C. Progress goes to stderr; every file it
creates is removed, on errors too.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from offload._ext import load_core  # noqa: E402

from offload.util.sizes import parse_size as _parse_size  # noqa: E402

MiB = 1 << 20


def parse_size(text: str) -> int:
    """'1GiB' / '512MiB' / '1048576' -> bytes (offload.util.sizes' syntax, no percentages)."""
    try:
        return _parse_size(text).nbytes
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"size {text!r}: {exc}") from None


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------- device counters

class DeviceCounters:
    """Bytes the block device under a directory has read and written (from its sector
    counters), so a pass can be checked against the disk rather than the page cache.

    /sys/dev/block/MAJ:MIN names whole disks, partitions, virtio, dm and md devices alike,
    each with its own `stat`; filesystems without a block device of their own (tmpfs,
    overlay, btrfs' anonymous st_dev) have no entry, and then `available` is False.
    """

    def __init__(self, directory: str):
        dev = os.stat(directory).st_dev
        self.majmin = f"{os.major(dev)}:{os.minor(dev)}"
        node = f"/sys/dev/block/{self.majmin}"
        self.stat_path = os.path.join(node, "stat")
        self.available = os.path.exists(self.stat_path)
        self.name = os.path.basename(os.path.realpath(node)) if self.available else None

    def read(self) -> tuple[int, ...] | None:
        """(bytes read, bytes written, reads, read merges, writes, write merges) since boot;
        None without a block device. The request counts show how the block layer cut and
        merged the I/O: on a latency-bound disk fewer, larger requests are faster."""
        if not self.available:
            return None
        f = [int(x) for x in open(self.stat_path).read().split()]
        return f[2] * 512, f[6] * 512, f[0], f[1], f[4], f[5]   # sectors are 512 bytes

    def describe(self) -> dict:
        return {"majmin": self.majmin, "name": self.name,
                "stat_path": self.stat_path if self.available else None}


def _delta(before: tuple[int, ...] | None, after: tuple[int, ...] | None) -> list[int] | None:
    return None if before is None else [y - x for x, y in zip(before, after)]


def pass_record(kind: str, nbytes: int, seconds: float, delta: list[int] | None) -> dict:
    """One pass's figures; `delta` is the change of DeviceCounters.read() over it."""
    out = {"seconds": seconds, "gbps": nbytes / seconds / 1e9, "bytes": nbytes}
    if delta is not None:
        out["device_bytes_read"], out["device_bytes_written"] = delta[0], delta[1]
        d = 2 if kind == "read" else 4
        out["device_requests"] = delta[d]          # in this pass's direction
        out["device_merges"] = delta[d + 1]
        moved = delta[1] if kind == "write" else delta[0]
        # Less traffic than the pass size means a cache served part of it.
        out["device_short"] = moved < nbytes
    return out


def timed_pass(counters: DeviceCounters, kind: str, nbytes: int, fn) -> dict:
    """Runs fn() (which returns its own seconds, or None to time it here) between two
    reads of the device counters."""
    before = counters.read()
    start = time.perf_counter()
    seconds = fn()
    elapsed = time.perf_counter() - start
    delta = _delta(before, counters.read())
    return pass_record(kind, nbytes, elapsed if seconds is None else seconds, delta)


# --------------------------------------------------------------------------- engine

def engine_buffer_bytes(size: int) -> int:
    """The engine writes from a buffer as large as the pass where RAM allows (so no byte
    pattern repeats), else from 256 MiB-multiple groups refilled between groups."""
    room = psutil.virtual_memory().available // 4
    return size if size <= room else max(256 * MiB, room // (256 * MiB) * (256 * MiB))


def engine_round(core, counters: DeviceCounters, directory: str, size: int, block: int,
                 depth: int, buf, seed: int) -> dict:
    """One sequential write then read of `size` bytes of fresh random data. Filling,
    zeroing and CRC checks are outside the clock; with a buffer smaller than `size` the
    pass runs group by group and only the I/O of each group is timed."""
    store = core.NvmeStore([directory], size, workers=depth, chunk_bytes=block,
                           max_inflight_bytes=depth * block)
    view = torch.frombuffer(buf, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(seed)
    try:
        if not store.direct:
            raise SystemExit(f"--dir {directory}: O_DIRECT is refused there; pick a directory on "
                             "a local disk (ext4, xfs) to compare with fio")
        group = buf.nbytes
        piece = min(group, 256 * MiB)
        extents = [store.allocate(min(piece, size - off)) for off in range(0, size, piece)]
        per_group = group // piece

        def run(write: bool) -> dict:
            io = store.write_ptr if write else store.read_ptr
            seconds, delta = 0.0, None
            for g, first in enumerate(range(0, len(extents), per_group)):
                batch = extents[first:first + per_group]
                nbytes = sum(e.nbytes for e in batch)
                if write:                   # fresh bytes for every group and round
                    view[:nbytes].random_(0, 256, generator=gen)
                    expected_crcs.append(core.crc32c(view[:nbytes].numpy()))
                else:
                    view[:nbytes].zero_()   # a read that moved nothing fails the check
                # Counters and clock cover the I/O only, so the window catches no more of
                # other processes' disk traffic than fio's does.
                before = counters.read()
                start = time.perf_counter()
                futures = [io(e, buf.ptr + i * piece, e.nbytes) for i, e in enumerate(batch)]
                for f in futures:
                    f.wait()
                seconds += time.perf_counter() - start
                got = _delta(before, counters.read())
                delta = got if delta is None else [x + y for x, y in zip(delta, got)]
                if not write and core.crc32c(view[:nbytes].numpy()) != expected_crcs[g]:
                    raise RuntimeError(f"engine read-back of group {g} differs from what was "
                                       "written")
            return pass_record("write" if write else "read", size, seconds, delta)

        expected_crcs: list[int] = []
        write = run(True)
        read = run(False)
        return {"write_gbps": write["gbps"], "read_gbps": read["gbps"],
                "write": write, "read": read, "buffer_bytes": group, "verified": True}
    finally:
        store.close()


# ------------------------------------------------------------------------------ fio

def fio_engine() -> str | None:
    fio = shutil.which("fio")
    if fio is None:
        return None
    out = subprocess.run([fio, "--enghelp"], capture_output=True, text=True).stdout
    for name in ("libaio", "io_uring"):
        if re.search(rf"^\s*{name}\s*$", out, re.M):
            return name
    return "psync"


def fio_round(counters: DeviceCounters, directory: str, size: int, block: int, depth: int,
              engine: str) -> dict:
    path = os.path.join(directory, f"offload-io-bench-fio-{os.getpid()}.tmp")
    result = {}
    try:
        for rw in ("write", "read"):
            if rw == "write" and os.path.exists(path):
                os.unlink(path)      # fresh space each round, as the engine's new slab
            cmd = ["fio", "--name=seq", f"--filename={path}", f"--size={size}", f"--bs={block}",
                   f"--iodepth={depth}", f"--ioengine={engine}", "--direct=1", f"--rw={rw}",
                   "--numjobs=1", "--output-format=json"]
            if engine == "psync":    # no async submission: the depth comes from threads,
                per_job = size // depth  # each writing its own 1/depth of the file
                cmd[3] = f"--size={per_job}"
                cmd[-2:-1] = [f"--numjobs={depth}", f"--offset_increment={per_job}",
                              "--group_reporting", "--thread"]
            job = {}

            def run() -> float:
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"fio failed: {proc.stderr.strip()}")
                job.update(json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0][rw])
                return job["io_bytes"] / job["bw_bytes"]   # fio's own clock, not process start

            moved = (size // depth) * depth if engine == "psync" else size
            result[rw] = timed_pass(counters, rw, moved, run)
            result[f"{rw}_gbps"] = job["bw_bytes"] / 1e9
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return result


# ------------------------------------------------------------------------ deepspeed

def deepspeed_round(counters: DeviceCounters, directory: str, size: int, block: int,
                    depth: int) -> dict | None:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        if not AsyncIOBuilder().is_compatible():
            return None
        aio = AsyncIOBuilder().load(verbose=False)
    except Exception as exc:  # not installed, or its JIT build failed
        log(f"deepspeed aio unavailable: {type(exc).__name__}: {exc}")
        return None
    handle = aio.aio_handle(block, depth, False, True, 1)
    tensor = torch.empty(size, dtype=torch.uint8).pin_memory() if torch.cuda.is_available() \
        else torch.empty(size, dtype=torch.uint8)
    path = os.path.join(directory, f"offload-io-bench-ds-{os.getpid()}.tmp")
    try:
        write = timed_pass(counters, "write", size, lambda: handle.sync_pwrite(tensor, path))
        read = timed_pass(counters, "read", size, lambda: handle.sync_pread(tensor, path))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return {"write_gbps": write["gbps"], "read_gbps": read["gbps"], "write": write, "read": read}


# ---------------------------------------------------------------------------- trace

def trace_run(core, directory: str, total: int, block: int, depth: int, seed: int = 0) -> dict:
    """Forward: tensors of 1-64 MiB written as they are produced, host staging bounded by a
    256 MiB ring (a full ring waits for the oldest write). Backward: read back in reverse
    order with read-ahead through the same ring; every tensor is CRC-32C checked."""
    rng = random.Random(seed)
    sizes = []
    while sum(sizes) < total:
        sizes.append(rng.randint(1, 64) * MiB - rng.randint(0, 4095))  # odd sizes too
    offsets = [rng.randrange(0, 64 * MiB) for _ in sizes]   # tensor i = pattern[off:off+n]
    pattern = torch.randint(0, 256, (128 * MiB,), dtype=torch.uint8)
    # Expected CRC-32C per tensor, computed before the clock starts (crc32c runs at several
    # GB/s; torch.equal on uint8 is slower than this disk).
    expected = [core.crc32c(pattern[o:o + n].numpy()) for n, o in zip(sizes, offsets)]
    staging = 256 * MiB
    arena = core.HostArena(staging)
    store = core.NvmeStore([directory], sum(sizes) + len(sizes) * block, workers=depth,
                           chunk_bytes=block, max_inflight_bytes=depth * block)
    try:
        extents, inflight = [], deque()
        start = time.perf_counter()
        for n, off in zip(sizes, offsets):
            blk = arena.allocate(n)
            while blk is None:               # staging full: wait for the oldest write
                inflight.popleft().wait()
                blk = arena.allocate(n)
            torch.frombuffer(blk, dtype=torch.uint8).copy_(pattern[off:off + n])  # "produce"
            ext = store.allocate(n)
            extents.append(ext)
            inflight.append(store.write(ext, blk))
            del blk                          # the write keeps the block until it lands
        while inflight:
            inflight.popleft().wait()
        write_s = time.perf_counter() - start

        wrong = 0

        def consume(j, blk, fut):
            nonlocal wrong
            fut.wait()
            wrong += core.crc32c(blk) != expected[j]
            blk.release()

        start = time.perf_counter()
        pending = deque()
        for i in reversed(range(len(sizes))):
            blk = arena.allocate(sizes[i])
            while blk is None:
                consume(*pending.popleft())
                blk = arena.allocate(sizes[i])
            pending.append((i, blk, store.read(extents[i], blk)))
            del blk
        while pending:
            consume(*pending.popleft())
        read_s = time.perf_counter() - start
        if wrong:
            raise RuntimeError(f"trace: {wrong} tensors read back wrong")
        nbytes = sum(sizes)
        return {"tensors": len(sizes), "bytes": nbytes, "write_gbps": nbytes / write_s / 1e9,
                "read_gbps": nbytes / read_s / 1e9, "verified": True, "staging_bytes": staging}
    finally:
        store.close()


# ----------------------------------------------------------------------------- main

def _median(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def _short_passes(name: str, rounds: list[dict]) -> list[str]:
    """'engine round 2 read: device read 0.31 GB of 1.07 GB' for every cache-served pass."""
    flags = []
    for i, r in enumerate(rounds):
        for rw in ("write", "read"):
            p = r.get(rw) or {}
            if p.get("device_short"):
                moved = p["device_bytes_written" if rw == "write" else "device_bytes_read"]
                verb = "read" if rw == "read" else "wrote"
                flags.append(f"{name} round {i + 1} {rw}: the device {verb} {moved / 1e9:.3f} GB "
                             f"of {p['bytes'] / 1e9:.3f} GB (cache-served)")
    return flags


def _device_line(name: str, rounds: list[dict]) -> str:
    cells = []
    for rw, key in (("write", "device_bytes_written"), ("read", "device_bytes_read")):
        got = [r[rw][key] / r[rw]["bytes"] for r in rounds if key in r.get(rw, {})]
        reqs = [r[rw][key] / r[rw]["device_requests"] / MiB for r in rounds
                if r.get(rw, {}).get("device_requests")]
        cells.append((f"{rw} {min(got):.2f}-{max(got):.2f}x" if got else f"{rw} n/a")
                     + (f" (~{statistics.median(reqs):.1f} MiB/req)" if reqs else ""))
    return f"  {name:16s} device bytes / pass size: {cells[0]}, {cells[1]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="directory on the disk to test (files are removed)")
    p.add_argument("--size", type=parse_size, default=parse_size("1GiB"),
                   help="bytes per sequential pass (default 1GiB)")
    p.add_argument("--block-size", type=parse_size, default=MiB,
                   help="chunk / fio bs (default 1MiB)")
    p.add_argument("--iodepth", type=int, default=16, help="queue depth (default 16)")
    p.add_argument("--workers", type=int, default=None,
                   help="engine worker threads (default: --iodepth, i.e. the same queue depth)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--trace-size", type=parse_size, default=None,
                   help="bytes of the activation-like trace (default: --size)")
    p.add_argument("--no-fio", action="store_true")
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)

    if not os.path.isdir(args.dir):
        p.error(f"--dir {args.dir!r} is not a directory")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds} (medians need one round)")
    if args.iodepth < 1:
        p.error(f"--iodepth must be at least 1, got {args.iodepth}")
    if args.workers is not None and args.workers < 1:
        p.error(f"--workers must be at least 1, got {args.workers}")
    if args.block_size < 4096 or args.block_size % 4096:
        p.error(f"--block-size must be a positive multiple of 4096, got {args.block_size}")
    if args.size < args.block_size or args.size % args.block_size:
        p.error(f"--size must be a positive multiple of --block-size ({args.block_size}), "
                f"got {args.size}")
    if not args.no_fio and args.size < args.block_size * args.iodepth:
        # fio psync splits the file over --iodepth jobs, each needing a whole block.
        p.error(f"--size must be at least --block-size x --iodepth "
                f"({args.block_size * args.iodepth}) for the fio comparison, got {args.size} "
                "(raise --size, lower --iodepth, or pass --no-fio)")
    core = load_core()
    counters = DeviceCounters(args.dir)
    if not counters.available:
        log(f"--dir {args.dir}: no block device behind st_dev {counters.majmin}; device-byte "
            "checks are off (results may come from a cache)")
    work = tempfile.mkdtemp(prefix="offload-io-bench-", dir=args.dir)
    size, block, depth = args.size, args.block_size, args.iodepth
    workers = args.workers or depth
    try:
        buf_bytes = engine_buffer_bytes(size)
        arena = core.HostArena(buf_bytes)
        buf = arena.allocate(buf_bytes)
        fio_eng = None if args.no_fio else fio_engine()
        engine_rounds, fio_rounds, psync_rounds = [], [], []
        tools = [("engine", lambda r: engine_round(core, counters, work, size, block, workers,
                                                   buf, seed=r), engine_rounds)]
        if fio_eng:
            tools.append((f"fio {fio_eng}", lambda r: fio_round(counters, work, size, block,
                                                              depth, fio_eng), fio_rounds))
            if fio_eng != "psync":   # same depth through threads, as the engine does it
                tools.append((f"fio psync x{depth}", lambda r: fio_round(
                    counters, work, size, block, depth, "psync"), psync_rounds))
        for r in range(args.rounds):
            order = tools if r % 2 == 0 else tools[::-1]   # round 1 engine first, round 2 last
            log(f"round {r + 1}/{args.rounds}: {', '.join(t[0] for t in order)} "
                f"({size / 1e9:.2f} GB, bs {block}, engine {workers} workers, "
                f"fio iodepth {depth})")
            for name, run, into in order:
                into.append(run(r))
                log(f"  {name:16s} write {into[-1]['write_gbps']:.2f} GB/s  "
                    f"read {into[-1]['read_gbps']:.2f} GB/s")
        buf.release()
        ds = None if args.no_deepspeed else deepspeed_round(counters, work, size, block, depth)
        log("trace: tensors of 1-64 MiB, reverse-order read-back")
        trace = trace_run(core, work, args.trace_size or size, block, workers)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    flags = (_short_passes("engine", engine_rounds) + _short_passes("fio", fio_rounds)
             + _short_passes("fio psync", psync_rounds)
             + _short_passes("deepspeed", [ds] if ds else []))
    result = {
        "config": {"dir": args.dir, "size_bytes": size, "block_bytes": block, "iodepth": depth,
                   "workers": workers, "rounds": args.rounds, "direct": True,
                   "order": "alternating: engine first on odd rounds, last on even rounds",
                   "load_avg": os.getloadavg()},
        "device": counters.describe(),
        "engine": {"write_gbps": _median(engine_rounds, "write_gbps"),
                   "read_gbps": _median(engine_rounds, "read_gbps"),
                   "workers": workers, "buffer_bytes": buf_bytes, "rounds": engine_rounds},
        "fio": None if not fio_rounds else {
            "write_gbps": _median(fio_rounds, "write_gbps"),
            "read_gbps": _median(fio_rounds, "read_gbps"),
            "ioengine": fio_eng, "rounds": fio_rounds},
        "fio_psync_threads": None if not psync_rounds else {
            "write_gbps": _median(psync_rounds, "write_gbps"),
            "read_gbps": _median(psync_rounds, "read_gbps"),
            "ioengine": "psync", "numjobs": depth, "rounds": psync_rounds},
        "deepspeed": ds,
        "trace": trace,
        "cache_served_passes": flags if counters.available else None,
    }
    if result["fio"]:
        result["ratio_vs_fio"] = {
            k: result["engine"][f"{k}_gbps"] / result["fio"][f"{k}_gbps"]
            for k in ("write", "read")}
        # Per-round ratios pair runs made minutes apart at most, so slow swings in the
        # machine's load (other jobs on the disk or CPUs) cancel better than in the ratio
        # of medians.
        result["ratio_vs_fio_paired"] = {
            k: statistics.median(e[f"{k}_gbps"] / f[f"{k}_gbps"]
                                 for e, f in zip(engine_rounds, fio_rounds))
            for k in ("write", "read")}

    n = args.rounds
    rows = [(f"offload engine ({workers} thr)", result["engine"], f"median of {n}")]
    if result["fio"]:
        rows.append((f"fio ({fio_eng}, qd {depth})", result["fio"], f"median of {n}"))
    if result["fio_psync_threads"]:
        rows.append((f"fio (psync, {depth} jobs)", result["fio_psync_threads"], f"median of {n}"))
    if ds:
        rows.append(("deepspeed aio", ds, "1 run"))
    rows.append((f"trace ({trace['tensors']} tensors)", trace, "1 run"))
    print(f"\nO_DIRECT, {size / 2**30:.2f} GiB per pass, bs {block // 1024} KiB, engine "
          f"{workers} workers, fio iodepth {depth}; {n} rounds in alternating order; "
          f"load avg {os.getloadavg()[0]:.2f}")
    print(f"{'':28s} {'write GB/s':>11s} {'read GB/s':>10s}")
    for name, r, how in rows:
        print(f"{name:28s} {r['write_gbps']:11.2f} {r['read_gbps']:10.2f}   {how}")
    if result["fio"]:
        ratio = result["ratio_vs_fio"]
        print(f"{'engine / fio':28s} {ratio['write']:11.2f} {ratio['read']:10.2f}   "
              "ratio of medians")
        paired = result["ratio_vs_fio_paired"]
        print(f"{'engine / fio, same round':28s} {paired['write']:11.2f} {paired['read']:10.2f}   "
              f"median of {n} per-round ratios")
    if counters.available:
        print(f"device {counters.name} ({counters.majmin}):")
        for name, rounds in (("engine", engine_rounds), ("fio", fio_rounds),
                             ("fio psync", psync_rounds), ("deepspeed", [ds] if ds else [])):
            if rounds:
                print(_device_line(name, rounds))
        print("  cache-served passes: " + ("; ".join(flags) if flags else "none"))
    else:
        print("device counters unavailable: results may include cache hits")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
