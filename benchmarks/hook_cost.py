"""Host time per saved tensor that the saved-tensor hooks add, against plain autograd.

    python benchmarks/hook_cost.py                      # CPU, 1 thread, 5,000 x 4 KiB
    python benchmarks/hook_cost.py --device cuda        # on a GPU: issue cost of a D2H
    python benchmarks/hook_cost.py --json out.json
    python benchmarks/hook_cost.py --cpu 1              # the timed thread on CPU 1

A chain of N ops (`sin`), each saving one fresh tensor of `--bytes`, runs forward and
backward under each path; every path is timed in every round, in turn (alternating, so
drift hits all alike), and the table gives medians over rounds of the forward (pack),
backward (unpack) and step-end time per saved tensor *above* the plain run of the same
round. The step end is the context's exit: with backward inside the block, the runtime
closes the step there, and what it does per stored storage (its timings, the next plan)
is part of what a saved tensor costs. Time is
the training thread's own CPU time (`time.thread_time`, `--clock thread`, the default):
what the hooks cost that thread, unmoved by other processes on a shared machine and not
counting the tier's I/O threads (the I/O itself is asynchronous); `--clock wall` measures
wall time instead (on a GPU, use wall: the thread sleeps in synchronize). Once the tiers'
I/O threads exist, the timed thread is pinned to a CPU that takes none of the nvme
directory's disk interrupts (`--cpu auto`, when there is one; the note above `disk_irqs`
says why; `--cpu none` leaves it to the scheduler, `--cpu N` pins it to CPU N), and the
header says how many of them landed on it. Each path runs
`--steps` steps in a row after one `gc.collect()`, so it pays, on average, for the garbage
collections its own objects cause (`timed_block`); the `collector` column says how much of
its total those collections took (timed through `gc.callbacks`), and the `objects` column
how many tracked Python objects each saved tensor keeps alive through the step (what those
collections walk).

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


def timed_step(x0: torch.Tensor, n: int, ctx, sync, clock) -> tuple[float, float, float]:
    """(forward, backward, step end) seconds of one chain under `ctx`: the step end is the
    context's exit, where the runtime closes the step (its per-storage bookkeeping too)."""
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
    sync()
    t3 = clock()
    return t1 - t0, t2 - t1, t3 - t2


