"""A buffer changed in place between a block's forward and its re-run (buffers.py NOTE
[Buffers in a re-run], rule 7; changed_buffers.py): plain autograd raises its in-place
error in backward when an op saved the buffer (BatchNorm saves its running statistics, in
train and eval mode), and `recompute` / `auto` raise it too, where before their re-run
mixed the call's values with the new ones silently. A buffer changed in place that no op
saves (a counter bumped before use, `num_batches_tracked`) raises nothing in either, and
trains bit-exact."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
from schedule_models import SLOW

import offload

IN_PLACE = "modified by an inplace operation"


pytestmark = pytest.mark.usefixtures("auto_plan_only")   # conftest.py


def _stack(blocks: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh())
                            for _ in range(blocks)])
    with torch.no_grad():
        for block in model:
            block[1].running_mean.uniform_(-1, 1)
            block[1].running_var.uniform_(0.5, 2)
    return model


def _change_in_place(model):
    model[1][1].running_var.mul_(2)


def _replace_then_change_the_old(model):
    """The slot gets a new tensor (the re-run reads a copy of the call's), and the old
    one, which the forward's op saved, is changed in place."""
    bn = model[1][1]
    old = bn.running_var
    bn.running_var = old * 2
    old.mul_(3)


def _steps(policy: str) -> int:
    return 5 if policy == "auto" else 1   # auto: warm-up, profile, then planned steps


@pytest.mark.parametrize("change", [_change_in_place, _replace_then_change_the_old],
                         ids=["in place", "replaced, the old one changed"])
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_saved_buffer_changed_before_backward_raises_as_in_plain_training(
        policy, mode, change, nvme_dir):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    plain = _stack().train(mode == "train")
    loss = plain(x).square().sum()
    with torch.no_grad():
        change(plain)
    with pytest.raises(RuntimeError, match=IN_PLACE):
        loss.backward()

    model = _stack().train(mode == "train")
    ctx = offload.activations(model=model, blocks=list(model), policy=policy, tiers="nvme",
                              nvme_dir=nvme_dir, min_bytes=0, probe=SLOW)
    steps = _steps(policy)
    for step in range(steps):
        with ctx:
            loss = model(x).square().sum()
            if step < steps - 1:
                loss.backward()
                continue
            with torch.no_grad():
                change(model)
            with pytest.raises(RuntimeError, match=IN_PLACE) as raised:
                loss.backward()
    assert "`running_var` of a BatchNorm1d" in str(raised.value)
    if policy == "auto":   # the slow link: its plan re-runs the blocks' ops
        assert any(bp.per_op for bp in ctx.plan.blocks.values()), ctx.plan
    ctx.close()


class SavesItsCounter(nn.Module):
    """A counter bumped in place before an op saves it: the re-run bumps it again (on the
    call's value) and saves it; a retained graph's second re-run must not take that bump
    for a change made after the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.ones(8))

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x)) * self.calls


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_buffers_a_forward_changes_itself_train_as_in_plain_training(policy, nvme_dir):
    """Counters saved after their bump, and a train-mode BatchNorm shared by two positions
    (its second call bumps `num_batches_tracked`, which nothing saves), with two
    backwards of a retained graph: no error, bit-exact."""
    torch.manual_seed(0)
    shared = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh())
    model = nn.Sequential(SavesItsCounter(), shared, SavesItsCounter(), shared)
    plain = copy.deepcopy(model)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    ctx = offload.activations(model=model, blocks=list(model), policy=policy, tiers="nvme",
                              nvme_dir=nvme_dir, min_bytes=0, probe=SLOW)
    for step in range(_steps(policy) + 1):
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
            with ctx if m is model else contextlib.nullcontext():
                loss = m(x).square().mean()
                loss.backward(retain_graph=True)
                loss.backward()
        assert [n for (n, a), b in zip(model.named_parameters(), plain.parameters())
                if not torch.equal(a.grad, b.grad)] == [], f"step {step}"
        assert all(torch.equal(a, b) for a, b in zip(model.buffers(), plain.buffers()))
    assert model[0].calls[0].item() == 1 + _steps(policy) + 1
    if policy == "auto":
        assert any(bp.per_op for bp in ctx.plan.blocks.values()), ctx.plan
    ctx.close()


class SavesAnAlias(nn.Module):
    """Two buffers over one memory, each with a version counter of its own (`b = a.data`):
    the forward saves `b`; a change of `a` moves no counter of `b`."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("a", torch.rand(8) + 0.5)
        self.register_buffer("b", self.a.data)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.b


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_buffer_over_the_same_memory_with_its_own_counter_raises_nothing(policy, nvme_dir):
    """A review's find: the re-run refused a save by its memory, so changing `a` refused
    the save of `b`, where plain autograd (whose check follows `b`'s own counter) trains
    and the re-run read the very values plain training did. Bit-exact now."""
    torch.manual_seed(0)
    model = nn.Sequential(*[SavesAnAlias() for _ in range(3)])
    plain = copy.deepcopy(model)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    ctx = offload.activations(model=model, blocks=list(model), policy=policy, tiers="nvme",
                              nvme_dir=nvme_dir, min_bytes=0, probe=SLOW)
    for step in range(_steps(policy)):
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
            with ctx if m is model else contextlib.nullcontext():
                loss = m(x).square().sum()
                with torch.no_grad():
                    m[1].a.add_(0.0)   # a version bump, the values as they were
                loss.backward()
        assert [n for (n, a), b in zip(model.named_parameters(), plain.parameters())
                if not torch.equal(a.grad, b.grad)] == [], f"step {step}"
    if policy == "auto":
        assert any(bp.per_op for bp in ctx.plan.blocks.values()), ctx.plan
    ctx.close()


def test_a_second_backward_after_the_first_raised_raises_too(nvme_dir):
    """A review's find: the versions were noted again after a re-run that raised, so the
    user's change became the baseline and a second backward of the retained graph (the
    first's error caught) mixed old and new values silently; plain autograd raises both
    times."""
    def backwards(model, ctx):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        out = []
        with ctx:
            loss = model(x).square().sum()
            with torch.no_grad():
                model[1][1].running_var.mul_(2)
            for _ in range(2):
                try:
                    loss.backward(retain_graph=True)
                    out.append("ok")
                except RuntimeError as e:
                    assert IN_PLACE in str(e)
                    out.append("raised")
        return out

    assert backwards(_stack().eval(), contextlib.nullcontext()) == ["raised", "raised"]
    model = _stack().eval()
    ctx = offload.activations(model=model, blocks=list(model), policy="recompute",
                              tiers="nvme", nvme_dir=nvme_dir, min_bytes=0)
    assert backwards(model, ctx) == ["raised", "raised"]
    ctx.close()
