"""Issue-4 acceptance on CPU: no offload vs checkpoint-every-block vs NVMe offload.

Each variant runs in a fresh process (so peak RSS is per process), in rounds whose order
is reversed each round (alternating, so machine-load drift hits all variants alike). A run
does one untimed warm-up step, then `--steps` timed steps. Reported per variant: median
step time with min-max over every timed step of every round, peak RSS of the process
(ru_maxrss: model, inputs and the steps), and for the offload variant the runtime's stall
time and overlap fraction.

    python benchmarks/pipeline_bench.py --nvme-dir /var/tmp --rounds 3 --steps 3

Environment variables OFFLOAD_* reach the offload variant unchanged (e.g. OFFLOAD_IO_WORKERS).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

VARIANTS = ("none", "recompute", "offload-nvme")


def run_one(variant: str, args) -> dict:
    """Run in this (fresh) process and return its measurements."""
    import resource
    import time

    import torch

    import offload
    from offload.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(hidden=args.hidden, layers=args.layers, heads=args.heads, seq_len=args.seq)
    model = GPT(cfg)
    idx, tgt = model.example_batch(args.batch)
    step_s, stall_s, overlap, stats = [], [], [], {}
    for i in range(1 + args.steps):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if variant == "offload-nvme":
            with offload.activations(model=model, tiers="nvme", policy="offload",
                                     nvme_dir=args.nvme_dir) as ctx:
                model.loss(idx, tgt).backward()
            stats = ctx.stats.as_dict()
        else:
            model.loss(idx, tgt, checkpoint_blocks=variant == "recompute").backward()
        dt = time.perf_counter() - t0
        if i:  # the first step is the warm-up
            step_s.append(dt)
            if stats:
                stall_s.append(stats["stall_s"])
                overlap.append(stats["overlap_fraction"])
    return {"variant": variant, "step_s": step_s, "stall_s": stall_s, "overlap": overlap,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "nvme_bytes": stats.get("nvme_bytes", 0),
            "bounce_kept_bytes": stats.get("bounce_kept_bytes", 0)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nvme-dir", default=os.environ.get("OFFLOAD_NVME_DIR", "/var/tmp"))
    p.add_argument("--json", help="write every run's raw numbers here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        json.dump(run_one(args.child, args), sys.stdout)
        return 0
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    runs: list[dict] = []
    base = [a for a in (argv if argv is not None else sys.argv[1:])]
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            with tempfile.TemporaryDirectory(prefix="pipeline-bench-", dir=args.nvme_dir) as d:
                cmd = [sys.executable, __file__, *base, "--child", v, "--nvme-dir", d]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            run = json.loads(out)
            runs.append(run)
            sys.stderr.write(f"round {r + 1}/{args.rounds} {v}: "
                             f"{statistics.median(run['step_s']):.2f} s/step, peak RSS "
                             f"{run['peak_rss_bytes'] / 2**30:.2f} GiB\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    ref = statistics.median(s for r in runs if r["variant"] == "none" for s in r["step_s"]) \
        if "none" in variants else None
    print(f"GPT h{args.hidden} L{args.layers} heads{args.heads} seq{args.seq} batch "
          f"{args.batch} fp32, {args.rounds} rounds x {args.steps} steps (medians)")
    print("| variant | step s median (min-max) | vs none | peak RSS GiB (median) "
          "| stall s (share of step) | I/O hidden |")
    print("|---|---|---|---|---|---|")
    for v in variants:
        rs = [r for r in runs if r["variant"] == v]
        steps = [s for r in rs for s in r["step_s"]]
        med = statistics.median(steps)
        rss = statistics.median(r["peak_rss_bytes"] for r in rs) / 2**30
        stalls = [s for r in rs for s in r["stall_s"]]
        stall = (f"{statistics.median(stalls):.2f} ({statistics.median(stalls) / med:.1%})"
                 if stalls else "-")
        ov = [o for r in rs for o in r["overlap"]]
        hidden = f"{statistics.median(ov):.0%}" if ov else "-"
        rel = f"{med / ref:.2f}x" if ref else "-"
        print(f"| {v} | {med:.2f} ({min(steps):.2f}-{max(steps):.2f}) | {rel} | {rss:.2f} "
              f"| {stall} | {hidden} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