class CollectorClock:
    """Time spent in the garbage collector's collections (`gc.callbacks`) on `clock`."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.seconds = 0.0
        self._start: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = self.clock()
        elif self._start is not None:
            self.seconds += self.clock() - self._start
            self._start = None

    def __enter__(self) -> "CollectorClock":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def timed_block(x0: torch.Tensor, n: int, make, steps: int, sync,
                clock) -> tuple[float, ...]:
    """Mean (forward, backward, step end, of them in the collector) seconds over `steps`
    consecutive steps.

    The garbage collector is part of what a saved tensor costs. A young collection comes
    after 700 more tracked objects were made than freed, every tenth young one is a middle
    one, and every tenth middle one is a full one, which walks every object of the process
    (~0.1 s with torch loaded), once enough objects (a quarter of all) reached the oldest
    generation since the last. So each tracked object a step makes and keeps brings the
    next full collection nearer; a single step after `gc.collect()` hides that cost, or
    charges all of it. The block starts with one full collection (nothing left over from
    the previous path) and then runs `steps` steps in a row, each paying, on average, for
    the collections its own objects cause; the fourth figure is the part of the three spent
    in collections.
    """
    gc.collect()
    total = [0.0, 0.0, 0.0]
    with CollectorClock(clock) as collector:
        for _ in range(steps):
            for i, t in enumerate(timed_step(x0, n, make(), sync, clock)):
                total[i] += t
    return tuple(t / steps for t in total) + (collector.seconds / steps,)


def objects_kept(x0: torch.Tensor, n: int, ctx) -> int:
    """Python objects the garbage collector tracks that were made during the forward and
    are alive at its end (the chain's own tensors included): what reaches the old
    generation. A young collection first untracks what it never needs to walk again
    (tuples and dicts of plain values)."""
    gc.collect()
    gc.disable()
    try:
        x = x0.detach().requires_grad_()
        with ctx:
            before = len(gc.get_objects())
            y = chain(x, n)
            gc.collect(1)
            alive = len(gc.get_objects()) - before
            y.sum().backward()
    finally:
        gc.enable()
    return alive


def _identity(t):
    return t


# --- Where the disk's interrupts land. The thread clock charges a hardware interrupt to
# whichever thread was running on the CPU that took it, and a disk with one queue (a VM's
# virtio disk) delivers every completion to one CPU: a training thread there pays for the
# I/O threads' completions (some 4 µs each here, two per nvme save), a thread on another
# CPU does not. That is the I/O's cost, not the hooks' issue cost, and which of the two a
# run gets is up to the scheduler: it moved nvme's figure by ~12 µs from run to run
# (docs/benchmarks.md *Hook cost*). So the timed thread runs on a CPU that takes none of
# them (`--cpu auto`), and the table says how many landed on it.

def disk_irqs(path: str) -> list[str]:
    """The interrupt numbers of the PCI device behind `path`'s block device (its
    `msi_irqs`), [] when there is none to find (tmpfs, a loop device, no sysfs)."""
    st = os.stat(path)
    node = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    while node.startswith("/sys/devices/"):
        irqs = os.path.join(node, "msi_irqs")
        if os.path.isdir(irqs):
            return sorted(os.listdir(irqs), key=int)
        node = os.path.dirname(node)
    return []


def irq_counts(irqs: list[str]) -> list[int]:
    """Interrupts taken so far per CPU, summed over `irqs` (/proc/interrupts)."""
    totals: list[int] = []
    wanted = set(irqs)
    try:
        with open("/proc/interrupts") as f:
            ncpu = len(f.readline().split())
            totals = [0] * ncpu
            for line in f:
                fields = line.split()
                if fields and fields[0].rstrip(":") in wanted:
                    for cpu, count in enumerate(fields[1:1 + ncpu]):
                        totals[cpu] += int(count)
    except OSError:
        pass
    return totals


def quiet_cpu(irqs: list[str]) -> int | None:
    """A CPU this process may run on that has taken none of `irqs`, None if there is none
    (or they cannot be read)."""
    counts = irq_counts(irqs)
    if not counts:
        return None
    allowed = sorted(os.sched_getaffinity(0))
    quiet = [cpu for cpu in allowed if cpu < len(counts) and counts[cpu] == 0]
    return quiet[0] if quiet and sum(counts) > 0 else None


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
    ap.add_argument("--steps", type=int, default=5,
                    help="consecutive steps per path and round (see timed_block)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread",
                    help="the training thread's CPU time (default) or wall time")
    ap.add_argument("--nvme-dir", default=os.environ.get("OFFLOAD_NVME_DIR", "/var/tmp"),
                    help="parent directory of the nvme tier's temporary directory")
    ap.add_argument("--cpu", default="auto",
                    help="the CPU the timed (training) thread runs on once the tiers' I/O "
                         "threads exist: auto (default: one that takes none of the nvme "
                         "directory's disk interrupts, when there is one), none (where the "
                         "scheduler puts it), or a CPU number")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    if args.cpu not in ("auto", "none") and not args.cpu.isdigit():
        ap.error(f"--cpu={args.cpu!r}: give auto, none or a CPU number")
    for name, least in (("tensors", 1), ("bytes", 4), ("rounds", 1), ("steps", 1)):
        if getattr(args, name) < least:
            ap.error(f"--{name}={getattr(args, name)}: must be at least {least}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    if not os.path.isdir(args.nvme_dir or tempfile.gettempdir()):
        ap.error(f"--nvme-dir {args.nvme_dir!r}: not a directory (give an existing one)")
    if args.cpu.isdigit() and int(args.cpu) not in os.sched_getaffinity(0):
        ap.error(f"--cpu={args.cpu}: this process may run on CPUs "
                 f"{sorted(os.sched_getaffinity(0))}")
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
        # Pinned now: the I/O threads started above keep the whole machine.
        irqs = disk_irqs(nvme)
        cpu = quiet_cpu(irqs) if args.cpu == "auto" else \
            None if args.cpu == "none" else int(args.cpu)
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})   # this thread only
        irqs_before = irq_counts(irqs)
        objects = {name: objects_kept(x0, n, make()) for name, make in paths.items()}
        parts = ("forward_us", "backward_us", "end_us", "collector_us")
        times: dict[str, dict[str, list[float]]] = {k: {p: [] for p in parts} for k in paths}
        for r in range(args.rounds):
            base = timed_block(x0, n, paths["plain"], args.steps, sync, clock)
            for name, make in paths.items():
                got = base if name == "plain" else timed_block(x0, n, make, args.steps, sync,
                                                               clock)
                for part, t, b in zip(parts, got, base):
                    times[name][part].append(t / n if name == "plain" else (t - b) / n)
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        irqs_after = irq_counts(irqs)
        empty = statistics.median(empty_step_s(200, {"tiers": "host"}, clock)
                                  for _ in range(5))
        offload.empty_cache()
    landed = [b - a for a, b in zip(irqs_before, irqs_after)]
    if cpu is not None and cpu < len(landed):
        where = (f"timed thread on CPU {cpu}, which took {landed[cpu]} of the nvme disk's "
                 f"{sum(landed)} interrupts during the rounds")
    else:
        where = ("timed thread where the scheduler put it" if args.cpu != "auto" else
                 "timed thread not pinned (no CPU found that takes none of the nvme disk's "
                 "interrupts)") + (f"; the disk took {sum(landed)} interrupts during the rounds"
                                   if landed else "")
    us = 1e6
    rows = {name: {part: statistics.median(times[name][part]) * us for part in parts}
            for name in paths}
    for name, row in rows.items():
        row["objects"] = (objects[name] - (0 if name == "plain" else objects["plain"])) / n
    print(f"\n{n} saved tensors of {args.bytes} B, {device}, {args.threads} thread(s), "
          f"{args.clock} clock, blocks of {args.steps} steps, medians of {args.rounds} "
          f"alternating rounds (µs per saved tensor; plain: absolute, others: above plain; "
          f"collector: the part of the total spent in garbage collections; objects: tracked "
          f"Python objects alive after the forward, per saved tensor; {where})\n")
    print("| path | forward (pack) | backward (unpack) | step end (exit) | total | collector "
          "| objects |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        total = row["forward_us"] + row["backward_us"] + row["end_us"]
        print(f"| {name} | {row['forward_us']:.1f} | {row['backward_us']:.1f} | "
              f"{row['end_us']:.1f} | {total:.1f} | {row['collector_us']:.1f} | "
              f"{row['objects']:.1f} |")
    print(f"\nempty step (build, enter, exit a context): {empty * us:.0f} µs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tensors": n, "bytes": args.bytes, "device": str(device),
                       "clock": args.clock, "steps": args.steps, "cpu": cpu,
                       "disk_interrupts_by_cpu": landed,
                       "threads": args.threads, "rounds": args.rounds, "rows": rows,
                       "empty_step_us": empty * us, "torch": torch.__version__}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
