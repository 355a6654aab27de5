"""`recompute` and `auto` leave the model as plain training does: a layer shared by several
positions is wrapped once and unwrapped at every exit (blocks.py NOTE [Wrapping]),
buffers a block changes in its forward are changed once per call, not again by the re-run
(buffers.py NOTE [Buffers in a re-run]), and a block drawing from the user's own random
generators draws the same numbers again in its re-run (generators.py NOTE [Generators in a
re-run]). Weights, gradients and buffers bit-exact against
plain training with AdamW."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import io
import threading
import weakref
from typing import Callable

import numpy
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from schedule_models import SLOW, SharedLayers, module_state, train_side_by_side

import offload



pytestmark = pytest.mark.usefixtures("auto_plan_only")   # conftest.py


def _settings(policy, nvme_dir, **kw):
    return dict(policy=policy, tiers="nvme", nvme_dir=nvme_dir, min_bytes=0, probe=SLOW, **kw)


# ---------------------------------------------------------------- shared layers
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_shared_layer_is_wrapped_once_and_unwrapped_at_every_exit(policy, nvme_dir):
    """Before: three more wrappers per step stayed on the layer, a RecursionError near step
    160. Every step here checks the model carries nothing of ours after the exit."""
    model = SharedLayers()
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    layer = model.layers[0]
    real = layer.forward.__func__

    def own(self, *args):
        return real(self, *args)

    layer.forward = own.__get__(layer)   # a forward of the user's, set on the instance
    user_forward = layer.forward
    state = module_state(model)

    def each(step, ctx):
        assert layer.__dict__["forward"] is user_forward
        assert module_state(model) == state

    differs, ctx = train_side_by_side(model, lambda m: m(x), 200, _settings(policy, nvme_dir),
                                      each=each)
    assert differs is None, f"differs at step {differs}"
    assert ctx.stats.nvme_bytes > 0
    if policy == "auto":   # every position planned, one block type
        assert sorted(ctx.plan.signatures) == [0, 1, 2, 3] and len(ctx.plan.blocks) == 1
    ctx.close()


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_contexts_on_one_model_may_exit_in_any_order(policy, nvme_dir):
    """Before: entered A, B and exited A, B (micro-batches in flight, threads, generators)
    left A's wrapper on every block, one more each such step, each holding its step, until
    every call of the model, with or without offload, raised RecursionError (~480 steps).
    Three contexts in every exit order: nothing of ours stays, gradients are plain
    autograd's, and a forward of the user's set over ours stays and still runs."""
    import itertools

    import offload.runtime.step as step_mod

    torch.manual_seed(0)
    model = nn.Sequential(*[Residual() for _ in range(3)])
    twin = copy.deepcopy(model)
    xs = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(1))
    contexts = [offload.activations(model=model, **_settings(policy, nvme_dir))
                for _ in range(3)]
    gc.collect()
    steps_before = sum(type(o) is step_mod.Step for o in gc.get_objects())   # other tests'
    for order in [*itertools.permutations(range(3))] * 2:
        losses = []
        for ctx, x in zip(contexts, xs):
            ctx.__enter__()
            losses.append(model(x).pow(2).sum())
        for i in order:
            contexts[i].__exit__(None, None, None)
        assert [set(b.__dict__) & {"forward", "__getstate__"} for b in model] == [set()] * 3
        for loss, x in zip(losses, xs):
            grads = torch.autograd.grad(loss, list(model.parameters()))
            plain = torch.autograd.grad(twin(x).pow(2).sum(), list(twin.parameters()))
            assert all(map(torch.equal, grads, plain)), order
    del losses, loss
    gc.collect()
    assert sum(type(o) is step_mod.Step for o in gc.get_objects()) <= \
        steps_before + len(contexts)   # each context's latest

    # Covered by the user's forward when it exits: theirs stays, ours under it passes through.
    ctx = contexts[0]
    with ctx:
        covered = model[1].forward
        model[1].forward = lambda *args: covered(*args)
        users = model[1].forward
    assert model[1].__dict__["forward"] is users and "__getstate__" not in model[1].__dict__
    with contexts[1]:   # a later context wraps theirs, and puts it back
        model(xs[0]).pow(2).sum().backward()
    assert model[1].__dict__["forward"] is users
    assert torch.equal(model(xs[0]), twin(xs[0]))
    for c in contexts:
        c.close()


# ---------------------------------------------------------------- copies
class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.lin(x).tanh()


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_copy_made_inside_the_step_runs_its_own_weights_and_carries_nothing(policy,
                                                                              nvme_dir):
    """Before: `copy.deepcopy(model)` inside the step (an EMA or teacher copy) gave blocks
    whose forward was our wrapper of the ORIGINAL blocks' forward, for ever: the copy ran
    the original's weights, silently, and `torch.save(model)` inside the step raised (a
    local function cannot be pickled). The copy is now of the model as the wrapping found
    it, also with a forward of the user's on an instance and two contexts wrapping the
    same blocks (blocks.py NOTE [Wrapping] Rule 4)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Residual() for _ in range(3)])
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    first = model[0]
    first.forward = functools.partial(Residual.forward, first)   # the user's, on the instance
    outer = offload.activations(model=model, **_settings(policy, nvme_dir))
    inner = offload.activations(model=model, **_settings(policy, nvme_dir))
    with outer:
        with inner:
            copied = copy.deepcopy(model)
            saved = io.BytesIO()
            torch.save(model, saved)
            model(x).pow(2).mean().backward()
    for m in (copied, torch.load(io.BytesIO(saved.getvalue()), weights_only=False)):
        assert [set(b.__dict__) & {"forward", "__getstate__"} for b in m] == \
            [{"forward"}, set(), set()]
        assert m[0].forward.func is Residual.forward and m[0].forward.args == (m[0],)
        with torch.no_grad():
            for p in m.parameters():
                p.zero_()
            assert torch.equal(m(x), x)   # its own (zero) weights, not the original's
    assert first.__dict__["forward"].args == (first,)
    assert [set(b.__dict__) & {"forward", "__getstate__"} for b in model] == \
        [{"forward"}, set(), set()]
    outer.close()
    inner.close()


# ---------------------------------------------------------------- buffers
class Basic(nn.Module):
    """A ResNet basic block: its BatchNorms change their running statistics in forward."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c, momentum=None)   # cumulative: counts its batches
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(self.drop(torch.relu(self.bn1(self.conv1(x)))))))


class CountsInPlace(nn.Module):
    """A buffer changed in place in forward, and the output depends on it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return x * (1 + 0.01 * self.calls)


class CountsByAssignment(nn.Module):
    """A buffer replaced by a new tensor in forward (no in-place change to see)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls = self.calls + 1
        return x * (1 + 0.01 * self.calls)


class Stage(nn.Module):
    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.basic = Basic(c)
        self.inplace = CountsInPlace()
        self.assigned = CountsByAssignment()

    def forward(self, x):
        return self.assigned(self.inplace(self.basic(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.stages = nn.Sequential(*[Stage() for _ in range(3)])
        self.head = nn.Linear(4, 5)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean(dim=(2, 3)))


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_buffers_change_once_per_forward_as_in_plain_training(policy, nvme_dir):
    """Before: BatchNorm statistics updated twice a step (num_batches_tracked 2 vs 1 after
    one step) and a counter's re-run computing with the counter already advanced."""
    model = Net()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 5, (4,), generator=torch.Generator().manual_seed(2))
    loss = lambda m: nn.functional.cross_entropy(m(x), y)  # noqa: E731
    differs, ctx = train_side_by_side(model, loss, 8, _settings(policy, nvme_dir))
    assert differs is None, f"differs at step {differs}"
    stage = model.stages[0]
    assert stage.basic.bn1.num_batches_tracked.item() == 8
    assert stage.inplace.calls.item() == 8 and stage.assigned.calls.item() == 8
    if policy == "auto":   # the slow link: re-runs ops, so the buffers were at stake
        assert any(bp.per_op for bp in ctx.plan.blocks.values()), ctx.plan
    ctx.close()


