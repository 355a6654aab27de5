"""One training step through an installed offload, on the CPU: host and NVMe tiers, gradients
equal to a step without offload, nothing left on disk. Prints `offload.build_info()`.

    python tools/smoke.py [NVME_BASE_DIR]      # .ci/run runs it in fresh virtual environments
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch

import offload
from offload._build_info import summary


def step(model, x, **settings):
    model.zero_grad(set_to_none=True)
    if settings:
        with offload.activations(model=model, **settings) as ctx:
            model(x).pow(2).mean().backward()
    else:
        ctx = None
        model(x).pow(2).mean().backward()
    return [p.grad.clone() for p in model.parameters()], ctx


def main() -> int:
    print(summary(offload.build_info()))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 256), torch.nn.Tanh())
    x = torch.randn(64, 256)
    ref, _ = step(model, x)
    base = sys.argv[1] if len(sys.argv) > 1 else "/var/tmp"
    with tempfile.TemporaryDirectory(dir=base) as d:
        grads, ctx = step(model, x, tiers="host,nvme", host_bytes="64KiB", nvme_dir=d,
                          min_bytes=0)
        offload.empty_cache()
        left = os.listdir(d)
    if not all(torch.equal(a, b) for a, b in zip(ref, grads)):
        sys.exit("smoke: gradients differ from the step without offload")
    if ctx.stats.nvme_bytes == 0 or left:
        sys.exit(f"smoke: nvme tier unused ({ctx.stats.nvme_bytes} B) or files left: {left}")
    print(f"smoke: bit-exact, {ctx.stats.nvme_bytes} B through nvme, "
          f"{ctx.stats.host_bytes} B kept in host; ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
