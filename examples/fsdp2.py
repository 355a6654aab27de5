"""FSDP2 (`fully_shard` per transformer block) with activation offload, under torchrun.

    torchrun --nproc-per-node 8 examples/fsdp2.py --nvme-dir '/mnt/nvme/{rank}'
    torchrun --standalone --nproc-per-node 2 examples/fsdp2.py --check

FSDP2 shards the weights; offload moves the activations. The two do not meet: the
unsharded weights FSDP2 gathers for a block are parameters, which offload never moves, and
the sharded ones are DTensors, which it leaves alone too. Everything else is as in
examples/ddp_torchrun.py.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import offload
from offload.config import parse_nvme_dirs
from offload.models import GPT, GPTConfig


def say(line: str) -> None:
    """One line from this rank in one write, so lines of several ranks never interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--tiers", default=os.environ.get("OFFLOAD_TIERS", "host,nvme"))
    p.add_argument("--nvme-dir", default=os.environ.get("OFFLOAD_NVME_DIR",
                                                        "/var/tmp/offload-fsdp2/{rank}"))
    p.add_argument("--check", action="store_true",
                   help="train again without offload and compare the weights bit for bit")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, os.cpu_count() // int(os.environ["LOCAL_WORLD_SIZE"])))
    dist.init_process_group("nccl" if cuda else "gloo")
    made = [d for d in parse_nvme_dirs(args.nvme_dir) if not os.path.isdir(d)]
    for d in made:
        os.makedirs(d)
    try:
        weights = train(args, device, use_offload=True)
        offload.empty_cache()
        if args.check:
            plain = train(args, device, use_offload=False)
            same = all(torch.equal(a, b) for a, b in zip(weights, plain))
            say(f"rank {dist.get_rank()}: weights vs no offload: "
                f"{'bit-exact' if same else 'DIFFERENT'}")
            if not same:
                raise SystemExit(1)
    finally:
        for d in made:
            os.rmdir(d)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
