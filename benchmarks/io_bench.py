#!/usr/bin/env python3
"""Sequential and activation-like I/O through offload's NVMe engine, next to fio (and
DeepSpeed's aio op when importable), in the same run on the same directory.

    python benchmarks/io_bench.py --dir /var/tmp --size 1GiB --json io.json

Method: engine and fio runs alternate (--rounds each) and medians are reported; both use
O_DIRECT, the same block size and the same queue depth (fio: one job with iodepth=N on
libaio, else io_uring; the engine: --workers threads, N by default, each with one
block-size pread/pwrite in flight). Both write into freshly reserved space every round (the engine gets a new slab,
fio's file is deleted before each write round). The trace phase writes tensors of
1-64 MiB asynchronously as a forward pass would, then reads them back in reverse order,
checking each tensor's CRC-32C. Progress goes to stderr; every file it creates is
removed, on errors too.
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

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from offload._ext import load_core  # noqa: E402

MiB = 1 << 20
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000, "m": MiB, "mib": MiB,
          "mb": 1000**2, "g": 1 << 30, "gib": 1 << 30, "gb": 1000**3, "t": 1 << 40,
          "tib": 1 << 40, "tb": 1000**4}


def parse_size(text: str) -> int:
    """'1GiB' / '512MiB' / '1048576' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"size {text!r}: expected bytes or a number with a unit such as 512MiB or 1GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- engine

def engine_round(core, directory: str, size: int, block: int, depth: int, buf) -> dict:
    """One sequential write then read of `size` bytes; returns GB/s for each."""
    store = core.NvmeStore([directory], size, workers=depth, chunk_bytes=block,
                           max_inflight_bytes=depth * block)
    try:
        if not store.direct:
            raise SystemExit(f"--dir {directory}: O_DIRECT is refused there; pick a directory on "
                             "a local disk (ext4, xfs) to compare with fio")
        piece = buf.nbytes
        extents = [store.allocate(min(piece, size - off)) for off in range(0, size, piece)]
        start = time.perf_counter()
        futures = [store.write_ptr(e, buf.ptr, e.nbytes) for e in extents]
        for f in futures:
            f.wait()
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        futures = [store.read_ptr(e, buf.ptr, e.nbytes) for e in extents]
        for f in futures:
            f.wait()
        read_s = time.perf_counter() - start
        return {"write_gbps": size / write_s / 1e9, "read_gbps": size / read_s / 1e9}
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


def fio_round(directory: str, size: int, block: int, depth: int, engine: str) -> dict:
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
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"fio failed: {proc.stderr.strip()}")
            job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
            result[f"{rw}_gbps"] = job[rw]["bw_bytes"] / 1e9
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return result


# ------------------------------------------------------------------------ deepspeed

def deepspeed_round(directory: str, size: int, block: int, depth: int) -> dict | None:
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
        start = time.perf_counter()
        handle.sync_pwrite(tensor, path)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        handle.sync_pread(tensor, path)
        read_s = time.perf_counter() - start
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return {"write_gbps": size / write_s / 1e9, "read_gbps": size / read_s / 1e9}


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="directory on the disk to test (files are removed)")
    p.add_argument("--size", type=parse_size, default=parse_size("1GiB"),
                   help="bytes per sequential pass (default 1GiB)")
    p.add_argument("--block-size", type=parse_size, default=MiB, help="chunk / fio bs (default 1MiB)")
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
    core = load_core()
    work = tempfile.mkdtemp(prefix="offload-io-bench-", dir=args.dir)
    size, block, depth = args.size, args.block_size, args.iodepth
    workers = args.workers or depth
    try:
        arena = core.HostArena(min(size, 256 * MiB))
        buf = arena.allocate(min(size, 256 * MiB))
        torch.frombuffer(buf, dtype=torch.uint8).copy_(
            torch.randint(0, 256, (buf.nbytes,), dtype=torch.uint8))
        fio_eng = None if args.no_fio else fio_engine()
        engine_rounds, fio_rounds, psync_rounds = [], [], []
        for r in range(args.rounds):
            log(f"round {r + 1}/{args.rounds}: engine ({size / 1e9:.2f} GB, bs {block}, "
                f"{workers} workers) vs fio (iodepth {depth})")
            engine_rounds.append(engine_round(core, work, size, block, workers, buf))
            log(f"  engine  write {engine_rounds[-1]['write_gbps']:.2f} GB/s  "
                f"read {engine_rounds[-1]['read_gbps']:.2f} GB/s")
            if fio_eng:
                fio_rounds.append(fio_round(work, size, block, depth, fio_eng))
                log(f"  fio     write {fio_rounds[-1]['write_gbps']:.2f} GB/s  "
                    f"read {fio_rounds[-1]['read_gbps']:.2f} GB/s")
                if fio_eng != "psync":   # same depth through threads, as the engine does it
                    psync_rounds.append(fio_round(work, size, block, depth, "psync"))
                    log(f"  fio psync x{depth} write {psync_rounds[-1]['write_gbps']:.2f} GB/s  "
                        f"read {psync_rounds[-1]['read_gbps']:.2f} GB/s")
        buf.release()
        ds = None if args.no_deepspeed else deepspeed_round(work, size, block, depth)
        log("trace: tensors of 1-64 MiB, reverse-order read-back")
        trace = trace_run(core, work, args.trace_size or size, block, workers)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    result = {
        "config": {"dir": args.dir, "size_bytes": size, "block_bytes": block, "iodepth": depth,
                   "workers": workers,
                   "rounds": args.rounds, "direct": True},
        "engine": {"write_gbps": _median(engine_rounds, "write_gbps"),
                   "read_gbps": _median(engine_rounds, "read_gbps"),
                   "workers": workers, "rounds": engine_rounds},
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
    }
    if result["fio"]:
        result["ratio_vs_fio"] = {
            k: result["engine"][f"{k}_gbps"] / result["fio"][f"{k}_gbps"] for k in ("write", "read")}

    rows = [("offload engine", result["engine"])]
    if result["fio"]:
        rows.append((f"fio ({fio_eng})", result["fio"]))
    if result["fio_psync_threads"]:
        rows.append((f"fio (psync, {depth} jobs)", result["fio_psync_threads"]))
    if ds:
        rows.append(("deepspeed aio", ds))
    rows.append((f"trace ({trace['tensors']} tensors)", trace))
    print(f"\nO_DIRECT, {size / 2**30:.2f} GiB, bs {block // 1024} KiB, depth {depth}, "
          f"median of {args.rounds} alternating rounds")
    print(f"{'':28s} {'write GB/s':>11s} {'read GB/s':>10s}")
    for name, r in rows:
        print(f"{name:28s} {r['write_gbps']:11.2f} {r['read_gbps']:10.2f}")
    if result["fio"]:
        ratio = result["ratio_vs_fio"]
        print(f"{'engine / fio':28s} {ratio['write']:11.2f} {ratio['read']:10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
