"""`auto` across the steps of a real run: a plan per shape class (varying lengths, layer
drop; plan_cache.py NOTE [Shape classes]) and only training steps profiled or timed
(step.py NOTE [Training step])."""
from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
import torch.nn as nn
from schedule_models import SLOW, small_gpt, train_side_by_side

import offload
from offload.schedule import search as search_mod



pytestmark = pytest.mark.usefixtures("auto_plan_only")   # conftest.py


def _settings(nvme_dir, **kw):
    return dict(policy="auto", tiers="nvme", nvme_dir=nvme_dir, min_bytes=0, probe=SLOW, **kw)


def _ran_a_plan(ctx) -> bool:
    """The step ran a plan: neither warm-up, nor profile, nor fallback."""
    session = ctx._schedule
    return session.choice.plan is not None and not session._profiling \
        and session._fallback is None


# ---------------------------------------------------------------- shape classes
@pytest.mark.parametrize("repeat", [1, 2])
def test_varying_lengths_each_get_a_plan_after_one_pass(repeat, nvme_dir, caplog):
    """Lengths 64, 96, 128, 80 cycling (each once or twice in a row): one warm-up step,
    one profile per length, then every step runs its length's plan, bit-exact. Before:
    profile and checkpointed fallback alternated forever, never a plan."""
    model, _ = small_gpt(layers=2, hidden=32, seq=128)
    lengths = [n for n in (64, 96, 128, 80) for _ in range(repeat)]
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 97, (2, n), generator=gen) for n in (64, 96, 128, 80)]
    by_length = dict(zip((64, 96, 128, 80), batches))
    steps = 4 * repeat * 3
    planned = []
    calls = [0]

    def loss(m):  # the plain copy and ours take the same batch in each step
        n = lengths[(calls[0] // 2) % len(lengths)]
        calls[0] += 1
        idx = by_length[n]
        return m.loss(idx, idx)

    with caplog.at_level(logging.INFO, logger="offload"):
        differs, ctx = train_side_by_side(model, loss, steps, _settings(nvme_dir),
                                          each=lambda step, c: planned.append(_ran_a_plan(c)))
    plans = [r.getMessage() for r in caplog.records if "auto plan" in r.getMessage()]
    assert len(plans) == 4, plans          # one per length, none again
    assert differs is None, f"differs at step {differs}"
    first_pass = 1 + 4 * repeat            # warm-up, then until each length was profiled
    assert all(planned[first_pass + repeat - 1:]), planned
    assert sum(planned) >= steps - first_pass - repeat
    assert len(ctx._schedule.state.plans) == 4
    ctx.close()


class Dropping(nn.Module):
    """Four blocks; in training each is skipped with probability `p` (layer drop)."""

    def __init__(self, p: float = 0.3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64),
                                                  nn.GELU(), nn.Linear(64, 32))
                                    for _ in range(4))
        self.p = p

    def forward(self, x):
        keep = torch.rand(len(self.blocks)) >= self.p
        for block, kept in zip(self.blocks, keep.tolist()):
            if kept:
                x = x + block(x)
        return x.pow(2).mean()


def test_layer_drop_runs_the_plan(nvme_dir):
    """Blocks skipped at random: a block the profiled step skipped runs on the decisions of
    the nearest profiled block of its type (what that one keeps moves). Before: every step
    that ran such a block fell back to checkpointing and the next one profiled again."""
    model = Dropping()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    planned = []
    differs, ctx = train_side_by_side(model, lambda m: m(x), 16, _settings(nvme_dir),
                                      each=lambda step, c: planned.append(_ran_a_plan(c)))
    assert differs is None, f"differs at step {differs}"
    assert planned[:2] == [False, False] and all(planned[2:]), planned
    plan = ctx.plan
    assert len(plan.signatures) < 4, "the profiled step ran every block: nothing tested"
    assert any(bp.per_op for bp in plan.blocks.values())
    ctx.close()


