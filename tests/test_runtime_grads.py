"""Bit-exact training with offload on: same gradients and weights as without the context.

Each case trains a small built-in model for a few steps twice from the same seed — once
plainly, once inside `offload.activations(...)` — and compares every gradient of every step
and the final state (weights *and* buffers, e.g. BatchNorm running stats) with torch.equal.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import offload
from offload.models import GPT, ConvNet, GPTConfig, MLP

HAVE_CORE = True
try:
    from offload._ext import load_core

    load_core()
except Exception as exc:  # missing build or missing _ext: the nvme cases cannot run
    HAVE_CORE, CORE_REASON = False, str(exc)

# Small models: the whole file must stay well under two minutes on 2 cores.
MODELS = {
    "mlp": lambda: MLP(d_in=64, hidden=256, depth=3, d_out=10),
    "convnet": lambda: ConvNet(channels=8),
    "gpt": lambda: GPT(GPTConfig(vocab_size=128, hidden=64, layers=2, heads=4, seq_len=32,
                                 dropout=0.1)),
}


def _batch(name: str, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    if name == "mlp":
        return torch.randn(32, 64, generator=g), torch.randint(10, (32,), generator=g)
    if name == "convnet":
        return torch.randn(4, 3, 16, 16, generator=g), torch.randint(10, (4,), generator=g)
    idx = torch.randint(128, (2, 32), generator=g)
    return idx, torch.randint(128, (2, 32), generator=g)


def _loss(name: str, model, batch, checkpoint_blocks=False):
    x, y = batch
    if name == "gpt":
        return model.loss(x, y, checkpoint_blocks=checkpoint_blocks)
    return torch.nn.functional.cross_entropy(model(x), y)


def train(name: str, steps: int, ctx_kwargs: dict | None, *, bf16: bool = False,
          checkpoint_blocks: bool = False, pass_model: bool = False):
    """Train from a fixed seed; return (per-step grads, final state, last stats)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    grads, stats = [], None
    for step in range(steps):
        batch = _batch(name, step)
        opt.zero_grad(set_to_none=True)
        if ctx_kwargs is None:
            ctx = contextlib.nullcontext()
        else:
            ctx = offload.activations(**ctx_kwargs, model=model if pass_model else None)
        with ctx:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = _loss(name, model, batch, checkpoint_blocks)
            loss.backward()
        if ctx_kwargs is not None:
            stats = ctx.stats
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return grads, state, stats


_baselines: dict = {}


def baseline(name, steps, bf16=False, checkpoint_blocks=False):
    key = (name, steps, bf16, checkpoint_blocks)
    if key not in _baselines:
        _baselines[key] = train(name, steps, None, bf16=bf16,
                                checkpoint_blocks=checkpoint_blocks)[:2]
    return _baselines[key]


def assert_same(ref, got):
    (ref_grads, ref_state), (grads, state) = ref, got
    for step, (a, b) in enumerate(zip(ref_grads, grads)):
        for i, (ga, gb) in enumerate(zip(a, b)):
            assert ga.dtype == gb.dtype and torch.equal(ga, gb), f"grad {i} differs at step {step}"
    assert ref_state.keys() == state.keys()
    for k in ref_state:
        assert torch.equal(ref_state[k], state[k]), f"{k} differs after training"


def _kwargs(tiers, min_bytes, nvme_dir, policy="offload"):
    kw = {"policy": policy, "tiers": tiers}
    if min_bytes is not None:
        kw["min_bytes"] = min_bytes
    if "nvme" in tiers:
        if not HAVE_CORE:
            pytest.skip(f"offload._C unavailable: {CORE_REASON}")
        kw.update(nvme_dir=nvme_dir, nvme_bytes="256MiB", staging_bytes="4MiB",
                  prefetch_bytes="1MiB")
        if tiers == "host,nvme":
            kw["host_bytes"] = "64KiB"  # small, so that most storages spill to nvme
    return kw


# ---------------------------------------------------------------- the cross product (short)
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("min_bytes", [None, 0], ids=["min_default", "min0"])
@pytest.mark.parametrize("tiers", ["host", "nvme", "host,nvme"])
@pytest.mark.parametrize("name", list(MODELS))
def test_offload_is_bit_exact(name, tiers, min_bytes, bf16, nvme_dir):
    steps = 2
    got = train(name, steps, _kwargs(tiers, min_bytes, nvme_dir), bf16=bf16)
    assert_same(baseline(name, steps, bf16), got[:2])
    stats = got[2]
    assert stats.saved_bytes > 0 and stats.exit_nvme_used_bytes == 0
    if min_bytes == 0:
        # everything eligible moved, except what the bounce plan keeps (placement.py)
        assert stats.kept_bytes == stats.bounce_kept_bytes
        if "nvme" in tiers:
            assert stats.nvme_bytes > 0 and stats.nvme_read_bytes >= stats.nvme_bytes


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_keep_policy_is_bit_exact(name, bf16):
    got = train(name, 2, {"policy": "keep", "min_bytes": 0}, bf16=bf16)
    assert_same(baseline(name, 2, bf16), got[:2])
    stats = got[2]
    assert stats.kept_bytes == stats.saved_bytes > 0 and stats.host_bytes == 0


# ---------------------------------------------------------------- 20 steps per model
@pytest.mark.parametrize("name", list(MODELS))
def test_twenty_steps_nvme_min0(name, nvme_dir):
    got = train(name, 20, _kwargs("host,nvme", 0, nvme_dir), pass_model=(name == "convnet"))
    assert_same(baseline(name, 20), got[:2])


def test_twenty_steps_gpt_bf16_nvme(nvme_dir):
    got = train("gpt", 20, _kwargs("nvme", None, nvme_dir), bf16=True)
    assert_same(baseline("gpt", 20, bf16=True), got[:2])


# ---------------------------------------------------------------- torch.utils.checkpoint
@pytest.mark.parametrize("tiers", ["host", "nvme"])
def test_checkpointed_gpt_is_bit_exact(tiers, nvme_dir):
    got = train("gpt", 3, _kwargs(tiers, 0, nvme_dir), checkpoint_blocks=True)
    assert_same(baseline("gpt", 3, checkpoint_blocks=True), got[:2])
    # The checkpoint regions' inputs are what the outer hooks see (and move).
    assert got[2].saved_bytes > 0
