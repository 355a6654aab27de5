"""Block calls that `recompute` and `auto` run as is, not checkpointed (recompute.py NOTE
[Calls that run as is]): those whose inputs and weights need no gradient, and those given
a nested tensor of the strided layout. Bit-exact against plain training."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from schedule_models import SLOW

import offload


@pytest.fixture(autouse=True)
def _one_thread(tmp_path, monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    offload.process.reset()   # the "runs as is" message is said once per block type
    yield
    torch.set_num_threads(threads)


def _frozen_encoder_run(policy, mask: bool):
    """A frozen nn.TransformerEncoder in eval() (a feature extractor) feeding a trained
    head; plain PyTorch takes the encoder's fast path (nothing requires grad)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.1, batch_first=True)
    enc, head = nn.TransformerEncoder(layer, 3), nn.Linear(16, 1)
    model = nn.ModuleDict({"enc": enc, "head": head})
    enc.requires_grad_(False)
    enc.eval()
    x = torch.randn(4, 7, 16, generator=torch.Generator().manual_seed(1))
    padding = torch.arange(7)[None] >= torch.tensor([7, 5, 3, 6])[:, None] if mask else None
    ctx = None if policy is None else offload.activations(model=model, policy=policy,
                                                           tiers="host", min_bytes=0)
    out = []
    for step in range(4):   # auto: warm-up, profile, planned steps
        head.zero_grad(set_to_none=True)
        with ctx if ctx is not None else torch.enable_grad():
            h = enc(x, src_key_padding_mask=padding)
            loss = head(h).pow(2).mean()
            loss.backward()
        out.append((loss.detach(), h.detach().nan_to_num(), head.weight.grad.clone()))
    return out


@pytest.mark.parametrize("mask", [False, True], ids=["no mask", "padding mask"])
@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_frozen_encoder_runs_as_in_plain_training(policy, mask):
    """Before: checkpointed under our modes, it left torch's fast path: `recompute`'s
    encoder output and head gradient differed (by 7e-7); with a padding mask (the
    nested-tensor path) `recompute` raised MultiheadAttention's "does not support
    NestedTensor outside of its fast path" and `auto` "NestedTensorImpl doesn't support
    sizes"."""
    plain, ours = _frozen_encoder_run(None, mask), _frozen_encoder_run(policy, mask)
    for step, (a, b) in enumerate(zip(plain, ours)):
        assert all(map(torch.equal, a, b)), f"step {step}"


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.l2(F.gelu(self.l1(x)))


def _nested_run(policy):
    torch.manual_seed(0)
    model = nn.ModuleDict(dict(inp=nn.Linear(8, 16), out=nn.Linear(16, 1),
                               blocks=nn.ModuleList([_Block() for _ in range(3)])))
    xs = [torch.randn(n, 8, generator=torch.Generator().manual_seed(n)) for n in (3, 5, 4)]
    ctx = None if policy is None else offload.activations(model=model, policy=policy,
                                                           tiers="host", min_bytes=0)
    out = []
    for step in range(4):
        model.zero_grad(set_to_none=True)
        with ctx if ctx is not None else torch.enable_grad():
            h = torch.nested.as_nested_tensor([model.inp(x) for x in xs])   # strided
            for block in model.blocks:
                h = block(h)
            loss = sum(model.out(t).pow(2).mean() for t in h.unbind())
            loss.backward()
        out.append([loss.detach(), *(p.grad for p in model.parameters())])
    return out


@pytest.mark.parametrize("policy", ["recompute", "auto"])
def test_a_block_given_a_strided_nested_tensor_runs_as_is(policy, caplog):
    """Before: torch's checkpoint read the nested tensor's `.shape` and raised (`recompute`),
    and so did `auto`'s shape signature."""
    with caplog.at_level(logging.INFO, logger="offload"):
        plain, ours = _nested_run(None), _nested_run(policy)
    for step, (a, b) in enumerate(zip(plain, ours)):
        assert all(map(torch.equal, a, b)), f"step {step}"
    said = [r.message for r in caplog.records if "strided layout" in r.message]
    assert len(said) == 1 and "a _Block got a nested tensor" in said[0], said