def test_a_shared_batchnorm_block_counts_every_position_once(nvme_dir):
    """The two mechanisms together: a block with BatchNorm shared by three positions, each
    call updating the statistics from where the previous one left them."""
    torch.manual_seed(0)
    block = Stage()
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Sequential(*[block] * 3))
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    differs, ctx = train_side_by_side(model, lambda m: m(x).pow(2).mean(), 4,
                                      _settings("recompute", nvme_dir, blocks=[block] * 3))
    assert differs is None, f"differs at step {differs}"
    assert block.basic.bn1.num_batches_tracked.item() == 12
    ctx.close()


def test_a_batchnorm_replaced_between_steps_is_guarded_too(nvme_dir):
    """The buffer slots are learned per block and hold its modules weakly: a BatchNorm
    swapped for a fresh one between steps (the old one freed) is found again, so the re-run
    does not update the new one's statistics a second time."""
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    settings = _settings("recompute", nvme_dir)

    def steps(n):
        for _ in range(n):
            with offload.activations(model=model, **settings):
                model(x).pow(2).mean().backward()

    steps(2)
    stage = model.stages[0].basic
    assert stage.bn1.num_batches_tracked.item() == 2
    stage.bn1 = nn.BatchNorm2d(4)
    steps(3)
    assert stage.bn1.num_batches_tracked.item() == 3   # 6: updated again by the re-run


UPDATING = [False]   # LateCodebook's switch, shared by the plain and the offload copy


class LateCodebook(nn.Module):
    """A VQ layer whose EMA codebook update is switched on after warm-up: the first change
    to its buffer comes in a later call than its first, and the output reads the buffer."""

    def __init__(self, d: int = 8, k: int = 6) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.register_buffer("codebook", torch.randn(k, d))

    def forward(self, x):
        z = self.inp(x)
        codes = self.codebook[torch.cdist(z, self.codebook).argmin(-1)]
        if UPDATING[0]:
            with torch.no_grad():
                self.codebook.mul_(0.5).add_(0.5 * z.mean(0))
        return x + z + (codes - z).detach() + (z - codes.detach()).pow(2).mean()


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_buffer_first_changed_in_a_later_call_is_set_back_for_that_calls_rerun(policy,
                                                                                   nvme_dir):
    """Before: only the buffers of modules seen changing in an earlier call were copied
    before the forward, so the call that changed a buffer first re-ran on the value it had
    written: a gradient ~0.01 off at that step, silently, and every step after differing."""
    torch.manual_seed(0)
    model = nn.Sequential(*[LateCodebook() for _ in range(3)])
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))

    def each(step, ctx):
        UPDATING[0] = step >= 3   # from the fifth step on (auto re-runs from the third)

    try:
        differs, ctx = train_side_by_side(model, lambda m: m(x).pow(2).mean(), 7,
                                          _settings(policy, nvme_dir), each=each)
    finally:
        UPDATING[0] = False
    assert differs is None, f"differs at step {differs}"
    if policy == "auto":   # the slow link: re-runs ops, so the buffers were at stake
        assert any(bp.per_op for bp in ctx.plan.blocks.values()), ctx.plan


class DelayedScale(nn.Module):
    """Delayed scaling (FP8 recipes): a buffer registered as None, set at the first call
    and updated from then on; the output is scaled by it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("amax", None)

    def forward(self, x):
        y = self.lin(x)
        seen = y.detach().abs().amax()
        self.amax = seen if self.amax is None else torch.maximum(0.9 * self.amax, seen)
        return x + torch.tanh(y / self.amax)


class ReadsScale(nn.Module):
    """Reads its buffer `scale`; the model changes it outside the block's forward."""

    def __init__(self, scale: torch.Tensor | None = None, writes: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8) if scale is None else scale)
        self.writes = writes

    def forward(self, x):
        y = torch.tanh(self.lin(x) + self.scale)   # autograd saves no buffer: may change
        if self.writes:   # the last block updates the buffer all blocks share
            with torch.no_grad():
                self.scale.mul_(0.5).add_(y.mean(0))
        return x + y


class ParentUpdates(nn.Module):
    """After all blocks ran, the parent updates each block's buffer: in place, through
    `.data` (no version bump), or by assigning a new tensor."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ReadsScale() for _ in range(3)])
        self.how = how

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        with torch.no_grad():
            for block in self.blocks:
                new = 0.5 * block.scale + x.mean(0)
                if self.how == "in place":
                    block.scale.copy_(new)
                elif self.how == ".data":
                    block.scale.data.copy_(new)
                else:
                    block.scale = new
        return x.pow(2).mean()


class SharedState(nn.Module):
    """One buffer tensor registered in every block; only the last block writes it."""

    def __init__(self) -> None:
        super().__init__()
        state = torch.ones(8)
        self.blocks = nn.ModuleList([ReadsScale(state, writes=i == 2) for i in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


class LateDataCodebook(LateCodebook):
    """LateCodebook updating through `.data`: the change bumps no version counter."""

    def forward(self, x):
        z = self.inp(x)
        codes = self.codebook[torch.cdist(z, self.codebook).argmin(-1)]
        if UPDATING[0]:
            self.codebook.data.mul_(0.5).add_(0.5 * z.detach().mean(0))
        return x + z + (codes - z).detach() + (z - codes.detach()).pow(2).mean()


class ReadsAView(nn.Module):
    """Keeps statistics in one buffer and a named row of it as another (a view): the
    forward updates the whole buffer in place and reads the row."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("stats", torch.ones(2, 8))
        self.register_buffer("scale", self.stats[1])

    def forward(self, x):
        y = self.lin(x)
        with torch.no_grad():
            self.stats.mul_(0.5).add_(y.mean(0))
        return x + torch.tanh(y * self.scale)


def _buffer_model(case: str) -> tuple[nn.Module, Callable]:
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    if case == "a view of another":
        return nn.Sequential(*[ReadsAView() for _ in range(3)]), lambda m: m(x).pow(2).mean()
    if case == "None at first":
        model = nn.Sequential(*[DelayedScale() for _ in range(3)])
        return model, lambda m: m(x).pow(2).mean()
    if case == "shared, last writes":
        return SharedState(), lambda m: m(x)
    if case == "late, through .data":
        return nn.Sequential(*[LateDataCodebook() for _ in range(3)]), \
            lambda m: m(x).pow(2).mean()
    return ParentUpdates(case.removeprefix("parent, ")), lambda m: m(x)


@pytest.mark.parametrize("case", ["None at first", "parent, in place", "parent, .data",
                                  "parent, assign", "shared, last writes",
                                  "late, through .data", "a view of another"])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_rerun_reads_every_buffer_as_it_was_at_the_call(policy, case, nvme_dir):
    """Whoever changed a buffer between a block's call and its re-run, the re-run reads it
    as it was at the call. Before: a buffer registered as None was never guarded; a change
    made outside the block's forward (the parent, a later block sharing the tensor) or
    through `.data` in a later call than the block's first was not seen, and the copy taken
    at the call was dropped: gradients off from the step it happened, silently (plain
    checkpoint does the same). A buffer that is a view of another was copied apart from
    it: the re-run's update of the one did not reach the other (off from the first
    step; plain checkpoint too)."""
    torch.manual_seed(0)
    model, loss = _buffer_model(case)

    def each(step, ctx):
        UPDATING[0] = step >= 3   # late, through .data: from the fifth step on

    try:
        differs, ctx = train_side_by_side(model, loss, 6, _settings(policy, nvme_dir),
                                          each=each)
    finally:
        UPDATING[0] = False
    assert differs is None, f"differs at step {differs}"
    if policy == "auto":   # the slow link: re-runs ops, so the buffers were at stake
        assert any(bp.per_op for bp in ctx.plan.blocks.values()), ctx.plan


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_an_eval_forward_then_a_train_forward_before_one_backward(policy, nvme_dir):
    """buffers.py rule 6: an eval-mode BatchNorm saves its running statistics themselves,
    and plain autograd's backward reads what they hold then: here what the train-mode
    forward after it wrote (a consistency term next to the training loss). The re-run
    saved them from copies of the call's values: recompute's gradients were off from the
    first step (6.8 in a one-step case), and auto's from its first planned step. Torch's
    checkpoint raises here (its re-run runs in train mode)."""
    model = Net()
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    other = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(2))

    def loss(m):
        m.eval()
        consistency = m(other).pow(2).mean()
        m.train()
        return m(x).pow(2).mean() + 0.5 * consistency

    differs, ctx = train_side_by_side(model, loss, 6, _settings(policy, nvme_dir))
    assert differs is None, f"differs at step {differs}"
    if policy == "auto":   # the slow link: re-runs ops, so the buffers were at stake
        assert any(bp.per_op for bp in ctx.plan.blocks.values()), ctx.plan
    ctx.close()


