"""A weight changed in place between a block's forward and its re-run in backward
(offload/schedule/weights.py NOTE [Weights in a re-run]).

Plain autograd computes the gradient from the values the forward ran with, or raises its
in-place error for a weight an op saved. A re-run computes with what the weight holds
then: another function than the forward ran. Before, `recompute` and `auto` did so
silently (as torch's checkpoint does); now the re-run raises autograd's error, naming the
weight. What moves a weight's counter on its own in every call (an embedding's
`max_norm`), and an optimizer that steps weights in backward, must not raise."""
from __future__ import annotations

import contextlib
import logging

import pytest
import torch
import torch.nn as nn

import offload

from schedule_models import SLOW


@pytest.fixture(autouse=True)
def _one_thread(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    yield
    torch.set_num_threads(threads)


def _settings(policy, nvme_dir):
    # The slow disk makes `auto` re-run its blocks (else nothing below would raise).
    return dict(policy=policy, tiers="nvme", nvme_dir=nvme_dir, min_bytes=0, probe=SLOW)


def _rerun_next(ctx, policy: str) -> None:
    """auto's next steps run `checkpoint` (every block re-run), whatever its trials' order:
    which trial a step ran decided whether these tests re-ran anything (an `offload` trial
    re-runs nothing; the plan of a model this small may not)."""
    if policy == "auto":
        ctx.plan.trial_steps.pending = ["checkpoint"] * 4


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])


def _step_between_backwards(model, loss):
    loss.backward(retain_graph=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-0.1)   # an optimizer step before the second backward
    loss.backward()


def _bias_set_before_backward(model, loss):
    with torch.no_grad():
        model[1][0].bias.add_(1.0)   # no op saves a bias: plain autograd computes
    loss.backward()


@pytest.mark.parametrize("change", [_step_between_backwards, _bias_set_before_backward],
                         ids=["optimizer step between backwards", "bias set before backward"])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_weight_changed_before_its_blocks_re_run_raises(policy, change, nvme_dir):
    """Before, both ran: the step-between-backwards case (plain raises) gave a gradient,
    and the bias case gave another one than plain training, silently (the re-run's tanh
    read the new bias)."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    plain = _stack()
    try:
        change(plain, plain(x).pow(2).sum())
        plain_raised = False
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
        plain_raised = True
    assert plain_raised == (change is _step_between_backwards)

    model = _stack()
    ctx = offload.activations(model=model, **_settings(policy, nvme_dir))
    for step in range(4):   # auto: warm-up, profile, planned steps; unchanged weights run
        with ctx:
            model(x).pow(2).sum().backward()
    _rerun_next(ctx, policy)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation(.|\n)*"
                                           r"offload: it is `0\.(weight|bias)` of the block "
                                           r"\(a Sequential\), read by a block re-run"):
        with ctx:
            change(model, model(x).pow(2).sum())
    with ctx:   # the context goes on
        model(x).pow(2).sum().backward()
    ctx.close()


class _Renormed(nn.Module):
    """A block whose embedding renormalises the rows it looks up in place in every call
    (`max_norm`), its re-run's included."""

    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.emb, self.lin = emb, nn.Linear(16, 16)

    def forward(self, x, ids=None):
        return x + torch.tanh(self.lin(x if ids is None else x * self.emb(ids)))


class _RenormedStack(nn.Module):
    """Its own embedding per block, or one shared by every block (each block's call then
    changes the weight after the calls before it)."""

    def __init__(self, shared: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        one = nn.Embedding(50, 16, max_norm=1.0) if shared else None
        # rows of norm ~4 (N(0, 1) init): renormalised at their first lookup
        self.blocks = nn.ModuleList([_Renormed(one or nn.Embedding(50, 16, max_norm=1.0))
                                     for _ in range(3)])

    def forward(self, x, ids):
        for i, block in enumerate(self.blocks):
            x = block(x, ids[i])
        return x


@pytest.mark.parametrize("shared", [False, True], ids=["own embedding", "shared embedding"])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_an_embedding_with_max_norm_trains_as_in_plain_training(policy, shared, nvme_dir):
    """A `max_norm` embedding bumps its weight's version in every call: the later blocks'
    calls, the re-runs, a retained graph's second backward. None of them raises. Its re-run
    reads the rows as the forward left them: before, `recompute`'s renormalised them once
    more, which is not the identity in float32 (gradients off by 4e-9 and the weight itself
    by 1.2e-7 after one step, as under torch's checkpoint; `auto` stored the lookup here).
    The gradients of both backwards and the weights after AdamW steps equal plain
    training's, bit for bit (the shared embedding's blocks read disjoint rows: see
    weights.py)."""
    x = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 50, (3, 4, 6), generator=torch.Generator().manual_seed(2))
    if shared:
        ids = torch.randperm(50, generator=torch.Generator().manual_seed(2))[:36].view(3, 4, 3)

    def train(ctx):
        model = _RenormedStack(shared)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = []
        for step in range(5):
            opt.zero_grad(set_to_none=True)
            with ctx(model) if ctx is not None else contextlib.nullcontext():
                loss = model(x[:, :ids.shape[-1]], ids).pow(2).sum()
                loss.backward(retain_graph=True)
                first = [p.grad.clone() for p in model.parameters()]
                loss.backward()
            out.append(first + [p.grad.clone() for p in model.parameters()])
            opt.step()
        return out, [p.detach() for p in model.parameters()]

    made = []

    def ours(model):
        if not made:
            made.append(offload.activations(model=model, **_settings(policy, nvme_dir)))
        return made[0]

    (plain, plain_weights), (grads, weights) = train(None), train(ours)
    for step, (a, b) in enumerate(zip(plain, grads)):
        assert all(map(torch.equal, a, b)), f"step {step}"
    assert all(map(torch.equal, plain_weights, weights))
    made[0].close()


