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
from offload.bench.models import GPT, ConvNet, GPTConfig, MLP

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


def _batch(name: str, step: int, scale: int = 1):
    g = torch.Generator().manual_seed(1000 + step)
    if name == "mlp":
        n = 32 * scale
        return torch.randn(n, 64, generator=g), torch.randint(10, (n,), generator=g)
    if name == "convnet":
        n = 4 * scale
        return torch.randn(n, 3, 16, 16, generator=g), torch.randint(10, (n,), generator=g)
    idx = torch.randint(128, (2 * scale, 32), generator=g)
    return idx, torch.randint(128, (2 * scale, 32), generator=g)


def _loss(name: str, model, batch, checkpoint_blocks=False):
    x, y = batch
    if name == "gpt":
        return model.loss(x, y, checkpoint_blocks=checkpoint_blocks)
    return torch.nn.functional.cross_entropy(model(x), y)


def train(name: str, steps: int, ctx_kwargs: dict | None, *, bf16: bool = False,
          fp16: bool = False, checkpoint_blocks: bool | str = False, pass_model: bool = False,
          batch_scale: int = 1):
    """Train from a fixed seed; return (per-step grads, final state, per-step stats).

    The final state holds the weights, the buffers and the optimizer's state (AdamW's moments
    and step counts) and, with `fp16`, the GradScaler's scale: all must match.
    """
    torch.manual_seed(0)
    model = MODELS[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if fp16 else None
    grads, stats = [], []
    for step in range(steps):
        batch = _batch(name, step, batch_scale)
        opt.zero_grad(set_to_none=True)
        if ctx_kwargs is None:
            ctx = contextlib.nullcontext()
        else:
            ctx = offload.activations(**ctx_kwargs, model=model if pass_model else None)
        with ctx:
            with torch.autocast("cpu", dtype=torch.float16 if fp16 else torch.bfloat16,
                                enabled=bf16 or fp16):
                loss = _loss(name, model, batch, checkpoint_blocks)
            (scaler.scale(loss) if scaler else loss).backward()
        if ctx_kwargs is not None:
            stats.append(ctx.stats)
        grads.append([p.grad.clone() for p in model.parameters()])
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for i, per_param in opt.state_dict()["state"].items():
        state.update({f"optimizer.{i}.{k}": torch.as_tensor(v).clone()
                      for k, v in per_param.items()})
    if scaler:
        state["scaler.scale"] = scaler.get_scale() * torch.ones(())
    return grads, state, stats


_baselines: dict = {}


def baseline(name, steps, **kw):
    key = (name, steps, tuple(sorted(kw.items())))
    if key not in _baselines:
        _baselines[key] = train(name, steps, None, **kw)[:2]
    return _baselines[key]


def assert_same(ref, got):
    (ref_grads, ref_state), (grads, state) = ref, got
    for step, (a, b) in enumerate(zip(ref_grads, grads)):
        for i, (ga, gb) in enumerate(zip(a, b)):
            assert ga.dtype == gb.dtype and torch.equal(ga, gb), f"grad {i} differs at step {step}"
    assert ref_state.keys() == state.keys()
    for k in ref_state:
        assert torch.equal(ref_state[k], state[k]), f"{k} differs after training"


def assert_moved(stats_per_step, tiers):
    """Every step put bytes in each tier it names (a case that moves nothing tests `keep`)."""
    for step, s in enumerate(stats_per_step):
        if "host" in tiers:
            assert s.host_bytes > 0, f"step {step}: nothing went to the host tier"
        if "nvme" in tiers:
            assert s.nvme_bytes > 0 and s.nvme_written_bytes > 0, \
                f"step {step}: nothing went to the nvme tier"
            assert s.nvme_read_bytes >= s.nvme_bytes   # everything written came back
        assert s.exit_nvme_used_bytes == 0 and s.exit_host_used_bytes == 0


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
@pytest.mark.parametrize("tiers", ["host", "nvme", "host,nvme"])
@pytest.mark.parametrize("name", list(MODELS))
def test_offload_is_bit_exact(name, tiers, bf16, nvme_dir):
    steps = 2
    got = train(name, steps, _kwargs(tiers, 0, nvme_dir), bf16=bf16)
    assert_same(baseline(name, steps, bf16=bf16), got[:2])
    assert_moved(got[2], tiers)
    for s in got[2]:
        # Everything eligible moved: no model=, so no round-trip plan keeps anything.
        assert s.kept_bytes == 0 and s.round_trip_kept_bytes == 0


@pytest.mark.parametrize("tiers", ["host", "nvme"])
def test_default_settings_move_bytes_and_are_bit_exact(tiers, nvme_dir):
    """The default OFFLOAD_MIN_BYTES (256 KiB) with activations above it (batch x16)."""
    got = train("mlp", 2, _kwargs(tiers, None, nvme_dir), batch_scale=16)
    assert_same(baseline("mlp", 2, batch_scale=16), got[:2])
    assert_moved(got[2], tiers)
    assert all(s.kept_bytes > 0 for s in got[2])     # the small ones stayed


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_keep_policy_is_bit_exact(name, bf16):
    got = train(name, 2, {"policy": "keep", "min_bytes": 0}, bf16=bf16)
    assert_same(baseline(name, 2, bf16=bf16), got[:2])
    for s in got[2]:
        assert s.kept_bytes == s.saved_bytes > 0 and s.host_bytes == s.nvme_bytes == 0


def test_fp16_autocast_with_grad_scaler_is_bit_exact(nvme_dir):
    got = train("gpt", 3, _kwargs("nvme", 0, nvme_dir), fp16=True)
    assert_same(baseline("gpt", 3, fp16=True), got[:2])
    assert_moved(got[2], "nvme")


# ---------------------------------------------------------------- 20 steps per model
@pytest.mark.parametrize("name", list(MODELS))
def test_twenty_steps_nvme_min0(name, nvme_dir):
    got = train(name, 20, _kwargs("host,nvme", 0, nvme_dir))
    assert_same(baseline(name, 20), got[:2])
    assert_moved(got[2], "host,nvme")


def test_twenty_steps_gpt_bf16_nvme(nvme_dir):
    got = train("gpt", 20, _kwargs("nvme", 0, nvme_dir), bf16=True)
    assert_same(baseline("gpt", 20, bf16=True), got[:2])
    assert_moved(got[2], "nvme")


@pytest.mark.parametrize("name", ["gpt", "convnet"])
def test_model_given_learns_a_round_trip_plan_and_stays_bit_exact(name, nvme_dir, monkeypatch):
    """With model= the round-trip plan is shared across steps: from the second step on it keeps
    what would bounce (placement.py). Twelve steps with that plan active, and the moves.

    The plan comes from measured speeds and gaps; on these tiny models whether anything
    bounces at full disk speed depends on the machine's load (CI saw an empty plan). The
    measured link is made slow (1 MB/s each way, as test_bounce_placement does), so the end
    of the forward bounces on any machine and the keep plan is exercised every step."""
    from offload.util.stats import Stats

    monkeypatch.setattr(Stats, "nvme_write_gbps", property(lambda self: 0.001))
    monkeypatch.setattr(Stats, "nvme_read_gbps", property(lambda self: 0.001))
    got = train(name, 12, _kwargs("nvme", 0, nvme_dir), pass_model=True)
    assert_same(baseline(name, 12), got[:2])
    assert_moved(got[2], "nvme")
    assert got[2][0].round_trip_kept_bytes == 0                  # nothing learned yet
    assert all(s.round_trip_kept_bytes > 0 for s in got[2][1:]), "the keep plan stayed empty"
    for s in got[2]:
        assert s.kept_bytes == s.round_trip_kept_bytes


# ---------------------------------------------------------------- torch.utils.checkpoint
@pytest.mark.parametrize("kind", [True, "reentrant"], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("tiers", ["host", "nvme"])
def test_checkpointed_gpt_is_bit_exact(tiers, kind, nvme_dir):
    got = train("gpt", 3, _kwargs(tiers, 0, nvme_dir), checkpoint_blocks=kind)
    assert_same(baseline("gpt", 3, checkpoint_blocks=kind), got[:2])
    # The checkpoint regions' inputs are what the outer hooks see (and move).
    assert_moved(got[2], tiers)
    if kind == "reentrant":   # its recompute runs inside backward: those saves stay
        assert all(s.backward_kept_bytes > 0 for s in got[2])


# ---------------------------------------------------------------- two graphs alive
@pytest.mark.parametrize("tiers", ["host", "nvme"])
def test_two_graphs_alive_at_once_are_bit_exact(tiers, nvme_dir):
    """Two micro-batches' graphs alive together (each in its own context), then both
    backwards, in the reverse order; gradients accumulate as without offload."""
    def run(kw):
        torch.manual_seed(0)
        model = MODELS["gpt"]()
        losses, stats = [], []
        for step in range(2):
            ctx = offload.activations(**kw) if kw else contextlib.nullcontext()
            with ctx:
                losses.append(_loss("gpt", model, _batch("gpt", step)))
            stats.append(ctx.stats if kw else None)
        for loss in reversed(losses):
            loss.backward()
        return [p.grad.clone() for p in model.parameters()], stats

    ref, _ = run(None)
    got, stats = run(_kwargs(tiers, 0, nvme_dir))
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert_moved(stats, tiers)


# ---------------------------------------------------------------- heap modes, huge pages
_SUBPROCESS_CHECK = r"""
import sys, torch
sys.path.insert(0, sys.argv[2])
import test_runtime_grads as T
got = T.train("gpt", 3, T._kwargs("nvme", 0, sys.argv[1]))
T.assert_same(T.baseline("gpt", 3), got[:2])
T.assert_moved(got[2], "nvme")
print("bit-exact", got[2][-1].nvme_written_bytes)
"""


@pytest.mark.parametrize("env", [{"OFFLOAD_CPU_HEAP": "release"},
                                 {"THP_MEM_ALLOC_ENABLE": "1"}], ids=["release-heap", "thp"])
def test_heap_modes_and_huge_pages_are_bit_exact(env, nvme_dir):
    """torch reads THP_MEM_ALLOC_ENABLE once, at its first allocation: a fresh process."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SUBPROCESS_CHECK, nvme_dir,
                          os.path.dirname(__file__)],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("bit-exact")


def test_tensors_larger_than_the_staging_arena_are_bit_exact(nvme_dir):
    """Storages of 2 MiB against a 1 MiB staging arena and read-ahead: writes go out in
    place, reads land outside the arena; gradients bit-exact, bytes on nvme."""
    kw = {**_kwargs("nvme", 0, nvme_dir), "staging_bytes": "1MiB", "prefetch_bytes": "1MiB"}
    got = train("mlp", 3, kw, batch_scale=64)           # 2048 x 256 fp32 = 2 MiB
    assert_same(baseline("mlp", 3, batch_scale=64), got[:2])
    assert_moved(got[2], "nvme")