@pytest.mark.parametrize("model_name", ["Net", "late, through .data"])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_retained_graphs_second_backward_reruns_from_the_calls_buffers(policy, model_name,
                                                                        nvme_dir):
    """A second backward of a retained graph re-runs each block again. Its first re-run
    wrote into the buffer copies it ran on (the counter's `+= 1`, BatchNorm's statistics,
    an update through `.data` switched on in a later call than the first); the second must
    start from the values at the call again (buffers.py rule 2). Before, only modules seen
    changing at a first call or bumping a version got fresh copies: the late `.data`
    update's second re-run ran on what the first re-run wrote, silently."""
    torch.manual_seed(0)
    if model_name == "Net":
        model = Net()
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    else:
        model = nn.Sequential(*[LateDataCodebook() for _ in range(3)])
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    plain = copy.deepcopy(model)
    ctx = offload.activations(model=model, **_settings(policy, nvme_dir))
    for step in range(5):   # auto: warm-up, profile, planned steps
        UPDATING[0] = step >= 3
        for m in (plain, model):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            with ctx if m is model else contextlib.nullcontext():
                loss = m(x).pow(2).mean()
                loss.backward(retain_graph=True)
                loss.backward()
        UPDATING[0] = False
        assert [n for (n, a), b in zip(model.named_parameters(), plain.parameters())
                if not torch.equal(a.grad, b.grad)] == [], f"step {step}"
        assert all(torch.equal(a, b) for a, b in zip(model.buffers(), plain.buffers()))
    if policy == "auto":   # the slow link: re-runs ops, so the buffers were at stake
        assert any(bp.per_op for bp in ctx.plan.blocks.values()), ctx.plan
    ctx.close()


class RotaryCache(nn.Module):
    """A rotary table regrown in forward when a longer sequence comes (Hugging Face's
    LlamaRotaryEmbedding up to 4.36, remote-code models): the buffers are registered anew
    and a plain int says how long they are."""

    def __init__(self, dim: int = 8, length: int = 4) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(0, dim, 2) / dim),
                             persistent=False)
        self._grow(length)

    def _grow(self, length: int) -> None:
        self.max_seq_len_cached = length
        freqs = torch.outer(torch.arange(length, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, length: int):
        if length > self.max_seq_len_cached:
            self._grow(length)
        return self.cos_cached[:length], self.sin_cached[:length]


class RotaryBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.rope = RotaryCache()

    def forward(self, x):
        cos, sin = self.rope(x.shape[1])
        q = self.q(x)
        return x + torch.tanh(q * cos + torch.cat((-q[..., 4:], q[..., :4]), -1) * sin)


class BiasCorrected(nn.Module):
    """An EMA buffer divided by its bias correction, whose step count is a plain int."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("ema", torch.zeros(8))
        self.t = 0

    def forward(self, x):
        y = self.lin(x)
        self.t += 1
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * y.mean((0, 1)))
        return x + torch.tanh(y * self.ema / (1 - 0.9 ** self.t))


class ReadsThroughAttributes(nn.Module):
    """Reads its statistics through attributes: the buffer itself, or a row of it."""

    def __init__(self, row: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("stats", torch.ones(2, 8))
        self.scale = self.stats[1] if row else self.stats

    def forward(self, x):
        y = self.lin(x)
        out = x + torch.tanh(y * self.scale.mean(0))   # read, then updated
        with torch.no_grad():
            self.stats.mul_(0.5).add_(y.mean((0, 1)))
        return out


class SetsUpOnce(nn.Module):
    """A one-time setup in its first forward, kept in an attribute: a hook registered on a
    child (the re-run must not register it again), and a counting buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))
        self.handle = None

    def forward(self, x):
        if self.handle is None:
            self.handle = self.lin.register_forward_hook(lambda m, i, out: out * 1.5)
        self.calls += 1
        return x + torch.tanh(self.lin(x))


class CreatesOnFirstUse(nn.Module):
    """Holds a counting buffer; creates a submodule, with weights, in its first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))
        self.extra = None

    def forward(self, x):
        if self.extra is None:
            self.extra = nn.Linear(8, 8)
        self.calls += 1
        return x + torch.tanh(self.lin(x) + self.extra(x))


class Anneals(nn.Module):
    """A temperature kept as a numpy scalar, annealed at every call, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))
        self.temperature = numpy.float64(2.0)

    def forward(self, x):
        out = x + torch.tanh(self.lin(x) / float(self.temperature))
        self.temperature = self.temperature * numpy.float64(0.9)
        self.calls += 1
        return out


_ATTRIBUTE_BLOCKS = {"rotary cache regrown": RotaryBlock, "step count": BiasCorrected,
                     "an attribute that is the buffer": lambda: ReadsThroughAttributes(False),
                     "an attribute that is a view of it": lambda: ReadsThroughAttributes(True),
                     "a hook set up once": SetsUpOnce,
                     "a submodule created on first use": CreatesOnFirstUse,
                     "a numpy scalar": Anneals}


@pytest.mark.parametrize("case", list(_ATTRIBUTE_BLOCKS))
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_rerun_reads_a_modules_attributes_as_they_were_at_the_call(policy, case,
                                                                      nvme_dir):
    """A module's buffers go with the values it keeps in attributes (buffers.py rule 2).
    Before, the re-run got the rotary table of the call back but the int already said the
    longer length: a size mismatch in backward at the first longer sequence (plain
    checkpoint runs); a step count advanced in forward was read advanced by the re-run,
    and an attribute that is the buffer or a row of it was read as later changed:
    gradients off, silently (plain checkpoint too; also a temperature kept as a numpy
    scalar). An attribute holding an object is left as it is: a hook set up in the first
    forward is not set up again by its re-run (when all attributes were set back, it was:
    two hooks, silently wrong gradients); nor is a submodule created in the first forward
    (setting its `None` back made the re-run create another: the model's got no
    gradient)."""
    torch.manual_seed(0)
    block = _ATTRIBUTE_BLOCKS[case]
    model = nn.Sequential(*[block() for _ in range(3)])
    lengths = [4, 4, 6, 6, 9, 9]   # the forward regrows the table at 6 and at 9
    length = [lengths[0]]
    x = torch.randn(2, 9, 8, generator=torch.Generator().manual_seed(1))

    def each(step, ctx):
        length[0] = lengths[step + 1] if step + 1 < len(lengths) else lengths[-1]

    differs, ctx = train_side_by_side(model, lambda m: m(x[:, :length[0]]).pow(2).mean(),
                                      len(lengths), _settings(policy, nvme_dir), each=each)
    assert differs is None, f"differs at step {differs}"
    if case.startswith("rotary"):
        assert model[0].rope.max_seq_len_cached == 9 and len(model[0].rope.cos_cached) == 9
    elif case == "step count":
        assert model[0].t == len(lengths)
    elif case.startswith("a hook"):
        assert len(model[0].lin._forward_hooks) == 1 and model[0].calls.item() == 6
    elif case.startswith("a submodule"):   # the first forward's, trained: not a re-run's
        assert model[0].extra.weight.grad is not None
    if policy == "auto":   # the slow link: re-runs ops, so the buffers were at stake
        assert any(bp.per_op for bp in ctx.plan.blocks.values()), ctx.plan


