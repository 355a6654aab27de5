"""FSDP2 (`fully_shard` per transformer block) with activation offload, under torchrun.

    torchrun --nproc-per-node 8 examples/fsdp2.py --nvme-dir '/mnt/nvme/{rank}'
    torchrun --standalone --nproc-per-node 2 examples/fsdp2.py --check

FSDP2 shards the weights; offload moves the activations. The two do not meet: the
unsharded weights FSDP2 gathers for a block are parameters, which offload never moves, and
the sharded ones are DTensors, which it leaves alone too. Everything else is as in
examples/ddp_torchrun.py.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import offload
from offload.bench.models import GPT, GPTConfig
from support import (check_weights, example_parser, rank_dirs, remove_dirs, say,
                     torchrun_device)


def train(args, device: torch.device, use_offload: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(hidden=args.hidden, layers=args.layers, heads=args.heads,
                          seq_len=args.seq_len)).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    rank = dist.get_rank()
    data = torch.Generator().manual_seed(100 + rank)
    torch.manual_seed(1000 + rank)
    ctx = offload.activations(model=model, tiers=args.tiers, nvme_dir=args.nvme_dir,
                              enabled=use_offload)
    for step in range(args.steps):
        idx, targets = model.example_batch(args.batch, device, generator=data)
        with ctx:
            logits = model(idx)
            F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if use_offload:
            s, mib = ctx.stats, 1 << 20
            say(f"rank {rank} step {step}: saved {s.saved_bytes / mib:.0f} MiB, nvme "
                f"{s.nvme_bytes / mib:.0f} MiB (capacity {s.nvme_capacity_bytes / mib:.0f} "
                f"MiB), weights never moved: {s.param_bytes / mib:.1f} MiB")
    return [p.to_local().detach().clone() for p in model.parameters()]  # this rank's shards


def main() -> None:
    p = example_parser(__doc__, steps=5, tiers="host,nvme")
    p.add_argument("--nvme-dir", default=os.environ.get("OFFLOAD_NVME_DIR",
                                                        "/var/tmp/offload-fsdp2/{rank}"))
    args = p.parse_args()

    device = torchrun_device()
    made = rank_dirs(args.nvme_dir)
    try:
        weights = train(args, device, use_offload=True)
        offload.empty_cache()
        if args.check:
            check_weights(weights, train(args, device, use_offload=False),
                          f"rank {dist.get_rank()}: weights vs no offload")
    finally:
        remove_dirs(made)  # fails if anything was left behind (nothing should be)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
