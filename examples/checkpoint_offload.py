"""Activation checkpointing and offload together: recompute some blocks, offload the rest.

    python examples/checkpoint_offload.py --checkpoint-every 2   # blocks 0, 2, ... recompute
    python examples/checkpoint_offload.py --check                # same weights as without offload?

A checkpointed block keeps only its input for backward; with non-reentrant checkpointing
(`use_reentrant=False`) that input is saved through the offload hooks like any activation,
so it goes to the tiers too. What the block saves inside goes through checkpoint's own
hooks (the innermost hooks win), so offload never sees it: checkpoint drops it and
recomputes it in backward. The other blocks' activations are offloaded as usual.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import offload
from support import check_weights, example_parser
from offload.bench.models import GPT, GPTConfig


def forward(model: GPT, idx: torch.Tensor, every: int) -> torch.Tensor:
    """GPT.forward with every `every`-th block checkpointed."""
    pos = torch.arange(idx.shape[1], device=idx.device)
    x = model.drop(model.tok_emb(idx) + model.pos_emb(pos))
    for i, block in enumerate(model.blocks):
        x = checkpoint(block, x, use_reentrant=False) if i % every == 0 else block(x)
    return model.head(model.ln_f(x))


def train(args, nvme_dir: str | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(hidden=args.hidden, layers=args.layers, heads=args.heads,
                          seq_len=args.seq_len)).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.Generator().manual_seed(1)
    ctx = offload.activations(model=model, tiers=args.tiers, nvme_dir=nvme_dir,
                              enabled=nvme_dir is not None)
    for step in range(args.steps):
        idx, targets = model.example_batch(args.batch, args.device, generator=data)
        with ctx:
            logits = forward(model, idx, args.checkpoint_every)
            F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ctx.config.enabled:
            s = ctx.stats
            print(f"step {step}: saved {s.saved_bytes >> 20} MiB outside the checkpointed "
                  f"blocks, {s.nvme_bytes >> 20} MiB of it to nvme; stall {s.stall_s:.3f} s")
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    p = example_parser(__doc__, steps=5, tiers="nvme")
    p.add_argument("--checkpoint-every", type=int, default=2,
                   help="checkpoint blocks 0, N, 2N, ... (1: every block; default 2)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch sees no CUDA device (use --device cpu)")
    if args.checkpoint_every < 1:
        p.error(f"--checkpoint-every {args.checkpoint_every}: must be at least 1 (1 checkpoints "
                "every block, 2 every other one)")

    nvme_dir = os.environ.get("OFFLOAD_NVME_DIR")
    scratch = None if nvme_dir else tempfile.mkdtemp(prefix="offload-example-", dir="/var/tmp")
    try:
        weights = train(args, nvme_dir or scratch)
        offload.empty_cache()
        if args.check:
            check_weights(weights, train(args, None))
    finally:
        if scratch:
            shutil.rmtree(scratch)


if __name__ == "__main__":
    main()