class JoinedLater(nn.Module):
    """A block into which a module holding buffers comes after its first calls."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.Identity()
        self.scale = nn.Linear(8, 8)

    def forward(self, x):
        y = self.norm(self.lin(x))
        if "amax" in self.scale._buffers:   # registered from the third step on
            self.scale.amax = 0.9 * self.scale.amax + 0.1 * y.detach().abs().amax()
            y = y / self.scale.amax
        return x + torch.tanh(self.scale(y))


def _join(model: nn.Module, step: int, how: str) -> None:
    for block in model:
        if how == "BatchNorm in place of Identity" and step == 1:
            block.norm = nn.BatchNorm1d(8)
        elif how == "a first buffer" and step == 1:
            block.scale.register_buffer("amax", torch.ones(()))
        elif how == "QAT observers" and step == 0:
            import torch.ao.quantization as tq

            block.qconfig = tq.get_default_qat_qconfig("fbgemm")
            tq.prepare_qat(block, inplace=True)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
@pytest.mark.parametrize("how", ["BatchNorm in place of Identity", "a first buffer",
                                 "QAT observers"])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_module_that_joins_a_block_after_its_first_call_is_guarded(policy, how, nvme_dir):
    """The modules a re-run guards were found at the block's first call. Before, a module
    holding buffers that came later (QAT's observers after a float warm-up, a BatchNorm in
    place of an Identity, a first buffer registered on a module that had none) was not
    guarded: its re-run updated the observers or the running statistics a second time,
    silently. Found again now whenever a module joins (structure.py)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[JoinedLater() for _ in range(3)])
    plain = copy.deepcopy(model)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))

    def each(step, ctx):
        for m in (plain, model):
            _join(m, step, how)

    differs, ctx = train_side_by_side(model, lambda m: m(x).pow(2).mean(), 6,
                                      _settings(policy, nvme_dir), each=each, plain=plain)
    assert differs is None, f"differs at step {differs}"
    if how.startswith("BatchNorm"):
        assert model[0].norm.num_batches_tracked.item() == 4


class ReadsMemory(nn.Module):
    """Reads the entry a dict it is handed holds at its call; later blocks replace it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, memory):
        out = torch.tanh(self.lin(x)) * (1 + memory["h"].mean())
        memory["h"] = out
        return out


class ReadsMemoryModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ReadsMemory() for _ in range(3)])

    def forward(self, x):
        memory = {"h": x}
        for block in self.blocks:
            x = x + block(x, memory)
        return x.pow(2).mean()


@dataclasses.dataclass
class Memory:
    """A block's memory as a dataclass: `h` replaced by every block, `seen` appended to,
    and `gain`, not a field, set anew by every block."""
    h: torch.Tensor
    seen: list

    def __post_init__(self) -> None:
        self.gain = 1.0


@dataclasses.dataclass(frozen=True)
class FrozenMemory:
    """A frozen dataclass holding the dict whose entry every block replaces."""
    slots: dict
    steps: int = 0


class ReadsDataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, memory):
        h = memory.h if isinstance(memory, Memory) else memory.slots["h"]
        gain = memory.gain if isinstance(memory, Memory) else 1.0
        out = torch.tanh(self.lin(x) * gain) * (1 + h.mean())
        if isinstance(memory, Memory):
            memory.gain *= 1.5
            memory.h = out
            memory.seen.append(out)
        else:
            memory.slots["h"] = out
        return out


class ReadsDataclassModel(nn.Module):
    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ReadsDataclass() for _ in range(3)])
        self.frozen = frozen

    def forward(self, x):
        memory = FrozenMemory({"h": x}) if self.frozen else Memory(x, [])
        for block in self.blocks:
            x = x + block(x, memory)
        if not self.frozen:   # the caller's own list: the forward appended to it
            assert len(memory.seen) == len(self.blocks)
            x = x + sum(h.mean() for h in memory.seen)
        return x.pow(2).mean()


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_rerun_sees_a_dataclass_argument_as_it_was_at_the_call(policy, frozen, nvme_dir):
    """A dataclass is one leaf to torch's pytree. Before, the re-run got the caller's own
    object, whose field (or dict entry) later blocks had replaced: gradients off, silently
    (plain checkpoint does the same); then a copy made at the re-run, with an attribute
    that is not a field (`gain`) as later blocks had set it. The forward still writes into
    the caller's object."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    settings = dict(_settings(policy, nvme_dir), tiers="host")
    differs, ctx = train_side_by_side(ReadsDataclassModel(frozen), lambda m: m(x), 5, settings)
    assert differs is None, differs
    if policy == "auto":   # the slow link: re-runs ops, so the arguments were at stake
        assert any(bp.per_op for bp in ctx.plan.blocks.values()), ctx.plan


@pytest.mark.parametrize("tiers", ["host", "nvme"])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_rerun_sees_the_arguments_as_they_were_at_the_call(policy, tiers, nvme_dir):
    """The first block's input needs no gradient (raw data), so checkpoint hands its re-run
    the very input tensor. Before, that looked like the forward: the re-run was given the
    caller's dict, whose entry later blocks had replaced: gradients up to 0.2 off."""
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    settings = dict(_settings(policy, nvme_dir), tiers=tiers)
    differs, ctx = train_side_by_side(ReadsMemoryModel(), lambda m: m(x), 5, settings)
    assert differs is None, differs


class NormHandedIn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, norm):
        return x + torch.tanh(norm(self.lin(x)))


class SharesItsNorm(nn.Module):
    """One BatchNorm of the model's, handed to every block as an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([NormHandedIn() for _ in range(3)])
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x, self.norm)
        return x.pow(2).mean()


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_batchnorm_handed_to_blocks_as_an_argument_counts_each_call_once(policy,
                                                                          nvme_dir):
    """Before: only the block's own modules were guarded; the re-run of each block updated
    the BatchNorm it was handed a second time (num_batches_tracked 2x, running statistics
    off), as plain checkpoint does."""
    torch.manual_seed(0)
    model = SharesItsNorm()
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    differs, ctx = train_side_by_side(model, lambda m: m(x), 4, _settings(policy, nvme_dir))
    assert differs is None, f"differs at step {differs}"
    assert model.norm.num_batches_tracked.item() == 12
    if policy == "auto":   # the slow link: re-runs ops, so the buffers were at stake
        assert any(bp.per_op for bp in ctx.plan.blocks.values()), ctx.plan


class FastWeightsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8),
                                                   nn.Tanh()) for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.mark.parametrize("buffers", [False, True])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_forward_run_with_other_weights_is_rerun_with_them(policy, buffers, nvme_dir):
    """`torch.func.functional_call` with fast weights (MAML): the module's own parameters
    are back before the backward. Before, the re-run computed with them instead of the
    fast weights: gradients ~0.01 off at every checkpointed step, silently (as under
    torch's checkpoint). After each step the model holds its own parameters again."""
    from torch.func import functional_call

    torch.manual_seed(0)
    model = FastWeightsNet()
    model.train(not buffers)
    own = {name: p for name, p in model.named_parameters()}

    def step(index, ctx):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(index))
        fast = {name: (p.detach() * (0.9 - 0.1 * index)).requires_grad_()
                for name, p in own.items()}
        # (params, buffers): in eval mode the BatchNorms normalise with these statistics
        weights = (fast, {name: b * 2 if b.is_floating_point() else b
                          for name, b in model.named_buffers()}) if buffers else fast
        with ctx if ctx is not None else torch.enable_grad():
            loss = functional_call(model, weights, (x,)).pow(2).mean()
            grads = torch.autograd.grad(loss, list(fast.values()))
        assert {name: p for name, p in model.named_parameters()} == own
        return grads

    plain = [step(i, None) for i in range(5)]
    ctx = offload.activations(model=model, **_settings(policy, nvme_dir))
    for i in range(5):
        got = step(i, ctx)
        assert all(torch.equal(a, b) for a, b in zip(plain[i], got)), f"step {i}"
    if policy == "auto":   # the slow link: it re-runs ops
        assert any(bp.per_op for bp in ctx.plan.blocks.values()), ctx.plan
    ctx.close()


class TanhBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.Tanh())
                                     for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.mark.parametrize("how", ["post-accumulate-grad hook", "_apply_optimizer_in_backward"])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_an_optimizer_in_backward_trains_as_in_plain_training(policy, how, nvme_dir):
    """The optimizer steps each weight in its post-accumulate-grad hook (PyTorch's
    optimizer-in-backward recipe, torchtune's optimizer_in_bwd) or in a hook on its
    AccumulateGrad node (torch.distributed.optim's `_apply_optimizer_in_backward`): a bias
    is stepped before its block's re-run, which does not use it for anything backward needs.
    The re-run's check of the weights' versions (weights.py) must leave such weights out;
    weights and losses must equal plain training's, bit for bit."""
    class Shifted(nn.Module):   # a bias of its own after the tanh: its grad comes first
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.shift = nn.Linear(8, 8), nn.Parameter(torch.zeros(8))

        def forward(self, x):
            return torch.tanh(self.lin(x)) + self.shift

    def train(ctx):
        torch.manual_seed(0)
        model = TanhBlocks()
        model.blocks = nn.ModuleList([Shifted() for _ in range(3)])

        def step_now(p):
            with torch.no_grad():
                p.add_(p.grad, alpha=-0.1)
            p.grad = None

        if how == "post-accumulate-grad hook":
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(step_now)
        else:
            from torch.distributed.optim import _apply_optimizer_in_backward

            _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
        losses = []
        for step in range(6):   # past auto's profile and trial steps
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step))
            with ctx(model) if ctx is not None else contextlib.nullcontext():
                loss = model(x).pow(2).sum()
                loss.backward()
            losses.append(loss.detach())
        return losses, [p.detach() for p in model.parameters()]

    plain = train(None)
    ours = train(lambda model: offload.activations(model=model, **_settings(policy, nvme_dir)))
    assert all(map(torch.equal, plain[0], ours[0])) and all(map(torch.equal, plain[1], ours[1]))


class SwitchesItsDropout(nn.Module):
    """Puts its Dropout in eval() for some inputs and back at the end of its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(16, 16), nn.Linear(16, 16), nn.Dropout(0.5)

    def forward(self, x):
        if x.mean().item() > 0:
            self.drop.eval()
        h = self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(x))))
        self.drop.train(self.training)
        return x + h


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_re_run_stopped_early_leaves_every_module_in_its_mode(policy, nvme_dir):
    """Before: checkpoint stops a re-run once backward has what it needs, before the line
    that puts the Dropout back in train(): it stayed in eval(), and the next steps ran
    without dropout, silently (as under torch's checkpoint; a module with buffers was set
    back already: buffers.py NOTE [Buffers in a re-run] rule 5)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[SwitchesItsDropout() for _ in range(3)])
    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) + (-1) ** i
          for i in range(2)]
    calls = []

    def loss(m):   # positive inputs at even steps, negative at odd ones (plain, then ours)
        calls.append(1)
        return m(xs[(len(calls) - 1) // 2 % 2]).pow(2).sum()

    def each(step, ctx):
        assert [b.drop.training for b in model] == [True] * 3, step

    differs, ctx = train_side_by_side(model, loss, 8, _settings(policy, nvme_dir), each=each)
    assert differs is None, f"differs at step {differs}"
    ctx.close()


# ---------------------------------------------------------------- forward AD, torch.func
class NormedBlock(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.fc, self.norm, self.checkpointed = nn.Linear(16, 16), nn.LayerNorm(16), checkpointed

    def forward(self, x):
        if self.checkpointed:   # the user's own checkpoint
            return x + torch.utils.checkpoint.checkpoint(self._body, x, use_reentrant=False)
        return x + self._body(x)

    def _body(self, x):
        return self.norm(self.fc(x)).tanh()


def _forward_ad(model, x, t):
    import torch.autograd.forward_ad as fwad
    with fwad.dual_level():
        out = fwad.unpack_dual(model(fwad.make_dual(x, t)))
        return out.primal, out.tangent


def _jvp(model, x, t):
    return torch.func.jvp(model, (x,), (t,))


def _vmap(model, x, t):
    return torch.func.vmap(model)(x), t


def _steps_match_plain(model, policy, nvme_dir, step) -> None:
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 16, generator=gen), torch.randn(4, 16, generator=gen))
               for _ in range(5)]
    plain = [step(*b) for b in batches]
    ctx = offload.activations(model=model, **_settings(policy, nvme_dir))
    for i, b in enumerate(batches):
        with ctx:
            got = step(*b)
        assert all(map(torch.equal, plain[i], got)), f"step {i}"
    ctx.close()


@pytest.mark.parametrize("transform", [_forward_ad, _jvp, _vmap], ids=["forward-ad", "jvp", "vmap"])
@pytest.mark.parametrize("policy", ["offload", "recompute", "auto"])
def test_forward_ad_jvp_and_vmap_in_a_step_are_exact(policy, transform, nvme_dir):
    """Before: under recompute / auto a block called inside jvp or vmap raised "Cannot
    access storage of TensorWrapper" (torch's checkpoint took its wrappers), and
    forward-mode AD under auto gave LayerNorm tangents an ulp off at the profiled step and
    checkpoint's CheckpointError after it. Blocks inside these run as is now (blocks.py
    NOTE [Whose block]); the tangent too is bit-exact, also in the loss."""
    torch.manual_seed(0)
    model = nn.Sequential(*[NormedBlock() for _ in range(3)])
    params = list(model.parameters())

    def step(x, t):
        primal, tangent = transform(model, x, t)
        loss = primal.pow(2).mean() + tangent.pow(2).mean() + model(x).sum()
        return [primal.detach(), tangent.detach()] + list(torch.autograd.grad(loss, params))

    _steps_match_plain(model, policy, nvme_dir, step)


@pytest.mark.parametrize("transform", [_forward_ad, _jvp], ids=["forward-ad", "jvp"])
def test_a_jvp_through_the_users_own_checkpoint_is_exact(transform, nvme_dir):
    """Before: a jvp (for a value) of a model that checkpoints its own blocks raised "Cannot
    access storage of TensorWrapper" under offload: torch's checkpoint handed our pack hook
    the jvp's wrapper. Plain torch, save_on_cpu and an identity hook run it; a tensor with
    no storage of its own stays now. (A loss over the tangent fails in torch's checkpoint
    itself, with or without us.)"""
    torch.manual_seed(0)
    model = nn.Sequential(*[NormedBlock(checkpointed=True) for _ in range(3)])
    params = list(model.parameters())

    def step(x, t):
        primal, tangent = transform(model, x, t)
        return [primal.detach(), tangent.detach()] + \
            list(torch.autograd.grad(model(x).pow(2).sum(), params))

    _steps_match_plain(model, "offload", nvme_dir, step)


# ---------------------------------------------------------------- random generators
NOISE = torch.Generator()   # a generator held outside the model (a module global)


class AnotherThreadDraws(nn.Module):
    """Two dropouts; between them another thread draws from torch's default generator,
    in the forward only or in the re-run only (as a background thread's `torch.rand` may
    land in either)."""

    def __init__(self, when: str) -> None:
        super().__init__()
        self.fc, self.drop, self.when = nn.Linear(16, 16), nn.Dropout(0.5), when

    def forward(self, x):
        h = self.drop(self.fc(x))
        in_backward = torch._C._current_graph_task_id() != -1
        if (self.when == "re-run") == in_backward:
            other = threading.Thread(target=torch.rand, args=(7,))
            other.start()
            other.join()
        return x + self.drop(h).tanh()


