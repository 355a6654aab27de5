"""torch.nn.utils.parametrize under `recompute` and `auto`: the parametrization cache a
block's re-run runs under (offload/schedule/parametrize_cache.py NOTE [Parametrization
cache in a re-run]), bit-exact against plain training over several optimizer steps."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.parametrize as P

import offload

from schedule_models import SLOW

D = 16   # also the batch: the re-run's extra saves have the shapes checkpoint expects


pytestmark = pytest.mark.usefixtures("auto_plan_only")   # conftest.py: one thread too


class _Skew(nn.Module):   # an orthogonal weight: the exponential of a skew-symmetric matrix
    def forward(self, w):
        a = w.triu(1)
        return torch.matrix_exp(a - a.T)


class _Tied(nn.Module):
    """Reads its parametrized weight twice (a tied encoder / decoder)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(D, D)
        P.register_parametrization(self.a, "weight", _Skew())

    def forward(self, x):
        return x + F.linear(torch.tanh(self.a(x)), self.a.weight.T)


def _tied():
    return nn.Sequential(*[_Tied() for _ in range(3)])


def _shared():
    """One parametrized layer at three positions (ALBERT): later positions read the weight
    the first one put in the cache."""
    layer = _Tied()
    return nn.Sequential(layer, layer, layer)


def _train(make, policy, around, nvme_dir, steps=5):
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ctx = offload.activations(model=model, policy=policy, tiers="nvme", nvme_dir=nvme_dir,
                              min_bytes=0, probe=SLOW) if policy else contextlib.nullcontext()
    out = []
    for step in range(steps):
        x = torch.randn(D, D, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        with ctx:
            if around == "forward":   # as cached()'s docstring shows
                with P.cached():
                    y = model(x)
                y.pow(2).sum().backward()
            else:
                with P.cached():
                    model(x).pow(2).sum().backward()
        out.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return out


@pytest.mark.parametrize("make", [_tied, _shared], ids=["tied", "shared layer"])
@pytest.mark.parametrize("around", ["forward", "step"])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_re_run_sees_the_parametrization_cache_as_at_its_call(policy, around, make,
                                                                nvme_dir):
    """Before: cached() around the forward gave gradients off by ~1e2 (the re-run, outside
    the cache, computed the weight again and saved more than the forward); around the whole
    step, CheckpointError at every step (it took the forward's weight from the cache and
    saved less)."""
    plain = _train(make, None, around, nvme_dir)
    ours = _train(make, policy, around, nvme_dir)
    for step, (a, b) in enumerate(zip(plain, ours)):
        assert all(map(torch.equal, a, b)), f"step {step} differs"
