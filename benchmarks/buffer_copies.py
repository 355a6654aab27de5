"""What `recompute` pays to keep a block's buffers exact across its re-run.

    python benchmarks/buffer_copies.py                   # CPU, 1 thread
    python benchmarks/buffer_copies.py --buffer-mib 16 --rounds 15 --device cuda

`recompute` copies every buffer of a checkpointed block at each call, holds the copies
until the block's re-run and runs the re-run on fresh copies of them
(offload/schedule/buffers.py NOTE [Buffers in a re-run]). Three
models of 8 blocks, each step timed under plain training, torch's own non-reentrant
checkpoint per block (which copies nothing, and counts BatchNorm's batches twice), and
`offload.activations(policy="recompute")`, in turn in every round (alternating, so drift
hits all alike); the table gives medians of the step's wall time:

| model | what it is |
|---|---|
| batchnorm | conv 3x3 + BatchNorm + ReLU blocks: a few small buffers that change every call |
| static buffer | a Linear per block and a table of `--buffer-mib` registered as a buffer that never changes |
| static attribute | the same table held as a plain attribute: not a buffer, nothing copied |

The last two differ only in the copies, so their `recompute` times say what a large
buffer costs per call; `peak MiB` is the most memory the step held above its start (CUDA)
or is left out (CPU).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import offload


class ConvBN(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return x + torch.relu(self.bn(self.conv(x)))


class WithTable(nn.Module):
    def __init__(self, d: int, table_mib: float, as_buffer: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        table = torch.randn(max(d, int(table_mib * 2**20) // 4))
        if as_buffer:
            self.register_buffer("table", table)
        else:
            self.table = table

    def forward(self, x):
        return x + torch.tanh(self.lin(x) + self.table[: x.shape[-1]])


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], checkpointed: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.checkpointed = checkpointed

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return x.pow(2).mean()


def models(args, device) -> dict[str, tuple[Stack, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    conv = Stack([ConvBN(32) for _ in range(8)]).to(device)
    d = 256
    return {
        "batchnorm": (conv, torch.randn(8, 32, 32, 32, generator=gen).to(device)),
        "static buffer": (Stack([WithTable(d, args.buffer_mib, True) for _ in range(8)]).to(device),
                          torch.randn(64, d, generator=gen).to(device)),
        "static attribute": (Stack([WithTable(d, args.buffer_mib, False) for _ in range(8)]
                                   ).to(device), torch.randn(64, d, generator=gen).to(device)),
    }


def timed(step, device) -> tuple[float, float | None]:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start_bytes = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - start_bytes) / 2**20 if cuda else None
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buffer-mib", type=float, default=16.0,
                        help="size of each block's table (default 16)")
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds (default 9)")
    parser.add_argument("--steps", type=int, default=3, help="steps per path and round")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on a CPU")
    args = parser.parse_args()
    if args.buffer_mib <= 0:
        parser.error(f"--buffer-mib must be positive, got {args.buffer_mib}")
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device (use --device cpu)")
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    paths = ("plain", "checkpoint", "recompute")
    print(f"# buffer copies: {device}, {args.rounds} rounds x {args.steps} steps, "
          f"tables of {args.buffer_mib:g} MiB, torch {torch.__version__}", flush=True)
    rows = []
    for name, (model, x) in models(args, device).items():
        ctx = offload.activations(model=model, policy="recompute", tiers="host")

        def step(path):
            model.zero_grad(set_to_none=True)
            model.checkpointed = path == "checkpoint"
            if path == "recompute":
                with ctx:
                    model(x).backward()
            else:
                model(x).backward()
            model.checkpointed = False

        for path in paths:   # warm-up
            step(path)
        times = {path: [] for path in paths}
        peaks = {path: [] for path in paths}
        for r in range(args.rounds):
            for path in paths:
                for _ in range(args.steps):
                    seconds, peak = timed(lambda: step(path), device)
                    times[path].append(seconds * 1e3)
                    if peak is not None:
                        peaks[path].append(peak)
            print(f"  {name}: round {r + 1}/{args.rounds}", flush=True)
        ctx.close()
        med = {path: statistics.median(v) for path, v in times.items()}
        peak = {path: max(v) for path, v in peaks.items() if v}
        rows.append((name, med, peak))
    cols = "| model | plain ms | checkpoint ms | recompute ms | recompute / checkpoint |"
    cols += " peak MiB (plain / checkpoint / recompute) |" if device.type == "cuda" else ""
    print("\n" + cols + "\n" + "|---" * cols.count(" |") + "|")
    for name, med, peak in rows:
        line = (f"| {name} | {med['plain']:.2f} | {med['checkpoint']:.2f} | "
                f"{med['recompute']:.2f} | {med['recompute'] / med['checkpoint']:.2f} |")
        if peak:
            line += f" {peak['plain']:.1f} / {peak['checkpoint']:.1f} / {peak['recompute']:.1f} |"
        print(line)


if __name__ == "__main__":
    main()