@pytest.mark.parametrize("when", ["forward", "re-run"])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_another_thread_drawing_while_a_block_runs_raises_instead_of_a_wrong_gradient(
        policy, when, nvme_dir):
    """Before: the re-run drew other dropout masks than the forward, and the gradient
    silently differed from plain autograd's (as under torch's checkpoint): from the 1st
    step under recompute, from the first planned one under auto (generators.py rule 4)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[AnotherThreadDraws(when) for _ in range(3)])
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    plain = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    ctx = offload.activations(model=model, **_settings(policy, nvme_dir))
    with pytest.raises(offload.OffloadError, match=r"a block's re-run in backward .* would "
                       r"draw other random numbers than its forward: torch's default CPU "
                       r"generator was elsewhere before its 2nd random call \(dropout\)"
                       r".* Either another thread drew from it"):
        for _ in range(8):
            torch.manual_seed(5)
            with ctx:
                ours = torch.autograd.grad(model(x).sum(), list(model.parameters()))
            assert all(map(torch.equal, plain, ours))   # the steps that ran it as it is
    ctx.close()


class TwoDropouts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(16, 16), nn.Dropout(0.5)

    def forward(self, x):
        return x + self.drop(self.drop(self.fc(x)).tanh())


def _interrupt_as_torch_leaves_a_function_mode():
    """A trace function raising KeyboardInterrupt where a real Ctrl-C landed: on entry to
    the exit of torch's `_pop_mode_temporarily`, the context manager around a function
    mode's handler (generators.py NOTE [Modes and Ctrl-C])."""
    armed = [True]

    def trace(frame, event, arg):
        if event == "call" and armed[0] and frame.f_code.co_name == "__exit__" and \
                frame.f_code.co_filename == contextlib.__file__ and getattr(getattr(
                    frame.f_locals.get("self"), "gen", None), "__name__", "") == \
                "_pop_mode_temporarily":
            armed[0] = False
            raise KeyboardInterrupt
    return trace


@pytest.mark.parametrize("when", ["forward", "re-run"])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_ctrl_c_inside_a_random_call_of_a_block_leaves_no_mode_behind(policy, when,
                                                                       nvme_dir):
    """A KeyboardInterrupt on the exit of torch's `_pop_mode_temporarily` (a real SIGINT
    landed there in ~1 of 300 random interrupts) came out as "RuntimeError: trying to pop
    from empty mode stack", and the collected generator put our mode back on torch's stack
    for good: every later torch call went through it, and a later dropout outside offload
    raised the re-run check's OffloadError."""
    import sys
    torch.manual_seed(0)
    model = nn.Sequential(*[TwoDropouts() for _ in range(3)])
    x = torch.randn(4, 16)
    params = list(model.parameters())

    def step(ctx, interrupt=False):
        torch.manual_seed(5)
        with ctx if ctx is not None else contextlib.nullcontext():
            if interrupt and when == "forward":
                sys.settrace(_interrupt_as_torch_leaves_a_function_mode())
            try:
                loss = model(x).sum()
                if interrupt and when == "re-run":
                    sys.settrace(_interrupt_as_torch_leaves_a_function_mode())
                return torch.autograd.grad(loss, params)
            finally:
                sys.settrace(None)

    plain = step(None)
    ctx = offload.activations(model=model, **_settings(policy, nvme_dir))
    for _ in range(3):
        assert all(map(torch.equal, plain, step(ctx)))
    interrupted = False
    try:
        step(ctx, interrupt=True)
    except KeyboardInterrupt:
        interrupted = True
    assert interrupted
    gc.collect()   # the abandoned generator puts our mode back now
    assert all(map(torch.equal, plain, step(ctx)))
    assert torch._C._len_torch_function_stack() == 0
    torch.nn.functional.dropout(torch.ones(8), 0.5).sum()   # outside offload: no check
    ctx.close()


class OwnNoise(nn.Module):
    """Draws from its own generator (an attribute) out of place, and from one held outside
    the model in place: what a noise layer or an augmentation does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.g = torch.Generator()

    def forward(self, x):
        x = x + 0.1 * torch.randn(x.shape, generator=self.g)
        x = x * torch.empty_like(x).bernoulli_(0.9, generator=NOISE)
        return self.lin(x * torch.rand(x.shape, generator=self.g)).tanh()


def _noise_step(model, x, ctx) -> list[torch.Tensor]:
    """One step from freshly seeded generators: the gradients, and the generators' states
    after it (plain training advances each once)."""
    for i, block in enumerate(model):
        block.g.manual_seed(i)
    NOISE.manual_seed(7)
    model.zero_grad(set_to_none=True)
    with ctx if ctx is not None else torch.enable_grad():
        model(x).pow(2).mean().backward()
    return [p.grad for p in model.parameters()] + [NOISE.get_state()] + \
        [block.g.get_state() for block in model]


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_block_drawing_from_its_own_generators_draws_the_same_in_its_rerun(policy,
                                                                             nvme_dir):
    """Before: checkpoint sets back only the default generators, so the re-run drew other
    noise: gradients ~7e-4 off at every step that recomputed, silently, and each generator
    advanced twice a step. Bit-exact now, the generators left as plain training leaves
    them, also after the first call (which finds the outside generator)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[OwnNoise() for _ in range(4)])
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    plain = _noise_step(model, x, None)
    for step in range(4):
        ctx = offload.activations(model=model, **_settings(policy, nvme_dir))
        got = _noise_step(model, x, ctx)
        assert all(torch.equal(a, b) for a, b in zip(plain, got)), f"step {step}"
        if policy == "auto" and step == 3:   # the slow link: it re-runs ops
            assert any(bp.per_op for bp in ctx.plan.blocks.values()), ctx.plan
        ctx.close()


LATE_NOISE = torch.Generator()   # drawn from only once noise is switched on
NOISE_ON = [False]


