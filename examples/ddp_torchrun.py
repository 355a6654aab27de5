"""Data-parallel training launched with torchrun; every rank offloads to its own directory.

    torchrun --nproc-per-node 8 examples/ddp_torchrun.py --nvme-dir '/mnt/nvme/{rank}'
    torchrun --standalone --nproc-per-node 2 examples/ddp_torchrun.py --check

`{rank}` (and `{local_rank}`) in the NVMe directory expand per process, so ranks never
share slab files. A percentage capacity (the default 50 % for OFFLOAD_HOST_BYTES and
OFFLOAD_NVME_BYTES) is divided among the processes of the host (LOCAL_WORLD_SIZE, which
torchrun sets): 8 ranks take 50 % between them, not 50 % each. A size such as 8GiB is per
rank. With OFFLOAD_LOG=INFO the per-step line comes from rank 0 (OFFLOAD_LOG_RANKS=all for
every rank). Each rank prints the capacities it got and what it moved.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import offload
from offload.bench.models import GPT, GPTConfig
from support import (check_weights, example_parser, rank_dirs, remove_dirs, say,
                     torchrun_device)


def train(args, device: torch.device, use_offload: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = GPT(GPTConfig(hidden=args.hidden, layers=args.layers, heads=args.heads,
                          seq_len=args.seq_len)).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4)
    rank = dist.get_rank()
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    torch.manual_seed(1000 + rank)                     # and its own dropout masks
    ctx = offload.activations(model=model, tiers=args.tiers, nvme_dir=args.nvme_dir,
                              enabled=use_offload)
    moved = {"host": 0, "nvme": 0, "kept": 0}
    for _ in range(args.steps):
        idx, targets = model.example_batch(args.batch, device, generator=data)
        with ctx:
            logits = ddp(idx)
            F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for tier in moved:
            moved[tier] += getattr(ctx.stats, f"{tier}_bytes")
    if use_offload:
        s, mib = ctx.stats, 1 << 20
        say(f"rank {rank}/{dist.get_world_size()} (local {os.environ.get('LOCAL_RANK')} of "
            f"{os.environ.get('LOCAL_WORLD_SIZE')}): host capacity "
            f"{s.host_capacity_bytes / mib:.1f} MiB, nvme capacity "
            f"{s.nvme_capacity_bytes / mib:.1f} MiB; over {args.steps} steps kept "
            f"{moved['kept'] / mib:.0f} MiB, host {moved['host'] / mib:.0f} MiB, nvme "
            f"{moved['nvme'] / mib:.0f} MiB")
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    p = example_parser(__doc__, steps=5, tiers="host,nvme")
    p.add_argument("--nvme-dir", default=os.environ.get("OFFLOAD_NVME_DIR",
                                                        "/var/tmp/offload-ddp/{rank}"))
    args = p.parse_args()

    device = torchrun_device()
    made = rank_dirs(args.nvme_dir)
    try:
        weights = train(args, device, use_offload=True)
        offload.empty_cache()  # close this rank's slab files now
        if args.check:
            check_weights(weights, train(args, device, use_offload=False),
                          f"rank {dist.get_rank()}: weights vs no offload")
    finally:
        remove_dirs(made)  # fails if anything was left behind (nothing should be)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