class _Shifted(nn.Module):
    """Handed a parameter as an argument (`block(x, self.shift)`): not one of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, shift):
        return torch.tanh(self.lin(x) + shift)


class _ShiftedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shift = nn.Parameter(torch.zeros(8))
        self.blocks = nn.ModuleList([_Shifted() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x, self.shift)
        return x


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_parameter_handed_to_a_block_and_changed_before_its_re_run_raises(policy, nvme_dir):
    """Before, only the parameters of the block's modules were checked: this one's change
    gave gradients off by up to 6.9 from plain training's, silently."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    model = _ShiftedStack()
    ctx = offload.activations(model=model, **_settings(policy, nvme_dir))
    for step in range(4):
        with ctx:
            model(x).pow(2).sum().backward()
    _rerun_next(ctx, policy)
    with pytest.raises(RuntimeError, match=r"offload: it is a parameter handed to the block "
                                           r"\(\[8\]\), read by a block re-run"):
        with ctx:
            loss = model(x).pow(2).sum()
            with torch.no_grad():
                model.shift.add_(1.0)
            loss.backward()
    ctx.close()


class _SharedRenormed(nn.Module):
    """Every block holds the one `max_norm` embedding; only some look it up, and the model
    looks it up once more after the blocks: its version moves between a block's forward
    and its re-run, by calls that are not that block's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 16, max_norm=1.0)
        self.blocks = nn.ModuleList([_Renormed(self.emb) for _ in range(4)])

    def forward(self, x, ids):
        for i, block in enumerate(self.blocks):
            x = block(x, ids[i]) if i % 2 == 0 else block(x)
        return (x * self.emb(ids[-1])).sum()


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_an_embedding_renormalised_by_other_calls_does_not_raise(policy, nvme_dir):
    """Before, the blocks that hold the embedding without looking it up raised autograd's
    in-place error: the user changed no weight."""
    x = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(1))
    ids = torch.randperm(50, generator=torch.Generator().manual_seed(2))[:15].view(5, 1, 3) \
        .expand(5, 4, 3)

    def train(ctx):
        model = _SharedRenormed()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(5):
            opt.zero_grad(set_to_none=True)
            with ctx(model) if ctx is not None else contextlib.nullcontext():
                model(x, ids).backward()
            opt.step()
        return [p.detach() for p in model.parameters()]

    made = []

    def ours(model):
        if not made:
            made.append(offload.activations(model=model, **_settings(policy, nvme_dir)))
        return made[0]

    assert all(map(torch.equal, train(None), train(ours)))
    made[0].close()


class _Codebook(nn.Module):
    """A vector quantiser's codebook held as a parameter that needs no grad and moved
    towards the inputs in forward (an EMA update)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.codebook = nn.Parameter(torch.randn(4, 8), requires_grad=False)

    def forward(self, x):
        h = self.lin(x)
        with torch.no_grad():
            self.codebook.mul_(0.9).add_(h.mean(0), alpha=0.1)
        return x + torch.tanh(h @ self.codebook.t() @ self.codebook)


def test_a_weight_its_block_updates_in_forward_is_said_once(nvme_dir, caplog):
    """Its re-run reads it as changed and changes it again (as under torch's checkpoint): a
    value a forward updates belongs in a buffer, which a re-run sets back. Said once."""
    offload.process.reset()
    torch.manual_seed(0)
    model = nn.Sequential(*[_Codebook() for _ in range(3)])
    x = torch.randn(4, 8)
    with caplog.at_level(logging.WARNING, logger="offload"):
        for step in range(3):
            with offload.activations(model=model, **_settings("recompute", nvme_dir)):
                model(x).sum().backward()
    said = [r.message for r in caplog.records if "changed in place by the forward" in r.message]
    assert len(said) == 1 and said[0].startswith(
        "offload: `codebook` of the block (a _Codebook) is changed in place by the forward of "
        "the block that holds it"), said
    assert "register_buffer" in said[0]


class _Residual(nn.Module):
    def __init__(self, d: int = 16, tied: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)
        if tied:   # one weight held by two of its modules (listed twice: not flipped twice)
            self.b.weight = self.a.weight

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("tied", [False, True], ids=["", "tied"])
@pytest.mark.parametrize("at_forward", [False, True], ids=["frozen at the call",
                                                           "trained at the call"])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_requires_grad_flipped_between_forward_and_backward_trains_as_plain(
        policy, at_forward, tied, nvme_dir):
    """weights.py NOTE [Weights in a re-run]: a block whose weights' requires_grad changed
    between its forward and its re-run (a GAN step: freeze D for G's loss, unfreeze it
    before the backward) was re-run with the new flags, another graph than the forward's.
    Unfrozen since: silently wrong gradients (the re-run's extra saves went to the wrong
    nodes); frozen since: CheckpointError at every step. Both as plain training now,
    bit-exact, also in the steps after."""
    def train(use_offload: bool) -> list:
        torch.manual_seed(0)
        model = nn.Sequential(*[_Residual(tied=tied) for _ in range(4)])
        ctx = offload.activations(model=model, **_settings(policy, nvme_dir)) \
            if use_offload else contextlib.nullcontext()
        grads = []
        for step in range(5):
            x = torch.randn(16, 16, generator=torch.Generator().manual_seed(step))
            model.zero_grad(set_to_none=True)
            model.requires_grad_(True)
            model[1].requires_grad_(at_forward)
            with ctx:
                y = model(x)
                model[1].requires_grad_(not at_forward)
                y.pow(2).sum().backward()
            grads.append([p.grad for p in model.parameters()])
        return grads

    for step, (plain, ours) in enumerate(zip(train(False), train(True))):
        for a, b in zip(plain, ours):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), step