class TwoCrops(nn.Module):
    """One backbone on a long and a short crop per step; every other step the short crop
    runs under no_grad (a teacher's view, say)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32),
                                                  nn.GELU(), nn.Linear(32, 16))
                                    for _ in range(3))
        self.calls = 0

    def encode(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x.mean(1)

    def forward(self, x):
        self.calls += 1
        long = self.encode(x)    # first: the step's shape class
        short = x[:, ::2]
        if self.calls % 2 == 0:   # the profiled step (the second) is one of these
            with torch.no_grad():
                other = self.encode(short)
        else:
            other = self.encode(short)
        return (long - other).pow(2).mean()


def test_calls_of_another_shape_every_other_step_stop_profiling(nvme_dir, caplog):
    """NOTE [Shape classes]: the short crop runs with grad only in the steps the profile
    did not see, so each of them fell back and the next step profiled again, for good.
    After SHAPE_REPROFILES profiles the plan stays (such calls run checkpointed), exact."""
    from offload.schedule.constants import SHAPE_REPROFILES
    model = TwoCrops()
    x = torch.randn(4, 12, 16, generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.INFO, logger="offload"):
        differs, ctx = train_side_by_side(model, lambda m: m(x), 16, _settings(nvme_dir))
    assert differs is None, f"differs at step {differs}"
    said = [r.getMessage() for r in caplog.records]
    plans = [m for m in said if "auto plan" in m]
    assert len(plans) == 1 + SHAPE_REPROFILES, plans
    assert sum("its plan stays" in m for m in said) == 1
    ctx.close()


# ---------------------------------------------------------------- which steps count
@pytest.mark.trials
def test_only_training_steps_are_booked_as_trials(nvme_dir, monkeypatch):
    """A trial measures a step that ran a forward and a backward and whose graph its own
    backward freed. Before: an eval block (no_grad inside) was booked (0.001 s), and so
    was a step whose graph outlived it (its whole lifetime), and a compiling step."""
    monkeypatch.setattr(search_mod, "TRIAL_MARGIN", float("inf"))
    model, loss_fn = small_gpt(layers=2, hidden=32)
    settings = _settings(nvme_dir)

    def step(body):
        with offload.activations(model=model, **settings) as ctx:
            out = body()
        return ctx, out

    for _ in range(2):   # warm-up, profile
        step(lambda: loss_fn().backward())
    plan = step(lambda: None)[0].plan   # a step that runs nothing counts for nothing
    assert plan is not None and plan.pending[0] == "plan"
    pending = list(plan.pending)

    def eval_step():
        with torch.no_grad():
            loss_fn()

    step(eval_step)
    assert plan.pending == pending and plan.measured == {}

    def retained():
        loss = loss_fn()
        loss.backward(retain_graph=True)
        return loss

    _, loss = step(retained)
    del loss   # the graph dies after the block: its step ends at the next entry
    double = torch.compile(lambda t: t * 2, backend="eager")
    step(lambda: double(loss_fn()).backward())   # compiles a frame during the step
    step(lambda: None)
    assert plan.pending == pending and plan.measured == {}
    step(lambda: loss_fn().backward())
    assert plan.pending == pending[1:] and len(plan.measured["plan"]) == 1


def test_steps_that_are_not_training_steps_say_why_auto_has_not_planned(nvme_dir, caplog):
    """A helper's GAN loop kept a graph alive with retain_graph past every step: auto never
    planned, ctx.plan stayed None and nothing said why, even at INFO."""
    model, loss_fn = small_gpt(layers=2, hidden=32)
    ctx = offload.activations(model=model, **_settings(nvme_dir))
    with caplog.at_level(logging.INFO, logger="offload"):
        for _ in range(5):
            with ctx:
                loss = loss_fn()
                loss.backward(retain_graph=True)
            # the graph outlives the step: it ends when `loss` is rebound, in the next
    said = [r.getMessage() for r in caplog.records if "has not planned" in r.getMessage()]
    assert said == ["offload: auto has not planned: its last 3 steps were not training steps "
                    "(a forward and its own backward inside the context: not an eval block, "
                    "not a graph kept alive with retain_graph past the step, not a step "
                    "torch.compile compiled in); ctx.plan stays None until one runs"]
    assert ctx.plan is None
    del loss
    for _ in range(2):   # warm-up, profile
        with ctx:
            loss_fn().backward()
    assert ctx.plan is not None
    ctx.close()


def test_steps_alive_at_once_settle_on_one_plan(nvme_dir, caplog):
    """NOTE [Steps alive at once]: one entry per micro-batch, the backwards after all the
    forwards. The second entry replaced the session's state of the first, whose end then
    made a plan from the second's profiler, and the next one a plan of no block: 6 plans in
    10 steps, never settled. Now the later entry alone is learned from; exact throughout."""
    model, _ = small_gpt(layers=2, hidden=32)
    plain = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 97, (2, 32), generator=gen) for _ in range(2)]
    ctx = offload.activations(model=model, **_settings(nvme_dir), log="INFO")

    def step(m, context):
        torch.manual_seed(7)   # the same dropout masks in both runs
        losses = []
        for idx in batches:
            with context:
                losses.append(m.loss(idx, idx))
        for loss in losses:
            loss.backward()
        grads = [p.grad.clone() for p in m.parameters()]
        m.zero_grad(set_to_none=True)
        return grads

    with caplog.at_level(logging.INFO, logger="offload"):
        for i in range(8):
            ours, theirs = step(model, ctx), step(plain, contextlib.nullcontext())
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), f"step {i}"
    plans = [r.getMessage() for r in caplog.records if "auto plan" in r.getMessage()]
    assert len(plans) == 1, plans
    assert ctx.plan is not None and ctx.plan.settled
    ctx.close()
