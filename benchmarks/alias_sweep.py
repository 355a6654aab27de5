"""Exactness sweep over common modules on the nvme tier: gradients against plain autograd.

    python benchmarks/alias_sweep.py --trials 15                 # every module below
    python benchmarks/alias_sweep.py --only GRUCell,LSTMCell --trials 1000

Each trial builds the module from a new seed, runs one forward and backward plainly and
once inside `offload.activations(tiers="nvme", min_bytes=0)` (the two cells at ordinary
sizes with the default OFFLOAD_MIN_BYTES instead; every other trial with
OFFLOAD_NVME_CHECKSUM=1), and compares every parameter's and input's gradient with
torch.equal. A trial is *wrong* when a gradient differs, *error* when offload raised. The
class this finds: saved tensors over storages that aliases autograd does not track change
(tensor_meta NOTE [Untracked aliases]; docs/design.md lists what was checked).
Prints one line per module and a total; exits 1 if any trial was wrong or raised.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import offload


def _seq(module, x_shape):
    def run(m, g):
        x = torch.randn(*x_shape, generator=g, requires_grad=True)
        out = m(x)
        out = out[0] if isinstance(out, tuple) else out
        return out.pow(2).sum(), [x]
    return module, run


def _cell(module, hidden, lstm=False, batch=4, features=8):
    def run(m, g):
        x = torch.randn(batch, features, generator=g, requires_grad=True)
        h = torch.randn(batch, hidden, generator=g, requires_grad=True)
        if lstm:
            c = torch.randn(batch, hidden, generator=g, requires_grad=True)
            hy, cy = m(x, (h, c))
            return (hy.pow(2) + cy).sum(), [x, h, c]
        return m(x, h).pow(2).sum(), [x, h]
    return module, run


def _mha():
    def run(m, g):
        x = torch.randn(2, 6, 16, generator=g, requires_grad=True)
        return m(x, x, x)[0].pow(2).sum(), [x]
    return lambda: nn.MultiheadAttention(16, 4, batch_first=True), run


def _sdpa():
    def run(m, g):
        q, k, v = (torch.randn(2, 4, 6, 8, generator=g, requires_grad=True) for _ in range(3))
        return F.scaled_dot_product_attention(q, k, v).pow(2).sum(), [q, k, v]
    return lambda: nn.Identity(), run


def _decoder():
    def run(m, g):
        x = torch.randn(2, 6, 16, generator=g, requires_grad=True)
        mem = torch.randn(2, 5, 16, generator=g, requires_grad=True)
        return m(x, mem).pow(2).sum(), [x, mem]
    return lambda: nn.TransformerDecoderLayer(16, 4, 32, dropout=0.0, batch_first=True), run


def _embbag():
    def run(m, g):
        idx = torch.randint(20, (12,), generator=g)
        return m(idx, torch.tensor([0, 5])).pow(2).sum(), []
    return lambda: nn.EmbeddingBag(20, 8, mode="mean"), run


def _bilinear():
    def run(m, g):
        a = torch.randn(4, 8, generator=g, requires_grad=True)
        b = torch.randn(4, 6, generator=g, requires_grad=True)
        return m(a, b).pow(2).sum(), [a, b]
    return lambda: nn.Bilinear(8, 6, 5), run


def _ctc():
    def run(m, g):
        logits = torch.randn(12, 2, 6, generator=g, requires_grad=True)
        targets = torch.randint(1, 6, (2, 4), generator=g)
        loss = F.ctc_loss(logits.log_softmax(-1), targets, torch.tensor([12, 12]),
                          torch.tensor([4, 3]))
        return loss, [logits]
    return lambda: nn.Identity(), run


MODULES = {
    "GRUCell": _cell(lambda: nn.GRUCell(8, 16), 16),
    "LSTMCell": _cell(lambda: nn.LSTMCell(8, 16), 16, lstm=True),
    "RNNCell": _cell(lambda: nn.RNNCell(8, 16), 16),
    "GRU(bidirectional)": _seq(lambda: nn.GRU(8, 16, 2, bidirectional=True), (5, 3, 8)),
    "LSTM(proj_size)": _seq(lambda: nn.LSTM(8, 16, 2, proj_size=4), (5, 3, 8)),
    "LSTM": _seq(lambda: nn.LSTM(8, 16, 2), (5, 3, 8)),
    "RNN": _seq(lambda: nn.RNN(8, 16, 2), (5, 3, 8)),
    "MultiheadAttention": _mha(),
    "TransformerEncoderLayer": _seq(lambda: nn.TransformerEncoderLayer(
        16, 4, 32, dropout=0.0, batch_first=True), (2, 6, 16)),
    "TransformerDecoderLayer": _decoder(),
    "scaled_dot_product_attention": _sdpa(),
    "Conv+BN+ReLU(inplace)": _seq(lambda: nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(inplace=True)), (2, 3, 10, 10)),
    "GroupNorm+SiLU+Upsample": _seq(lambda: nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.SiLU(), nn.Upsample(scale_factor=2)),
        (2, 3, 8, 8)),
    "ConvTranspose": _seq(lambda: nn.ConvTranspose2d(3, 4, 3, stride=2), (2, 3, 6, 6)),
    "EmbeddingBag": _embbag(),
    "GLU+PReLU": _seq(lambda: nn.Sequential(nn.Linear(8, 16), nn.GLU(), nn.PReLU()), (4, 8)),
    "Bilinear": _bilinear(),
    "CTC loss": _ctc(),
    # Ordinary sizes, run with the default OFFLOAD_MIN_BYTES (see DEFAULT_SETTINGS).
    "GRUCell-512x1024": _cell(lambda: nn.GRUCell(512, 1024), 1024, batch=64, features=512),
    "LSTMCell-512x1024": _cell(lambda: nn.LSTMCell(512, 1024), 1024, lstm=True, batch=64,
                                features=512),
}
DEFAULT_SETTINGS = {"GRUCell-512x1024", "LSTMCell-512x1024"}  # no min_bytes=0


def _grads(make, run, seed, ctx_kwargs):
    torch.manual_seed(seed)
    m = make()
    g = torch.Generator().manual_seed(seed)
    ctx = offload.activations(**ctx_kwargs) if ctx_kwargs is not None else None
    if ctx is not None:
        with ctx:
            loss, inputs = run(m, g)
            loss.backward()
    else:
        loss, inputs = run(m, g)
        loss.backward()
    return [p.grad for p in m.parameters() if p.grad is not None] + [x.grad for x in inputs]


def sweep(name: str, trials: int, nvme_dir: str, nvme_bytes: str) -> tuple[int, int]:
    make, run = MODULES[name]
    wrong = errors = 0
    for trial in range(trials):
        ref = _grads(make, run, trial, None)
        kw = {"tiers": "nvme", "nvme_dir": nvme_dir, "nvme_bytes": nvme_bytes,
              "nvme_checksum": trial % 2 == 1}
        if name not in DEFAULT_SETTINGS:
            kw["min_bytes"] = 0
        try:
            got = _grads(make, run, trial, kw)
        except Exception as exc:  # noqa: BLE001 - counted and shown
            errors += 1
            print(f"  {name} trial {trial}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        wrong += not all(torch.equal(a, b) for a, b in zip(ref, got))
    return wrong, errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=15, help="trials per module (default 15)")
    ap.add_argument("--only", default="", help="comma-separated module names (default: all)")
    ap.add_argument("--nvme-dir", default=os.environ.get("OFFLOAD_TEST_DIR", "/var/tmp"),
                    help="parent of the temporary NVMe directory (a real disk)")
    ap.add_argument("--nvme-bytes", default="4GiB",
                    help="the nvme tier's capacity (default 4GiB: other processes on a shared "
                         "disk keep their room)")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(MODULES)
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        ap.error(f"--only: unknown module(s) {unknown}; choose from {list(MODULES)}")
    total_wrong = total_errors = 0
    with tempfile.TemporaryDirectory(prefix="offload-sweep-", dir=args.nvme_dir) as d:
        for name in names:
            start = time.perf_counter()
            wrong, errors = sweep(name, args.trials, d, args.nvme_bytes)
            total_wrong += wrong
            total_errors += errors
            print(f"{name:30s} wrong {wrong:4d}  errors {errors:4d}  of {args.trials} "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
        offload.empty_cache()
    print(f"total: {total_wrong} wrong, {total_errors} errors "
          f"in {len(names) * args.trials} trials")
    return 1 if total_wrong or total_errors else 0


if __name__ == "__main__":
    sys.exit(main())