class LateNoise(nn.Module):
    """Draws from a generator its caller hands it, or from LATE_NOISE once NOISE_ON: both
    first drawn from in a later call than the block's first."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, gen=None):
        h = self.lin(x).tanh()
        if gen is not None:
            h = h * (torch.rand(h.shape, generator=gen) > 0.3)
        if NOISE_ON[0]:
            h = h + 0.1 * torch.randn(h.shape, generator=LATE_NOISE)
        return x + h.sin()


class LateNoiseModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([LateNoise() for _ in range(3)])

    def forward(self, x, gen=None):
        for block in self.blocks:
            x = block(x, gen=gen)
        return x.pow(2).mean()


@pytest.mark.parametrize("policy", ["recompute", "auto"])
@pytest.mark.parametrize("where", ["new argument each step", "global from step 2"])
def test_a_generator_first_drawn_from_after_the_first_call_draws_the_same_in_the_rerun(
        policy, where, nvme_dir):
    """Before: only generators that were attributes or that the block's first call (ever)
    drew from were set back, so a generator handed in new each step, or one first drawn
    from once noise was switched on, drew other numbers in the re-run: gradients ~0.05 off,
    silently. Bit-exact now, and the generator leaves the step where plain training does."""
    def step(model, index, ctx):
        model.zero_grad(set_to_none=True)
        gen = torch.Generator().manual_seed(13 + index) if where.startswith("new") else None
        NOISE_ON[0] = where.startswith("global") and index >= 2
        LATE_NOISE.manual_seed(7)
        with ctx if ctx is not None else torch.enable_grad():
            model(x, gen=gen).backward()
        return [p.grad for p in model.parameters()] + [LATE_NOISE.get_state()] + \
            ([gen.get_state()] if gen is not None else [])

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = LateNoiseModel()
    try:
        plain = [step(model, i, None) for i in range(4)]
        ctx = offload.activations(model=model, **_settings(policy, nvme_dir))
        for i in range(4):
            got = step(model, i, ctx)
            assert all(torch.equal(a, b) for a, b in zip(plain[i], got)), f"step {i}"
        if policy == "auto":   # the slow link: it re-runs ops
            assert any(bp.per_op for bp in ctx.plan.blocks.values()), ctx.plan
        ctx.close()
    finally:
        NOISE_ON[0] = False


class _LastDropout(nn.Module):
    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(16, 16), nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc(x)).tanh()


def _steps_against_plain(model, policy, nvme_dir, steps=4):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    plain = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    ctx = offload.activations(model=model, **_settings(policy, nvme_dir))
    try:
        for _ in range(steps):
            torch.manual_seed(5)
            with ctx:
                ours = torch.autograd.grad(model(x).sum(), list(model.parameters()))
            assert all(map(torch.equal, plain, ours))
    finally:
        ctx.close()


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_another_thread_drawing_inside_a_blocks_last_random_call_raises(policy, nvme_dir,
                                                                        monkeypatch):
    """Review: rule 4 checked the state before each random call only; a draw by another
    thread between that check and the op's own draw (inside F.dropout), in a block's last
    random call, went unseen: silently wrong gradients. Each call is checked after, too."""
    real = torch._C._VariableFunctions.dropout

    def racy(*args, **kwargs):
        if torch._C._current_graph_task_id() != -1:   # in the re-run only
            other = threading.Thread(target=torch.rand, args=(7,))
            other.start()
            other.join()
        return real(*args, **kwargs)

    torch.manual_seed(0)
    model = nn.Sequential(*[_LastDropout() for _ in range(3)])
    monkeypatch.setattr(torch.nn.functional._VF, "dropout", racy, raising=False)
    with pytest.raises(offload.OffloadError, match=r"elsewhere after its 1st random call "
                       r"\(dropout\)"):
        _steps_against_plain(model, policy, nvme_dir, steps=8)


@pytest.mark.parametrize("policy", ["recompute", "auto"])
@pytest.mark.parametrize("draws_nothing", ["p=0", "eval", "attention dropout_p=0"])
def test_calls_that_draw_nothing_are_not_checked(policy, draws_nothing, nvme_dir):
    """Review: a dropout with p == 0 or in eval(), or attention with dropout_p == 0 (every
    Llama-style block), was checked too: another thread's draw meanwhile raised
    OffloadError though the gradient was exact. Here a thread draws in every re-run."""
    class Attends(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            q = self.fc(x).view(4, 2, 8)
            draw_elsewhere()
            return x + torch.nn.functional.scaled_dot_product_attention(
                q, q, q, dropout_p=0.0).reshape(4, 16)

    class Drops(_LastDropout):
        def forward(self, x):
            h = self.drop(self.fc(x))
            draw_elsewhere()
            return x + self.drop(h).tanh()

    def draw_elsewhere():
        if torch._C._current_graph_task_id() != -1:
            other = threading.Thread(target=torch.rand, args=(7,))
            other.start()
            other.join()

    torch.manual_seed(0)
    if draws_nothing == "attention dropout_p=0":
        model = nn.Sequential(*[Attends() for _ in range(3)])
    else:
        model = nn.Sequential(*[Drops(0.0 if draws_nothing == "p=0" else 0.5)
                                for _ in range(3)])
        if draws_nothing == "eval":
            for block in model:
                block.drop.eval()
    _steps_against_plain(model, policy, nvme_dir, steps=6)


# ---------------------------------------------------------------- arguments written into
class CollectsAux(nn.Module):
    """Appends an auxiliary loss to the list it is handed and counts itself in a dict, as
    MoE layers collect their load-balancing losses."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.router = nn.Linear(16, 4)

    def forward(self, x, aux, stats, *, scale):
        aux.append(self.router(x).softmax(-1).pow(2).mean() * scale)
        stats["calls"] = stats.get("calls", 0) + len(aux)   # reads what earlier blocks wrote
        return x + torch.tanh(self.lin(x))


class CollectsAuxModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([CollectsAux() for _ in range(3)])

    def forward(self, x):
        aux, stats = [], {}
        for block in self.blocks:
            x = block(x, aux, stats, scale=torch.tensor(2.0))
        assert len(aux) == 3 and stats == {"calls": 6}, (len(aux), stats)
        return x.pow(2).mean() + sum(aux) + stats["calls"]


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_list_or_dict_a_block_writes_into_is_the_callers(policy, nvme_dir):
    """Before: the call's arguments were rebuilt for checkpoint (tensors inside them passed
    positionally), so a block appended its auxiliary loss to a copy of the caller's list:
    the loss left them out, gradients silently wrong at every checkpointed step. The re-run
    writes into a copy of the arguments as they were at the call, not the caller's list."""
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1))
    differs, ctx = train_side_by_side(CollectsAuxModel(), lambda m: m(x), 6,
                                      _settings(policy, nvme_dir))
    assert differs is None, differs
    if policy == "auto":   # the slow link: it re-runs ops
        assert any(bp.per_op for bp in ctx.plan.blocks.values()), ctx.plan


class TakesOptions(nn.Module):
    """Called as Hugging Face decoder layers are: keyword and non-tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x, mask=None, *, scale: float = 1.0):
        return x + torch.tanh(self.lin(x)) * scale


class KeepsTrack(nn.Module):
    """Notes a weak reference to each block's input: what is alive before the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TakesOptions() for _ in range(4)])
        self.inputs: list = []

    def forward(self, x):
        self.inputs = []
        for block in self.blocks:
            x = x * 1.0001   # a fresh input for each block, referenced by nothing else
            self.inputs.append(weakref.ref(x))
            x = block(x, mask=None, scale=0.5)
        return x.pow(2).mean()


@pytest.mark.parametrize("tiers", ["host", "nvme"])
def test_a_blocks_inputs_are_not_held_until_backward_when_called_with_options(tiers,
                                                                             nvme_dir):
    """checkpoint saves a block's inputs through our hooks, which move them. Before, the
    function we hand checkpoint held the call's arguments for its re-run, so every block
    called with a keyword or a non-tensor argument (every Hugging Face decoder layer) kept
    its input tensor in memory until backward. Now none is alive between the forward and
    the backward, and the gradients are plain training's."""
    torch.manual_seed(0)
    model = KeepsTrack()
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    plain = copy.deepcopy(model)
    plain(x).backward()
    with offload.activations(model=model, **dict(_settings("recompute", nvme_dir),
                                                 tiers=tiers)):
        loss = model(x)
        gc.collect()
        alive = [ref() is not None for ref in model.inputs]
        loss.backward()
    assert alive == [False] * 4
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(),
                                                             plain.parameters()))


class KeepsLastMap(nn.Module):
    """Holds a mask buffer and keeps its last attention map in an attribute (to plot)."""

    def __init__(self, detach: bool = True) -> None:
        super().__init__()
        self.qk = nn.Linear(16, 32)
        self.register_buffer("mask", torch.tril(torch.ones(12, 12, dtype=torch.bool)))
        self.last_map = None
        self.detach = detach

    def forward(self, x):
        q, k = self.qk(x).chunk(2, -1)
        att = (q @ k.transpose(-1, -2)).masked_fill(~self.mask, -1e9).softmax(-1)
        self.last_map = att.detach() if self.detach else att   # (kept for a loss: grad)
        return x + att @ x


@pytest.mark.parametrize("detach", [True, False], ids=["detached", "with_grad"])
def test_a_tensor_a_guarded_module_kept_in_an_attribute_is_not_held_until_backward(
        detach, nvme_dir):
    """A module holding buffers is guarded (buffers.py): what its attributes held at the
    call is noted. A tensor there (the last step's attention map) must not be held by us
    until this call's backward, where plain training frees it as the forward replaces it
    (when every attribute was noted, each block's previous map stayed alive)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[KeepsLastMap(detach) for _ in range(3)])
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(1))
    with offload.activations(model=model, **_settings("recompute", nvme_dir)):
        model(x).pow(2).mean().backward()
        previous = [weakref.ref(block.last_map) for block in model]
        loss = model(x).pow(2).mean()
        gc.collect()
        alive = [ref() is not None for ref in previous]
        loss.backward()
    assert alive == [False] * 3


# ---------------------------------------------------------------- a block's own pre-hooks
class ResidualLayer(nn.Module):
    """x + tanh(x W^T + b): ops of its own to re-run, beside the weight's."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) * 0.3)
        self.bias = nn.Parameter(torch.zeros(8))

    def forward(self, x):
        return x + torch.tanh(F.linear(x, self.weight, self.bias))


