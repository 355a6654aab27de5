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

import pytest
import torch
import torch.nn as nn

import offload

SLOW = "compute_gflops=100,dispatch_op_s=1e-6,nvme_write_gbps=1e-4,nvme_read_gbps=1e-4,nvme_issue_s=1e-6"


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
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation(.|\n)*"
                                           r"offload: it is `0\.(weight|bias)` of the Sequential"):
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

    def forward(self, x, ids):
        return x + torch.tanh(self.lin(x * self.emb(ids)))


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
    reads the rows as the forward left them: before, it renormalised them once more, which
    is not the identity in float32 (gradients off by 4e-9 and the weight itself by 1.2e-7
    after one step, as under torch's checkpoint). The gradients of both backwards and the
    weights after AdamW steps equal plain training's, bit for bit (the shared embedding's
    blocks read disjoint rows: see weights.py)."""
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