def test_a_block_whose_weights_train_is_checkpointed_though_its_input_needs_no_grad():
    """A LoRA-style block after a frozen embedding: its input needs no gradient, its
    weights do, so it is checkpointed still (its saves are recomputed, not kept)."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*[_Block() for _ in range(2)])
    x = torch.randn(4, 16)
    with offload.activations(model=blocks, policy="recompute", tiers="host", min_bytes=0) as ctx:
        blocks(x).sum().backward()
    # a checkpointed block's saves are its recomputed ones: only the input reached our hooks
    assert ctx.stats.packed_tensors == 2, ctx.stats


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x, scale):
        return x + self.l2(F.gelu(self.l1(x * scale)))


def test_a_frozen_block_handed_a_trained_parameter_is_checkpointed():
    """Its weights and input need no gradient, the parameter handed to it does: it builds
    a graph, so it is checkpointed (before, it ran as is and kept what it saved)."""
    torch.manual_seed(0)
    blocks = nn.ModuleList([_Scaled() for _ in range(2)]).requires_grad_(False)
    scale = nn.Parameter(torch.ones(16))
    x = torch.randn(4, 16)
    with offload.activations(model=blocks, policy="recompute", tiers="host", min_bytes=0) as ctx:
        h = x
        for block in blocks:
            h = block(h, scale)
        h.sum().backward()
    assert ctx.stats.packed_tensors == 2, ctx.stats   # the two blocks' inputs, recomputed
    assert scale.grad is not None




def test_blocks_unfrozen_after_auto_s_profile_profile_again(caplog):
    """Progressive unfreezing: the profiled step ran the frozen blocks as is, so they were
    not profiled. Before, once trained they ran on another block's decisions, whose "keep"
    with no tier that frees memory (host on a CPU) kept 2.6x the plan's prediction. Now the
    class profiles again, and its planned steps keep what the new plan predicts; training
    is bit-exact."""
    from offload.schedule import search as search_mod

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inp, self.head = nn.Linear(8, 16), nn.Linear(16, 1)
            self.blocks = nn.ModuleList([_Block() for _ in range(4)])

        def forward(self, x):
            h = self.inp(x)
            for block in self.blocks:
                h = block(h)
            return self.head(h).pow(2).mean()

    def frozen_until(model, step):   # blocks 0-2 frozen for 4 steps, block 0 for 8
        model.inp.requires_grad_(False)
        for i, block in enumerate(model.blocks):
            block.requires_grad_(i >= (3 if step < 4 else 1 if step < 8 else 0))

    plain, model = Stack(), Stack()
    ctx = offload.activations(model=model, policy="auto", tiers="host", min_bytes=0,
                              budget="30%", probe=SLOW)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, model)]
    kept = []
    old_margin, search_mod.TRIAL_MARGIN = search_mod.TRIAL_MARGIN, -1.0   # the plan's steps
    try:
        with caplog.at_level(logging.INFO, logger="offload"):
            for step in range(12):
                x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
                for m, opt in zip((plain, model), optims):
                    frozen_until(m, step)
                    opt.zero_grad(set_to_none=True)
                    with ctx if m is model else torch.enable_grad():
                        m(x).backward()
                    opt.step()
                assert all(map(torch.equal, plain.parameters(), model.parameters())), step
                if step not in (0, 1, 4, 5, 8, 9):   # not a warm-up or profile step
                    kept.append((step, ctx.stats.peak_resident_bytes,
                                 ctx.plan.prediction.kept_bytes))
    finally:
        search_mod.TRIAL_MARGIN = old_margin
    assert kept and all(peak <= predicted for _, peak, predicted in kept), kept
    said = [r.message for r in caplog.records if "needs one now; it and" in r.message]
    assert len(said) == 2, said   # once per unfreezing
    ctx.close()


def test_a_frozen_block_called_as_is_and_with_a_gradient_keeps_its_plan(caplog):
    """A frozen discriminator on real data (runs as is) and on generated data (needs a
    gradient: profiled) in one step. Before, the profile listed it among the blocks it ran
    as is, so every planned step profiled again: `ctx.plan` was None every other step."""
    class Gan(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.gen = nn.Linear(8, 16)
            self.blocks = nn.ModuleList([_Block() for _ in range(3)]).requires_grad_(False)

        def disc(self, h):
            for block in self.blocks:
                h = block(h)
            return h.pow(2).mean()

        def forward(self, real, z):
            return self.disc(real) - self.disc(self.gen(z))

    plain, model = Gan(), Gan()
    ctx = offload.activations(model=model, policy="auto", tiers="host", min_bytes=0)
    plans = []
    with caplog.at_level(logging.INFO, logger="offload"):
        for step in range(8):
            real = torch.randn(16, 16, generator=torch.Generator().manual_seed(step))
            z = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 + step))
            for m in (plain, model):
                m.zero_grad(set_to_none=True)
                with ctx if m is model else torch.enable_grad():
                    m(real, z).backward()
            assert torch.equal(plain.gen.weight.grad, model.gen.weight.grad), step
            plans.append(ctx.plan is not None)
    assert plans[1:] == [True] * 7, plans
    assert not [r for r in caplog.records if "profiles again" in r.message]
    ctx.close()
