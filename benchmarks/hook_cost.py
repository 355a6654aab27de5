"""Host time per saved tensor that the saved-tensor hooks add, against plain autograd.

    python benchmarks/hook_cost.py                      # CPU, 1 thread, 5,000 x 4 KiB
    python benchmarks/hook_cost.py --device cuda        # on a GPU: issue cost of a D2H
    python benchmarks/hook_cost.py --json out.json

A chain of N ops (`sin`), each saving one fresh tensor of `--bytes`, runs forward and
backward under each path; every path is timed in every round, in turn (alternating, so
drift hits all alike), and the table gives medians over rounds of the forward (pack) and
backward (unpack) time per saved tensor *above* the plain run of the same round. Time is
the training thread's own CPU time (`time.thread_time`, `--clock thread`, the default):
what the hooks cost that thread, unmoved by other processes on a shared machine and not
counting the tier's I/O threads (the I/O itself is asynchronous); `--clock wall` measures
wall time instead (on a GPU, use wall: the thread sleeps in synchronize). Every timed step
starts after `gc.collect()`, so it pays for the collections its own objects cause and not
for the previous path's.

| path | what it is |
|---|---|
| plain | no hooks (the baseline) |
| identity hooks | `saved_tensors_hooks(lambda t: t, lambda t: t)`: the simplest hook, the floor |
| save_on_cpu | `torch.autograd.graph.save_on_cpu()` (on a CPU run it still copies) |
| offload stay | `offload.activations()` with the tensors below OFFLOAD_MIN_BYTES: they stay |
| offload host | `tiers="host", min_bytes=0` (on a CPU run nothing is copied) |
| offload nvme | `tiers="nvme", min_bytes=0` (the I/O is asynchronous; its issue cost counts) |

plus the cost of an empty step (build a context, enter, exit) and, on CUDA, of `host`.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import offload


def chain(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = x.sin()  # saves its input: one fresh tensor per op
    return x


def timed_step(x0: torch.Tensor, n: int, ctx, sync, clock) -> tuple[float, float]:
    """(forward seconds, backward seconds) of one chain under `ctx`."""
    # A full collection first: the garbage collector's generation counters carry over from
    # step to step, so without it a full collection (~0.1 s with a model's objects alive)
    # lands on whichever path crosses the threshold, the same one every round. After it, a
    # step pays only for the collections its own objects cause.
    gc.collect()
    x = x0.detach().requires_grad_()
    with ctx:
        sync()
        t0 = clock()
        y = chain(x, n)
        sync()
        t1 = clock()
        y.sum().backward()
        sync()
        t2 = clock()
    return t1 - t0, t2 - t1


def _identity(t):
    return t


def empty_step_s(reps: int, kwargs: dict, clock) -> float:
    start = clock()
    for _ in range(reps):
        with offload.activations(**kwargs):
            pass
    return (clock() - start) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=5000, help="saved tensors per step")
    ap.add_argument("--bytes", type=int, default=4096, help="bytes of each saved tensor")
    ap.add_argument("--rounds", type=int, default=9, help="alternating rounds (median)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread",
                    help="the training thread's CPU time (default) or wall time")
    ap.add_argument("--nvme-dir", default=os.environ.get("OFFLOAD_NVME_DIR", "/var/tmp"),
                    help="parent directory of the nvme tier's temporary directory")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    n = args.tensors
    x0 = torch.randn(args.bytes // 4, device=device)
    with tempfile.TemporaryDirectory(prefix="offload-hookcost-", dir=args.nvme_dir) as nvme:
        paths = {
            "plain": lambda: contextlib.nullcontext(),
            "identity hooks": lambda: torch.autograd.graph.saved_tensors_hooks(
                _identity, _identity),
            "save_on_cpu": lambda: torch.autograd.graph.save_on_cpu(
                pin_memory=device.type == "cuda"),
            "offload stay": lambda: offload.activations(tiers="host"),  # default min_bytes
            "offload host": lambda: offload.activations(tiers="host", min_bytes=0),
            "offload nvme": lambda: offload.activations(tiers="nvme", nvme_dir=nvme,
                                                        min_bytes=0),
        }
        for make in paths.values():  # warm-up: stores, arenas, first-call costs
            timed_step(x0, n, make(), sync, clock)
        fwd: dict[str, list[float]] = {k: [] for k in paths}
        bwd: dict[str, list[float]] = {k: [] for k in paths}
        for r in range(args.rounds):
            base_f, base_b = timed_step(x0, n, paths["plain"](), sync, clock)
            for name, make in paths.items():
                if name == "plain":
                    fwd[name].append(base_f / n)
                    bwd[name].append(base_b / n)
                    continue
                f, b = timed_step(x0, n, make(), sync, clock)
                fwd[name].append((f - base_f) / n)
                bwd[name].append((b - base_b) / n)
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        empty = statistics.median(empty_step_s(200, {"tiers": "host"}, clock)
                                  for _ in range(5))
        offload.empty_cache()
    us = 1e6
    rows = {name: {"forward_us": statistics.median(fwd[name]) * us,
                   "backward_us": statistics.median(bwd[name]) * us} for name in paths}
    print(f"\n{n} saved tensors of {args.bytes} B, {device}, {args.threads} thread(s), "
          f"{args.clock} clock, medians of {args.rounds} alternating rounds (µs per saved "
          f"tensor; plain: absolute, others: above plain)\n")
    print("| path | forward (pack) | backward (unpack) | total |")
    print("|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['forward_us']:.1f} | {row['backward_us']:.1f} | "
              f"{row['forward_us'] + row['backward_us']:.1f} |")
    print(f"\nempty step (build, enter, exit a context): {empty * us:.0f} µs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tensors": n, "bytes": args.bytes, "device": str(device),
                       "clock": args.clock,
                       "threads": args.threads, "rounds": args.rounds, "rows": rows,
                       "empty_step_us": empty * us, "torch": torch.__version__}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
