"""What watching a checkpointed block for collectives costs `auto` in a job of many ranks.

    python benchmarks/collective_modes.py                  # CPU, 1 thread
    python benchmarks/collective_modes.py --device cuda --rounds 15

In a job of more than one rank, every block `auto` checkpoints runs its forward and its
re-run under two dispatch modes that keep and hand back what a collective left
(offload/schedule/collectives.py NOTE [A re-run calls no collective]); a block calling
none pays only the modes' visit to each op. This times the built-in GPT's step with every
block under torch's non-reentrant checkpoint, without and with those modes (the
`context_fn` auto hands checkpoint), in turn in every round, and prints the medians of the
step's wall time. No process group is needed: the modes are the same on one rank.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from offload.bench.models import GPT, GPTConfig
from offload.schedule import collectives


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256, help="GPT width (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="GPT blocks (default 4)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per row (default 256)")
    parser.add_argument("--batch", type=int, default=4, help="rows per step (default 4)")
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds (default 9)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    args = parser.parse_args()
    for name in ("hidden", "layers", "seq_len", "batch", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device (use --device cpu)")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, hidden=args.hidden, layers=args.layers,
                    heads=max(1, args.hidden // 64), seq_len=args.seq_len, dropout=0.0)
    model = GPT(cfg).to(device)
    idx = torch.randint(256, (args.batch, args.seq_len), device=device)
    watch = [False]

    def checkpointed(forward):
        def run(x):
            extra = {"context_fn": lambda: collectives.modes(lambda op: None, "Block")} \
                if watch[0] else {}
            return checkpoint(forward, x, use_reentrant=False, **extra)
        return run

    for block in model.blocks:
        block.forward = checkpointed(block.forward)

    def step(with_modes: bool) -> float:
        watch[0] = with_modes
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step(False), step(True)   # first calls of kernels and allocations
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for with_modes in (False, True):
            times[with_modes].append(step(with_modes))
    plain, watched = (statistics.median(times[k]) for k in (False, True))
    print(f"# collective modes: {device}, GPT hidden {args.hidden} x {args.layers} blocks, "
          f"batch {args.batch} x {args.seq_len}, {args.rounds} rounds (medians)")
    print("| checkpoint ms | checkpoint + collective modes ms | ratio |")
    print("|---|---|---|")
    print(f"| {plain * 1e3:.2f} | {watched * 1e3:.2f} | {watched / plain:.3f} |")


if __name__ == "__main__":
    main()
