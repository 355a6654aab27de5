"""A plain training loop with activation offload.

    python examples/plain_loop.py                      # NVMe tier in a temporary directory
    OFFLOAD_NVME_DIR=/mnt/nvme python examples/plain_loop.py --steps 20
    python examples/plain_loop.py --check              # also train without offload: same weights?

The only change to an ordinary loop is the `with offload.activations(...)` around forward
and backward. Every OFFLOAD_* variable applies (README); keyword arguments win over them.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import torch

import offload
from support import check_weights, example_parser
from offload.bench.models import GPT, GPTConfig


def train(args, nvme_dir: str | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(GPTConfig(hidden=args.hidden, layers=args.layers, heads=args.heads,
                          seq_len=args.seq_len)).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.Generator().manual_seed(1)
    # One context, entered every step: settings are checked once, here, before any work.
    ctx = offload.activations(model=model, tiers=args.tiers, nvme_dir=nvme_dir,
                              enabled=nvme_dir is not None)
    for step in range(args.steps):
        idx, targets = model.example_batch(args.batch, args.device, generator=data)
        with ctx:
            loss = model.loss(idx, targets)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ctx.config.enabled:
            s = ctx.stats
            print(f"step {step}: loss {loss.item():.4f}, saved {s.saved_bytes >> 20} MiB "
                  f"(nvme {s.nvme_bytes >> 20} MiB, host {s.host_bytes >> 20} MiB, kept "
                  f"{s.kept_bytes >> 20} MiB), stall {s.stall_s:.3f} s of {s.step_s:.2f} s")
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    p = example_parser(__doc__, steps=5, tiers="nvme")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch sees no CUDA device (use --device cpu)")

    nvme_dir = os.environ.get("OFFLOAD_NVME_DIR")
    scratch = None if nvme_dir else tempfile.mkdtemp(prefix="offload-example-", dir="/var/tmp")
    try:
        weights = train(args, nvme_dir or scratch)
        offload.empty_cache()  # close the slab files now (they are unlinked already)
        if args.check:
            check_weights(weights, train(args, None))
    finally:
        if scratch:
            shutil.rmtree(scratch)


if __name__ == "__main__":
    main()
