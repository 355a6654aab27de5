"""Resources that live across steps, on a real GPU (conftest skips `cuda` tests elsewhere).

Streams and pinned arenas are made once and reused by every step (copies Note 13,
tiers/pool.py), so over 40 steps the caching allocator's reserved memory stays flat after
the first steps. A run that makes a new prefetch stream per step (as each step did before)
shows the test can see the difference: reserved memory then grows by about one step's
reloaded bytes per step.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import offload
from offload.tiers import copies as cuda_streams
from offload.tiers import cuda_backend
from offload._ext import load_core

pytestmark = pytest.mark.cuda

STEPS = 40
WARMUP = 3   # steps before the allocator has seen the whole step once (reserved may grow)


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(1024, 1024), nn.GELU()]
    return nn.Sequential(*layers).cuda()


def _train(settings: dict, steps: int = STEPS) -> tuple[list[int], int]:
    """Train `steps` steps; returns memory_reserved() after each, and the bytes the last step
    brought back to the device (reloads allocated on the prefetch stream)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(1)
    reserved, reloaded = [], 0
    for _ in range(steps):
        x = torch.randn(2048, 1024, device="cuda", generator=g)   # 8 MiB per activation
        with offload.activations(model=model, **settings) as ctx:
            model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
        reloaded = ctx.stats.h2d_bytes or ctx.stats.nvme_read_bytes
    return reserved, reloaded


def _settings(tiers: str, nvme_dir: str) -> dict:
    s = {"tiers": tiers, "min_bytes": 0}
    if tiers == "nvme":
        s["nvme_dir"] = nvme_dir
    return s


@pytest.mark.parametrize("tiers", ["host", "nvme"])
def test_reserved_memory_is_flat_over_40_steps(tiers, nvme_dir):
    torch.cuda.empty_cache()
    reserved, reloaded = _train(_settings(tiers, nvme_dir))
    assert reloaded > 0
    mib = [r >> 20 for r in reserved]
    # Flat: after the warm-up, all 37 later steps together grew it by less than what one
    # step reloads (a new prefetch stream per step grows it by about that much per step).
    assert reserved[-1] - reserved[WARMUP] < reloaded, mib
    assert max(reserved[WARMUP:]) - reserved[WARMUP] < reloaded, mib


def test_a_new_prefetch_stream_per_step_would_grow_reserved_memory(monkeypatch):
    """What the test above guards against, made on purpose: it must show growth."""
    monkeypatch.setattr(cuda_streams._TorchCuda, "copy_streams",
                        lambda self, device: (torch.cuda.Stream(device), torch.cuda.Stream(device)))
    torch.cuda.empty_cache()
    reserved, reloaded = _train(_settings("host", ""), steps=12)
    assert reserved[-1] - reserved[WARMUP] >= 4 * reloaded, [r >> 20 for r in reserved]


def test_streams_and_pinned_arenas_are_made_once(nvme_dir, monkeypatch):
    core = load_core()
    made = []
    real = core.HostArena

    def counting(*args, **kwargs):
        made.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(core, "HostArena", counting)
    offload.empty_cache()   # nothing pooled by earlier tests
    settings = {"tiers": "host,nvme", "host_bytes": "64MiB", "nvme_dir": nvme_dir, "min_bytes": 0}
    _train(settings, steps=1)
    first_step = len(made)
    device = torch.device("cuda", torch.cuda.current_device())
    pair = cuda_backend._streams[device]
    _train(settings, steps=9)
    assert first_step >= 1 and len(made) == first_step, made
    assert cuda_backend._streams[device] is pair
    offload.empty_cache()


def test_build_info_on_the_gpu():
    info = offload.build_info()
    assert info["gpu_usable"], info
    assert info["build_flavour"] == "cuda-dlopen" and info["cuda_compiled"]
    runtime = info["cuda_runtime"]
    assert os.path.basename(runtime["path"]).startswith("libcudart.so"), runtime
    # the runtime torch loaded: same major version as torch's CUDA
    assert runtime["runtime_version"] // 1000 == int(torch.version.cuda.split(".")[0]), runtime
    assert runtime["driver_version"] > 0, runtime


class _Normed(nn.Module):
    """Linear, BatchNorm and dropout."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.bn, self.drop = nn.BatchNorm1d(d), nn.Dropout(0.1)

    def forward(self, x):
        return x + self.bn(self.down(self.drop(torch.relu(self.up(x)))))


_SLOW = ("compute_gflops=100,dispatch_op_s=1e-6,nvme_write_gbps=1e-4,nvme_read_gbps=1e-4,"
         "nvme_issue_s=1e-6,d2h_gbps=1e-4,h2d_gbps=1e-4,copy_issue_s=1e-6")


def _side_by_side(compiled: bool, loss, monkeypatch, tmp_path):
    """Six steps of `loss` plainly and under `auto` (slow figures: it recomputes), gradients
    and buffers bit-exact at each; the last context."""
    import copy

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Sequential(*[_Normed(256) for _ in range(3)]))
    model = model.cuda()
    plain = copy.deepcopy(model)
    if compiled:
        for m in (model, plain):
            for i in range(3):
                m[1][i] = torch.compile(m[1][i], backend="aot_eager")
    ctx = None
    for step in range(6):
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            if m is plain:
                loss(m).backward()
            else:
                ctx = offload.activations(model=m, policy="auto", tiers="host",
                                          min_bytes=0, probe=_SLOW)
                with ctx:
                    loss(m).backward()
        for a, b in zip(plain.parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad), f"step {step}"
        for a, b in zip(plain.buffers(), model.buffers()):
            assert torch.equal(a, b), f"step {step}"
    return ctx


def test_compiled_blocks_checkpointed_whole_on_the_gpu(monkeypatch, tmp_path):
    """A compiled block's call timed with CUDA events as one op (profile.WHOLE_BLOCK) and
    checkpointed whole by `auto` (stop 53)."""
    from offload.schedule.profile import WHOLE_BLOCK

    x = torch.randn(64, 64, device="cuda")
    ctx = _side_by_side(True, lambda m: m(x).pow(2).mean(), monkeypatch, tmp_path)
    plan = ctx.plan
    assert all(bp.recompute == {WHOLE_BLOCK} for bp in plan.blocks.values()), str(plan)
    assert all(bp.recompute_s > 0 for bp in plan.blocks.values()), str(plan)


def test_an_eval_forward_then_a_train_forward_on_the_gpu(monkeypatch, tmp_path):
    """buffers.py rule 6's copies into the buffers on the device: an eval-mode forward,
    then a train-mode one, before one backward (stop 53)."""
    x = torch.randn(64, 64, device="cuda")
    other = torch.randn(64, 64, device="cuda")

    def loss(m):
        m.eval()
        consistency = m(other).pow(2).mean()
        m.train()
        return m(x).pow(2).mean() + 0.5 * consistency

    ctx = _side_by_side(False, loss, monkeypatch, tmp_path)
    assert any(bp.per_op for bp in ctx.plan.blocks.values()), str(ctx.plan)
