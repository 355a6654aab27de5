"""CPU acceptance runs: no offload vs checkpoint-every-block vs NVMe offload vs `auto`.

Each variant runs in a fresh process (so peak RSS is per process), in rounds whose order
is reversed each round (alternating, so machine-load drift hits all variants alike). A run
does one untimed warm-up step, then `--steps` timed steps. Reported per variant: median
step time with min-max over every timed step of every round, peak RSS of the process
(ru_maxrss: model, inputs and all steps), the peak of its anonymous memory over the timed
steps (peak RSS less file-backed pages, which depend on the page cache: see
offload/bench/measure.py `peak_anon_rss_bytes`), and for the offload variant the runtime's stall
time and overlap fraction; each variant's step time over `none`'s in the same round.

Gradients: every step of every run reseeds the RNG the same way, so every step of every
variant computes the same gradients (same weights, batch and dropout masks; nothing updates
the weights). A CRC of every parameter's gradient is taken after each step, untimed ones
included, and compared with `none`'s (or, without `none`, with the first variant's): the
last line says "bit-identical" or names what differs, and the exit status is 1 on a
difference.

    python benchmarks/pipeline_bench.py --nvme-dir /var/tmp --rounds 3 --steps 3
    python benchmarks/pipeline_bench.py --variants none,recompute,offload-nvme,auto \
        --budget 30% --nvme-max-bw 500MB         # issue 11: auto against both, capped disk

Environment variables OFFLOAD_* reach the offload variants unchanged (e.g. OFFLOAD_IO_WORKERS).
`auto` runs its warm-up and profile steps, and the trial steps that measure its plan against
the pure strategies (offload/schedule/trials.py NOTE [Trials]), untimed: its timed steps
are what a long run gets once the plan has settled;
its row also gives the plan's kept bytes against the budget, the step's peak resident
activation bytes and the largest block's working set (what one block saves in a plain
forward), and a last line its median over min(recompute, offload-nvme).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

VARIANTS = ("none", "recompute", "offload-nvme", "auto")


def run_one(variant: str, args) -> dict:
    """Run in this (fresh) process and return its measurements."""
    import resource
    import time

    import torch

    import offload
    from offload.bench.measure import grad_hashes, peak_anon_rss_bytes, reset_peak_rss
    from offload.bench.models import GPT, GPTConfig
    from offload.bench.strategies import SETTLE_MAX_STEPS, auto_unsettled

    torch.manual_seed(0)
    cfg = GPTConfig(hidden=args.hidden, layers=args.layers, heads=args.heads, seq_len=args.seq)
    model = GPT(cfg)
    idx, tgt = model.example_batch(args.batch)
    step_s, stall_s, overlap, stats, hashes = [], [], [], {}, []
    untimed = 2 if variant == "auto" else 1
    cap = {"nvme_max_bw": args.nvme_max_bw} if args.nvme_max_bw else {}
    ctx = None
    i = 0
    untimed_peak, peak_reset = 0, False
    while len(step_s) < args.steps:
        # The same wait as offload-bench's auto row (offload/bench/worker.py).
        unsettled = auto_unsettled(ctx) if variant == "auto" else None
        if unsettled and i >= untimed + SETTLE_MAX_STEPS:
            raise RuntimeError(f"auto did not settle in {SETTLE_MAX_STEPS} steps: {unsettled}")
        settled = unsettled is None
        timed = i >= untimed and settled  # warm-up (auto: profile and trial steps) not timed
        if timed and not step_s:     # the kernel's peak from here on is the timed steps'
            untimed_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            peak_reset = reset_peak_rss()
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1000)   # every step draws the same dropout masks, in every variant
        t0 = time.perf_counter()
        if variant in ("offload-nvme", "auto"):
            extra = {"budget": args.budget} if variant == "auto" else {}
            with offload.activations(model=model, tiers="nvme", nvme_dir=args.nvme_dir,
                                     policy="auto" if variant == "auto" else "offload",
                                     **cap, **extra) as ctx:
                model.loss(idx, tgt).backward()
            stats = ctx.stats.as_dict()
        else:
            model.loss(idx, tgt, checkpoint_blocks=variant == "recompute").backward()
        dt = time.perf_counter() - t0
        hashes.append(grad_hashes(model))   # after the clock: not part of the step
        if timed:
            step_s.append(dt)
            if stats:
                stall_s.append(stats["stall_s"])
                overlap.append(stats["overlap_fraction"])
        i += 1
    out = {"variant": variant, "step_s": step_s, "stall_s": stall_s, "overlap": overlap,
           "peak_rss_bytes": max(untimed_peak,
                                 resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
           "timed_peak_anon_bytes": peak_anon_rss_bytes() if peak_reset else None,
           "nvme_bytes": stats.get("nvme_bytes", 0), "grad_hashes": hashes,
           "bounce_kept_bytes": stats.get("bounce_kept_bytes", 0)}
    if variant == "auto" and ctx is not None and ctx.plan is not None:
        plan = ctx.plan
        out.update(plan=str(plan), budget_bytes=plan.params.budget_bytes,
                   kept_bytes=plan.prediction.kept_bytes,
                   peak_resident_bytes=stats.get("peak_resident_bytes"),
                   recomputed_bytes=plan.prediction.recomputed_bytes,
                   mode=plan.mode, measured=plan.measured, untimed_steps=i - len(step_s),
                   block_working_set_bytes=_block_working_set(model, idx))
    return out


def _variants(parser: argparse.ArgumentParser, args) -> list[str]:
    """--variants, checked (an unknown name ran plain autograd under that name), with the
    settings the offload variants use checked before any run (their ConfigError, not a
    worker's traceback)."""
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if not variants:
        parser.error(f"--variants {args.variants!r}: names no variant (give some of "
                     f"{', '.join(VARIANTS)})")
    if unknown:
        hint = " (offload-bench's checkpoint is recompute here, its offload offload-nvme)" \
            if {"checkpoint", "offload"} & set(unknown) else ""
        named = ", ".join(map(repr, unknown))
        parser.error(f"--variants {args.variants!r}: {named} {'are' if len(unknown) > 1 else 'is'}"
                     f" not among {', '.join(VARIANTS)}{hint}")
    if len(set(variants)) != len(variants):
        parser.error(f"--variants {args.variants!r}: a variant is named twice")
    if not os.path.isdir(args.nvme_dir):
        parser.error(f"--nvme-dir {args.nvme_dir!r}: not a directory (point it at a writable "
                     "directory on a local SSD)")
    if {"offload-nvme", "auto"} & set(variants):
        from offload.config import Config
        from offload.errors import ConfigError

        try:
            Config.from_env(policy="auto", tiers="nvme", nvme_dir=args.nvme_dir,
                            budget=args.budget,
                            **({"nvme_max_bw": args.nvme_max_bw} if args.nvme_max_bw
                               else {})).validate()
        except ConfigError as error:
            flags = [flag for name, flag in (("budget=", "--budget: "),
                                             ("nvme_max_bw=", "--nvme-max-bw: "),
                                             ("nvme_dir=", "--nvme-dir: "))
                     if str(error).startswith(name)]   # else an OFFLOAD_* variable's
            parser.error(f"{''.join(flags)}{error}")
    return variants


def _block_working_set(model, idx) -> int:
    """Bytes one block saves in a plain forward (the largest block): what backward holds
    at most for one block while it recomputes or reads it back."""
    import torch

    sizes = []
    x = model.drop(model.tok_emb(idx) + model.pos_emb(torch.arange(idx.shape[1])))
    for block in model.blocks:
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = block(x)
        params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        sizes.append(sum(n for ptr, n in seen.items() if ptr not in params))
        x = y.detach()
    return max(sizes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, of {', '.join(VARIANTS)} (recompute: torch's "
                   "checkpoint of every block)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--nvme-dir", default=os.environ.get("OFFLOAD_NVME_DIR", "/var/tmp"))
    p.add_argument("--budget", default="30%", help="OFFLOAD_BUDGET of the auto variant")
    p.add_argument("--nvme-max-bw", default="",
                   help="OFFLOAD_NVME_MAX_BW of the offload-nvme and auto variants")
    p.add_argument("--json", help="write every run's raw numbers here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("batch", "hidden", "layers", "heads", "seq", "steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: must be at least 1")
    if args.child:
        json.dump(run_one(args.child, args), sys.stdout)
        return 0
    variants = _variants(p, args)
    runs: list[dict] = []
    base = [a for a in (argv if argv is not None else sys.argv[1:])]
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            with tempfile.TemporaryDirectory(prefix="pipeline-bench-", dir=args.nvme_dir) as d:
                cmd = [sys.executable, __file__, *base, "--child", v, "--nvme-dir", d]
                # The run's stderr passes through: its error, if any, is the user's to read.
                done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            if done.returncode != 0:
                sys.stderr.write(f"pipeline_bench: the {v} run (round {r + 1}) failed with "
                                 f"exit status {done.returncode}; its error is above\n")
                return 1
            run = json.loads(done.stdout)
            runs.append(run)
            sys.stderr.write(f"round {r + 1}/{args.rounds} {v}: "
                             f"{statistics.median(run['step_s']):.2f} s/step, peak RSS "
                             f"{run['peak_rss_bytes'] / 2**30:.2f} GiB, timed steps' peak "
                             f"anonymous {_gib(run['timed_peak_anon_bytes'])} GiB\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)
    ref = statistics.median(s for r in runs if r["variant"] == "none" for s in r["step_s"]) \
        if "none" in variants else None
    print(f"GPT h{args.hidden} L{args.layers} heads{args.heads} seq{args.seq} batch "
          f"{args.batch} fp32, {args.rounds} rounds x {args.steps} steps (medians)")
    print("| variant | step s median (min-max) | vs none | peak RSS GiB (median) "
          "| timed steps' peak anonymous RSS GiB (median) | stall s (share of step) "
          "| I/O hidden |")
    print("|---|---|---|---|---|---|---|")
    for v in variants:
        rs = [r for r in runs if r["variant"] == v]
        steps = [s for r in rs for s in r["step_s"]]
        med = statistics.median(steps)
        rss = statistics.median(r["peak_rss_bytes"] for r in rs) / 2**30
        anons = [r["timed_peak_anon_bytes"] for r in rs]
        anon = _gib(statistics.median(anons) if None not in anons else None)
        stalls = [s for r in rs for s in r["stall_s"]]
        stall = (f"{statistics.median(stalls):.2f} ({statistics.median(stalls) / med:.1%})"
                 if stalls else "-")
        ov = [o for r in rs for o in r["overlap"]]
        hidden = f"{statistics.median(ov):.0%}" if ov else "-"
        rel = f"{med / ref:.2f}x" if ref else "-"
        print(f"| {v} | {med:.2f} ({min(steps):.2f}-{max(steps):.2f}) | {rel} | {rss:.2f} "
              f"| {anon} | {stall} | {hidden} |")
    medians = {v: statistics.median(s for r in runs if r["variant"] == v for s in r["step_s"])
               for v in variants}
    by_round = [{run["variant"]: statistics.median(run["step_s"])
                 for run in runs[r * len(variants):(r + 1) * len(variants)]}
                for r in range(args.rounds)]
    if ref:
        for v in variants:
            if v != "none":
                print(f"{v} / none per round: "
                      + ", ".join(f"{got[v] / got['none']:.3f}" for got in by_round))
    grads_ok = _compare_grads(runs, "none" if "none" in variants else variants[0])
    autos = [r for r in runs if r["variant"] == "auto" and "budget_bytes" in r]
    if autos:
        a = autos[-1]
        gib = 2 ** 30
        print(f"auto: plan keeps {a['kept_bytes'] / gib:.2f} GiB of a "
              f"{a['budget_bytes'] / gib:.2f} GiB budget, recomputes "
              f"{a['recomputed_bytes'] / gib:.2f} GiB; peak resident activations "
              f"{max(r['peak_resident_bytes'] for r in autos) / gib:.2f} GiB (every round); "
              f"largest block's working set {a['block_working_set_bytes'] / gib:.2f} GiB")
        print("auto: steps ran " + ("the plan" if a["mode"] == "plan" else a["mode"])
              + f" after {a['untimed_steps']} untimed steps; measured in the trials: "
              + (", ".join(f"{m} {min(t):.2f} s" for m, t in a["measured"].items())
                 or "none (no pure strategy predicted close)"))
        peers = [v for v in ("recompute", "offload-nvme") if v in medians]
        if peers:
            best = min(peers, key=medians.get)
            per_round = [got["auto"] / min(got[v] for v in peers) for got in by_round]
            print(f"auto / min({', '.join(peers)}) = {medians['auto'] / medians[best]:.3f} "
                  f"(medians; best peer {best}); per round: "
                  + ", ".join(f"{x:.3f}" for x in per_round))
        print("auto plan (last round):")
        print(a["plan"])
    return 0 if grads_ok else 1


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.2f}"


def _compare_grads(runs: list[dict], ref_variant: str) -> bool:
    """Every step of every run against the reference variant's first run (module doc)."""
    from offload.bench.measure import compare_grad_hashes

    ref = next(r for r in runs if r["variant"] == ref_variant)["grad_hashes"]
    bad = []
    for run in runs:
        exact, names, _ = compare_grad_hashes(ref, run["grad_hashes"])
        if not exact:
            bad.append(f"{run['variant']}: {', '.join(sorted(names)[:4]) or 'not comparable'}")
    steps = sum(len(r["grad_hashes"]) for r in runs)
    if bad:
        print(f"gradients DIFFER from {ref_variant}'s: " + "; ".join(bad))
        return False
    print(f"gradients: bit-identical to {ref_variant}'s in all {steps} steps of all "
          f"{len(runs)} runs (CRC of every parameter's gradient after each step)")
    return True


if __name__ == "__main__":
    sys.exit(main())
