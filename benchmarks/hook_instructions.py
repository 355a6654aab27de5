"""Instructions per saved tensor that the saved-tensor hooks add, counted by valgrind.

    python benchmarks/hook_instructions.py                    # plain, stay, host (~5 min)
    python benchmarks/hook_instructions.py --paths plain,identity,stay,host,nvme

`hook_cost.py` times the hooks; on a shared 2-core VM its figures move by 20-50 % from run
to run, more than most changes to the hooks. This counts instead: each path runs
hook_cost.py's chain (`sin` saving one fresh tensor per op, CPU, 1 thread) in a process under
`valgrind --tool=callgrind`, once with `--small` and once with `--large` tensors per step
(3 steps each, after a warm-up step and `gc.freeze()`, so the garbage collector walks only
what the steps made and no full collection of torch's own objects lands in one run and not
the other); the difference of the two totals over the difference in saved tensors is what
one saved tensor costs, import and set-up cancelling out. The table gives it above plain
autograd. Two runs of the same code agree within ~1 %: a change of a few hundred
instructions per save shows.

Instructions are not time: memory stalls (the collector walking objects, cache misses)
cost time that no instruction count shows, so take the times from hook_cost.py and use
this to see which way, and by how much, a change moved the work. On this project's dev VM,
~5,000 instructions are ~1 µs of the hooks' Python and C. Only the training thread is
counted (the nvme tier's I/O threads apart); nvme's count still moves by a few thousand
between runs (its waits depend on the I/O threads). Needs valgrind (apt-get install
valgrind).
"""
from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
import os
import subprocess
import sys
import tempfile

PATHS = ("plain", "identity", "stay", "host", "nvme")


def child(path: str, n: int, nvme_dir: str) -> None:
    """One process under valgrind: a warm-up step, then 3 steps of `n` saved tensors."""
    import contextlib
    import gc

    import torch

    import offload
    from hook_cost import chain

    torch.set_num_threads(1)
    torch.manual_seed(0)
    make = {
        "plain": contextlib.nullcontext,
        "identity": lambda: torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                     lambda t: t),
        "stay": lambda: offload.activations(tiers="host"),   # the default min_bytes
        "host": lambda: offload.activations(tiers="host", min_bytes=0),
        "nvme": lambda: offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0),
    }[path]
    x0 = torch.randn(256)   # 1 KiB: the tensor's size changes the op, not the hooks

    def step(count: int) -> None:
        x = x0.detach().requires_grad_()
        with make():
            chain(x, count).sum().backward()

    step(50)
    gc.collect()
    gc.freeze()
    for _ in range(3):
        step(n)


def count(path: str, n: int, nvme_dir: str) -> int:
    """The training thread's instructions (the tier's I/O threads apart: valgrind runs
    threads one at a time, so theirs move with its scheduling)."""
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    here = os.path.dirname(os.path.abspath(__file__))
    with tempfile.TemporaryDirectory(prefix="offload-callgrind-") as out_dir:
        prefix = os.path.join(out_dir, "out")
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={prefix}",
               "--separate-threads=yes", "--cache-sim=no", sys.executable,
               os.path.abspath(__file__), "--child", path, str(n), nvme_dir]
        run = subprocess.run(cmd, env=env, cwd=here, capture_output=True, text=True)
        try:
            with open(prefix + "-01") as f:   # thread 1: the one that runs the steps
                for line in f:
                    if line.startswith("summary:"):
                        return int(line.split()[1])
        except OSError:
            pass
    raise SystemExit(f"valgrind gave no count for {path} ({n}): {run.stderr[-2000:]}")


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default="plain,stay,host",
                    help=f"comma-separated, from {','.join(PATHS)} (plain is always run)")
    ap.add_argument("--small", type=int, default=200, help="saved tensors per step, first run")
    ap.add_argument("--large", type=int, default=1200, help="saved tensors per step, second run")
    ap.add_argument("--nvme-dir", default=os.environ.get("OFFLOAD_NVME_DIR", "/var/tmp"),
                    help="parent directory of the nvme tier's temporary directory")
    args = ap.parse_args()
    paths = ["plain"] + [p for p in args.paths.split(",") if p and p != "plain"]
    for p in paths:
        if p not in PATHS:
            ap.error(f"--paths: unknown path {p!r}; choose from {', '.join(PATHS)}")
    if not 0 < args.small < args.large:
        ap.error(f"--small={args.small} --large={args.large}: need 0 < small < large")
    if subprocess.run(["valgrind", "--version"], capture_output=True).returncode != 0:
        ap.error("valgrind is not installed (apt-get install valgrind)")
    runs = [(p, n) for p in paths for n in (args.small, args.large)]
    print(f"{len(runs)} runs under valgrind, {os.cpu_count()} at a time (about a minute "
          "each) ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="offload-hookinstr-", dir=args.nvme_dir) as nvme, \
            ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        counts = dict(zip(runs, pool.map(lambda run: count(*run, nvme), runs)))
    per_save = {p: (counts[p, args.large] - counts[p, args.small])
                / (3 * (args.large - args.small)) for p in paths}
    print(f"\ninstructions per saved tensor on the training thread (callgrind; {args.small} "
          f"vs {args.large} saved 1 KiB tensors a step, 3 steps; plain: absolute, others: "
          f"above plain)\n")
    print("| path | instructions |")
    print("|---|---|")
    for p, v in per_save.items():
        value = v if p == "plain" else v - per_save["plain"]
        print(f"| {p} | {value / 1000:.1f} k |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