class DropConnect(nn.Module):
    """A residual layer whose weight a forward pre-hook on it draws at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_forward_pre_hook(
            lambda m, args: setattr(m, "weight", F.dropout(m.lin.weight, 0.3)))

    def forward(self, x):
        return x + torch.tanh(F.linear(x, self.weight, self.lin.bias))


# Blocks whose own forward pre-hook sets the weight they compute with, at every call.
pre_hook_weights = pytest.mark.parametrize(
    "make", [lambda: torch.nn.utils.spectral_norm(ResidualLayer()), DropConnect],
    ids=["old_spectral_norm", "dropconnect"])


def _assert_same_steps(plain, ours) -> None:
    """Two runs' (per-step tensors, buffers at the end): bit-exact."""
    (plain_steps, plain_buffers), (our_steps, our_buffers) = plain, ours
    for step, (a, b) in enumerate(zip(plain_steps, our_steps)):
        assert all(map(torch.equal, a, b)), f"step {step}"
    assert all(map(torch.equal, plain_buffers, our_buffers))


class Discriminator(nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(make() for _ in range(4))
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


@pytest.mark.parametrize("policy", ["recompute", "auto"])
@pre_hook_weights
def test_a_block_whose_own_pre_hook_sets_its_weight_called_twice_is_exact(policy, make,
                                                                          nvme_dir):
    """A GAN discriminator step: each block called on real and on fake inputs, one backward.
    The block's own forward pre-hook (old-style spectral_norm: `weight = orig / sigma` with
    a power iteration; DropConnect) sets the weight it computes with as a plain attribute at
    each call, outside the checkpoint: the first call's re-run computed with the second
    call's weight, silently wrong gradients (a helper's report; torch's checkpoint does the
    same). buffers.py NOTE [Buffers in a re-run] rule 8. Six steps: `auto`'s plans too."""
    def train(use_offload: bool):
        model = Discriminator(make)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx = offload.activations(model=model, **_settings(policy, nvme_dir)) \
            if use_offload else contextlib.nullcontext()
        data = torch.Generator().manual_seed(1)
        grads = []
        for step in range(6):
            real, fake = torch.randn(4, 8, generator=data), torch.randn(4, 8, generator=data)
            torch.manual_seed(step)
            with ctx:
                loss = F.softplus(-model(real)).mean() + F.softplus(model(fake)).mean()
                loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        return grads, [b.clone() for b in model.buffers()]

    _assert_same_steps(train(False), train(True))


@pytest.mark.parametrize("policy", ["recompute", "auto"])
@pre_hook_weights
def test_a_frozen_block_whose_pre_hook_sets_its_weight_called_twice_is_exact(policy, make,
                                                                             nvme_dir):
    """The generator's step: the discriminator frozen (`requires_grad_(False)`, still in
    train mode) and called on two fake batches before one backward. Its pre-hook's weight
    needs no grad then, and a rule 8 that kept only tensors requiring grad re-ran the first
    call with the second's (a review's report). Gradients of the fakes bit-exact."""
    def grads(use_offload: bool):
        model = Discriminator(make).requires_grad_(False)
        ctx = offload.activations(model=model, **_settings(policy, nvme_dir)) \
            if use_offload else contextlib.nullcontext()
        data = torch.Generator().manual_seed(1)
        out = []
        for step in range(6):
            fakes = [torch.randn(4, 8, generator=data).requires_grad_() for _ in range(2)]
            torch.manual_seed(step)
            with ctx:
                sum(F.softplus(-model(fake)).mean() for fake in fakes).backward()
            out.append([fake.grad for fake in fakes])
        return out, [b.clone() for b in model.buffers()]

    _assert_same_steps(grads(False), grads(True))


# ---------------------------------------------------------------- lazy modules
class LazyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.LazyLinear(16)
        self.norm = nn.LazyBatchNorm1d()

    def forward(self, x):
        return x + torch.tanh(self.norm(self.lin(x)))


class LazyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.LazyLinear(16)
        self.blocks = nn.ModuleList([LazyBlock() for _ in range(3)])

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


@pytest.mark.parametrize("policy", ["offload", "recompute", "auto"])
def test_a_lazy_model_trains_bit_exact_and_its_blocks_are_checkpointed_once_they_ran(
        policy, nvme_dir):
    """Before: `model=` with `nn.LazyLinear` raised ValueError (an uninitialised parameter
    has no storage) at entry under every policy. A lazy block's first call runs as is (its
    re-run could not start from the call's state); from its second call it is
    checkpointed: `recompute`'s later steps save fewer tensors than its first."""
    model, plain = (torch.manual_seed(0) and LazyNet() for _ in range(2))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    saved = []
    differs, ctx = train_side_by_side(model, lambda m: m(x), 4, _settings(policy, nvme_dir),
                                      each=lambda step, c: saved.append(c.stats.packed_tensors),
                                      plain=plain)
    assert differs is None, f"differs at step {differs}"
    assert isinstance(model.blocks[0].lin, nn.Linear) and saved[2] == saved[3], saved
    if policy == "recompute":
        assert saved[0] > saved[1] == saved[3], saved
    ctx.close()


class LazyNormHandedIn(nn.Module):
    """One lazy BatchNorm of the model's, handed to every block as an argument."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([NormHandedIn() for _ in range(3)])
        self.norm = nn.LazyBatchNorm1d()

    def forward(self, x):
        for block in self.blocks:
            x = block(x, self.norm)
        return x.pow(2).mean()


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_lazy_module_handed_to_blocks_runs_its_first_call_as_is(policy, nvme_dir):
    """Before: only the block's own modules were checked for lazy ones; a lazy BatchNorm
    handed in as an argument made the call copy its uninitialised buffers: ValueError at
    the first step. Now that call runs as is, and training is plain training's."""
    model, plain = (torch.manual_seed(0) and LazyNormHandedIn() for _ in range(2))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    differs, ctx = train_side_by_side(model, lambda m: m(x), 4, _settings(policy, nvme_dir),
                                      plain=plain)
    assert differs is None, f"differs at step {differs}"
    assert model.norm.num_batches_tracked.item() == 12
    ctx.close()


class LazyBranch(nn.Module):
    """A lazy layer used only once `deep` is switched on (a branch not taken at first)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.extra = nn.LazyLinear(8)
        self.deep = False

    def forward(self, x):
        h = self.lin(x)
        if self.deep:
            h = h + self.extra(x)
        return x + torch.tanh(h)


def test_a_block_whose_lazy_module_has_not_run_says_so_and_is_checkpointed_once_it_ran(
        nvme_dir, caplog):
    """A lazy module in a branch the calls do not take keeps its block's calls as is (its
    re-run could not start from the call's state): said once per block, in the log; from
    the first call after the branch ran, the block is checkpointed. Before, nothing was
    said. Gradients plain training's."""
    model, plain = (torch.manual_seed(0) and nn.Sequential(LazyBranch(), LazyBranch())
                    for _ in range(2))
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    saved = []

    def each(step, ctx):
        saved.append(ctx.stats.packed_tensors)
        for m in (model, plain):
            for block in m:
                block.deep = step >= 1

    with caplog.at_level("INFO", logger="offload"):
        differs, ctx = train_side_by_side(model, lambda m: m(x).pow(2).mean(), 5,
                                          _settings("recompute", nvme_dir), each=each,
                                          plain=plain)
    assert differs is None, f"differs at step {differs}"
    said = [r.message for r in caplog.records if "lazy modules" in r.message]
    assert len(said) == 2 and "LazyLinear" in said[0], said   # once per block
    # as is, the branch not taken; as is, the branch taken (runs it first); checkpointed
    assert saved[0] == saved[1] < saved[2] and saved[3] == saved[4] < saved[0], saved
    ctx.close()


def test_weights_of_a_scripted_module_are_not_guarded_and_do_not_break_the_re_run():
    """A ScriptModule's `_parameters` is not a dict (no `.get`): guarding its weights raised
    AttributeError from inside offload in every re-run (torch's own checkpoint of such a
    block fails in the TorchScript interpreter; ours now gets there as well)."""
    from offload.schedule.weights import guard_weights

    scripted = torch.jit.script(nn.Linear(4, 4))
    runs = []
    guarded = guard_weights([scripted], lambda x: runs.append(1) or scripted(x))
    x = torch.randn(2, 4)
    assert torch.equal(guarded(x), guarded(x)) and len(runs) == 2   # call, then re-run
