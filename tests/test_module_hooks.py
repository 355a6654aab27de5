"""Forward hooks inside a block as they were at its call, for its re-run under `recompute`
and `auto` (offload/schedule/module_hooks.py NOTE [Forward hooks in a re-run]): bit-exact
against plain training over several optimizer steps."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import offload

from schedule_models import SLOW

D = 16
STEER = torch.full((D,), 0.5)


pytestmark = pytest.mark.usefixtures("auto_plan_only")   # conftest.py: one thread too


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


def _hook(model, where):
    if where == "output hook":
        return model[2].a.register_forward_hook(lambda m, args, out: out + STEER)
    if where == "pre-hook with kwargs":
        return model[2].b.register_forward_pre_hook(
            lambda m, args, kwargs: ((args[0] * 2,), kwargs), with_kwargs=True)
    return nn.modules.module.register_module_forward_hook(   # global
        lambda m, args, out: out + STEER if m is model[2].a else None)


def _train(policy, where, when, nvme_dir, steps=4):
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block() for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = offload.activations(model=model, policy=policy, tiers="nvme", nvme_dir=nvme_dir,
                              min_bytes=0, probe=SLOW) if policy else contextlib.nullcontext()
    grads = []
    for step in range(steps):
        x = torch.randn(8, D, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        with ctx:
            if when == "forward only":   # (steering, an ablation: removed before backward)
                handle = _hook(model, where)
                y = model(x)
                handle.remove()
            else:                        # added between the forward and the backward
                y = model(x)
                handle = _hook(model, where)
            y.pow(2).sum().backward()
            if when != "forward only":
                handle.remove()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


@pytest.mark.parametrize("when", ["forward only", "added before backward"])
@pytest.mark.parametrize("where", ["output hook", "pre-hook with kwargs", "global hook"])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_re_run_runs_the_forward_hooks_of_its_call(policy, where, when, nvme_dir):
    """Before: the re-run ran with the hooks as they were in backward, silently another
    function than the forward (gradients off by 15 at the first step, 1e11 by the
    fourth)."""
    plain = _train(None, where, when, nvme_dir)
    ours = _train(policy, where, when, nvme_dir)
    for step, (a, b) in enumerate(zip(plain, ours)):
        assert all(map(torch.equal, a, b)), f"step {step} differs"


def test_hooks_are_the_modules_own_again_after_the_re_run(nvme_dir):
    """The re-run's hooks are put back: a hook removed after the forward stays removed."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block() for _ in range(3)])
    calls = []
    with offload.activations(model=model, policy="recompute", tiers="nvme",
                             nvme_dir=nvme_dir, min_bytes=0):
        handle = model[1].a.register_forward_hook(lambda m, args, out: calls.append(1))
        y = model(torch.randn(4, D))
        handle.remove()
        y.sum().backward()
    assert len(calls) == 2   # the forward and its re-run
    assert not model[1].a._forward_hooks and not nn.modules.module._global_forward_hooks


class _SwapsItsHook(nn.Module):
    """Removes the hook its previous call registered on a module and registers its own, at
    every call: its re-run does so again, as under checkpoint (bit-exact there)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.handle = None

    def forward(self, x):
        if self.handle is not None:
            self.handle.remove()
        self.handle = self.a.register_forward_hook(lambda m, args, out: out * 1.5)
        return x + self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_forward_that_swaps_its_own_hooks_re_runs_as_under_checkpoint(policy, nvme_dir):
    """module_hooks.py NOTE: called twice in a step (two views), the first call's re-run got
    its hook dict back as a copy; the forward, re-running, registered into the copy while
    its remove() hit the module's own dict, and the hook ran twice: gradients off by 10
    at the first step."""
    def train(use_offload: bool) -> list:
        torch.manual_seed(0)
        model = nn.Sequential(*[_SwapsItsHook() for _ in range(3)])
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        ctx = offload.activations(model=model, policy=policy, tiers="nvme", nvme_dir=nvme_dir,
                                  min_bytes=0, probe=SLOW) if use_offload \
            else contextlib.nullcontext()
        grads = []
        for step in range(5):
            data = torch.Generator().manual_seed(step)
            x1, x2 = torch.randn(8, D, generator=data), torch.randn(8, D, generator=data)
            opt.zero_grad()
            with ctx:
                (model(x1) - model(x2)).pow(2).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        return grads

    for step, (a, b) in enumerate(zip(train(False), train(True))):
        assert all(map(torch.equal, a, b)), f"step {step} differs"


def test_a_block_compiled_in_place_re_runs_with_its_own_hooks_of_the_call(nvme_dir):
    """A block compiled in place (`block.compile()`) is checkpointed through its compiled
    call, which runs its own hooks too (blocks.py NOTE [Wrapping] rule 5): a pre-hook on it
    for the forward only was not put back for the re-run (gradients off by 32)."""
    def train(use_offload: bool) -> list:
        torch.manual_seed(0)
        model = nn.Sequential(*[_Block() for _ in range(3)])
        for block in model:
            block.compile(backend="eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx = offload.activations(model=model, policy="recompute", tiers="nvme",
                                  nvme_dir=nvme_dir, min_bytes=0) if use_offload \
            else contextlib.nullcontext()
        grads = []
        for step in range(3):
            x = torch.randn(8, D, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            with ctx:
                handle = model[1].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
                y = model(x)
                handle.remove()
                y.pow(2).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
        return grads

    for step, (a, b) in enumerate(zip(train(False), train(True))):
        assert all(map(torch.equal, a, b)), f"step {step} differs"
