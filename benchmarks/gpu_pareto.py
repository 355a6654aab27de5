"""Step-time overhead against activation memory removed, per strategy (the scheduler's
Pareto run on a GPU; issue 11).

A Llama-style decoder (RMSNorm, rotary positions, SDPA attention, SwiGLU MLP; built here,
no model library needed), bf16, one process, strategies one after another on the same
weights and batch:

    none            plain autograd (the reference: time, memory, gradients)
    recompute       torch.utils.checkpoint around every layer
    offload-host    offload.activations(tiers="host")
    auto-50/30/15   offload.activations(policy="auto", tiers="host", budget=...)
    sac-matmul      torch's selective checkpointing, saving matmul and attention outputs

Per row: median step time of the timed steps and its overhead over `none`, the peak of
allocated device memory above the step's start (activation memory) and the share of
`none`'s removed, gradients bit-exact against `none` (deterministic kernels, strict where
the device has them). `auto` runs its warm-up and profile steps untimed first.

    python benchmarks/gpu_pareto.py --json pareto.json                 # H200 defaults
    python benchmarks/gpu_pareto.py --device cpu --hidden 64 --layers 2 --seq 64   # smoke
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) \
            * self.weight


def rotate(x, cos, sin):
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Layer(nn.Module):
    def __init__(self, d: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, d, bias=False)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaStyle(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ffn: int, seq: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Layer(d, heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        half = d // heads // 2
        freq = 1.0 / (10000 ** (torch.arange(half).float() / half))
        angle = torch.outer(torch.arange(seq).float(), freq).repeat(1, 2)
        self.register_buffer("cos", angle.cos(), persistent=False)
        self.register_buffer("sin", angle.sin(), persistent=False)
        self.checkpoint_fn = None  # set by the recompute / sac strategies

    def forward(self, ids):
        x = self.embed(ids)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for layer in self.layers:
            if self.checkpoint_fn is None:
                x = layer(x, cos, sin)
            else:
                x = self.checkpoint_fn(layer, x, cos, sin)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())


MATMULS = None


def _sac_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    global MATMULS
    if MATMULS is None:
        aten = torch.ops.aten
        names = ["mm", "addmm", "bmm", "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention",
                 "_scaled_dot_product_flash_attention_for_cpu"]
        MATMULS = {getattr(aten, n).default for n in names if hasattr(aten, n)}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def _ckpt(layer, *args, sac=False):
    extra = {"context_fn": _sac_context} if sac else {}
    return torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False, **extra)


# The values torch accepts as a deterministic cuBLAS workspace (it checks at every GEMM).
DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")


def deterministic_kernels() -> None:
    """Strict deterministic kernels, so the rows can be compared bit for bit (with warn_only
    the flash-attention backward stays non-deterministic, docs/benchmarks.md).

    cuBLAS is deterministic only with a fixed workspace: torch refuses every GEMM under
    use_deterministic_algorithms(True) unless CUBLAS_WORKSPACE_CONFIG says one, and cuBLAS
    reads it when torch creates its handle, so it is set here, before anything starts CUDA.
    """
    config = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS[0])
    if config not in DETERMINISTIC_CUBLAS:
        raise SystemExit(f"gpu_pareto.py: CUBLAS_WORKSPACE_CONFIG={config!r} is not deterministic; "
                         f"unset it or use one of {', '.join(DETERMINISTIC_CUBLAS)}")
    torch.use_deterministic_algorithms(True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--device", default="cuda")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--ffn", type=int, default=0, help="default: 8/3 hidden, rounded to 256")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budgets", default="50%,30%,15%")
    p.add_argument("--strategies", default="none,recompute,offload-host,auto,sac-matmul")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch sees no CUDA device (use --device cpu)")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        deterministic_kernels()   # first: before CUDA starts
    dtype = torch.bfloat16 if cuda else torch.float32
    ffn = args.ffn or (int(8 * args.hidden / 3) + 255) // 256 * 256
    torch.manual_seed(0)
    with device:   # initialized where it runs: a billion parameters take seconds on a CPU
        model = LlamaStyle(args.vocab, args.hidden, args.layers, args.heads, ffn, args.seq)
    model = model.to(dtype=dtype)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device,
                        generator=torch.Generator().manual_seed(1) if not cuda else None)
    for prm in model.parameters():
        prm.grad = torch.zeros_like(prm)

    import offload

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def run(name: str, body, untimed: int) -> dict:
        times, peaks, stats = [], [], None
        for i in range(untimed + args.steps):
            for prm in model.parameters():
                prm.grad.zero_()
            torch.manual_seed(2)
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            stats = body()
            sync()
            if i >= untimed:
                times.append(time.perf_counter() - t0)
                if cuda:
                    peaks.append(torch.cuda.max_memory_allocated(device) - base)
        grads = [prm.grad.clone() for prm in model.parameters()]
        return {"strategy": name, "step_s": statistics.median(times), "times": times,
                "peak_bytes": max(peaks) if peaks else None, "grads": grads, "stats": stats}

    def plain():
        model(ids).backward()

    def under(**settings):
        def body():
            with offload.activations(model=model, **settings) as ctx:
                model(ids).backward()
            body.ctx = ctx
            return ctx.stats.as_dict()
        return body

    rows = []
    wanted = args.strategies.split(",")
    rows.append(run("none", plain, 1))
    if "recompute" in wanted:
        model.checkpoint_fn = _ckpt
        rows.append(run("recompute", plain, 1))
        model.checkpoint_fn = None
    if "offload-host" in wanted:
        rows.append(run("offload-host", under(tiers="host", min_bytes=0), 1))
    plans = {}
    if "auto" in wanted:
        for budget in args.budgets.split(","):
            body = under(policy="auto", tiers="host", budget=budget)
            rows.append(run(f"auto-{budget.rstrip('%')}", body, 2))
            plans[budget] = str(body.ctx.plan)
    if "sac-matmul" in wanted:
        model.checkpoint_fn = functools.partial(_ckpt, sac=True)
        rows.append(run("sac-matmul", plain, 1))
        model.checkpoint_fn = None
    ref = rows[0]
    print(f"Llama-style h{args.hidden} L{args.layers} heads{args.heads} ffn{ffn} seq{args.seq} "
          f"batch{args.batch} {str(dtype).removeprefix('torch.')} on "
          f"{torch.cuda.get_device_name(device) if cuda else 'cpu'}, torch {torch.__version__}")
    print("| strategy | step s | overhead | peak act. mem | removed | grads |")
    print("|---|---|---|---|---|---|")
    out = []
    for r in rows:
        exact = all(torch.equal(a, b) for a, b in zip(r["grads"], ref["grads"]))
        over = r["step_s"] / ref["step_s"] - 1
        removed = None if r["peak_bytes"] is None or not ref["peak_bytes"] \
            else 1 - r["peak_bytes"] / ref["peak_bytes"]
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f} GiB"
        print(f"| {r['strategy']} | {r['step_s']:.4f} | {over:+.1%} | {peak} | "
              f"{'-' if removed is None else f'{removed:.1%}'} | "
              f"{'bit-exact' if exact else 'DIFFERS'} |")
        out.append({k: v for k, v in r.items() if k != "grads"} | {
            "overhead": over, "removed": removed, "bit_exact": exact})
    for budget, text in plans.items():
        print(f"--- auto plan at budget {budget}:\n{text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": out, "plans": plans}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
