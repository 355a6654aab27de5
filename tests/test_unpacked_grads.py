"""Saved tensors a backward returns as gradients, as custom autograd Functions do.

Every save of one moved storage is unpacked from one loaded copy (runtime/records.py NOTE
[Unpack cache]). Autograd's AccumulateGrad takes a gradient nobody else refers to as the
parameter's `.grad` itself, without copying it: two saves handed out as two tensors over
that copy became two parameters' `.grad`s sharing memory, and the next micro-batch's
accumulation into one changed the other (5 where plain autograd gives 3). A copy kept from
an earlier unpack, reused by a later one (a retained graph's next backward, a second read
of `ctx.saved_tensors`), could be such a `.grad` by then. Each case runs plainly and under
offload, from the same values, and every gradient and kept tensor must be equal
(`torch.equal`; the math is the same), on the core's path and on the Python one.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import offload


class SavedTwice(torch.autograd.Function):
    """One tensor saved twice, both returned as gradients."""

    @staticmethod
    def forward(ctx, p1, p2, s):
        ctx.save_for_backward(s, s)
        return ((p1 + p2) * s).sum()

    @staticmethod
    def backward(ctx, go):
        s1, s2 = ctx.saved_tensors
        return s1, s2, None


class SavedOnce(torch.autograd.Function):
    """One tensor saved, returned as the gradient (two of these share one tensor)."""

    @staticmethod
    def forward(ctx, p, s):
        ctx.save_for_backward(s)
        return (p * s).sum()

    @staticmethod
    def backward(ctx, go):
        (s,) = ctx.saved_tensors
        return s, None


KEPT: list[torch.Tensor] = []


class ReadTwice(SavedOnce):
    """SavedOnce whose backward reads `ctx.saved_tensors` twice; the second read kept past
    the step."""

    @staticmethod
    def backward(ctx, go):
        (g,) = ctx.saved_tensors
        (again,) = ctx.saved_tensors
        KEPT.append(again)
        return g, None


class TwoLayouts(torch.autograd.Function):
    """A tensor and its transpose saved (one storage, two layouts), both returned."""

    @staticmethod
    def forward(ctx, p1, p2, s):
        ctx.save_for_backward(s, s.t())
        return ((p1 + p2) * s).sum()

    @staticmethod
    def backward(ctx, go):
        a, b = ctx.saved_tensors
        return a, b.t(), None


class OutputSavedTwice(torch.autograd.Function):
    """Its own output saved twice and returned: plain autograd itself hands the two
    gradients one memory here (autograd makes each unpacked output a new tensor); the
    same values as plain's are what is asked."""

    @staticmethod
    def forward(ctx, p1, p2, s):
        y = s * 2 + 0 * (p1 + p2)
        ctx.save_for_backward(y, y)
        return y

    @staticmethod
    def backward(ctx, go):
        a, b = ctx.saved_tensors
        return a, b, None


def _micro_batches(case: str, p1, p2, i: int) -> None:
    s = torch.full((16, 16), float(i + 1)) * 1   # an activation
    if case == "saved twice":
        SavedTwice.apply(p1, p2, s).backward()
    elif case == "two functions":
        (SavedOnce.apply(p1, s) + SavedOnce.apply(p2, s)).backward()
    elif case == "read twice":
        ReadTwice.apply(p1, s).backward()
    elif case == "two layouts":
        TwoLayouts.apply(p1, p2, s).backward()
    elif case == "storage grown":   # the saves come back over the storage as it is now
        loss = SavedOnce.apply(p1, s) + SavedOnce.apply(p2, s)
        s.untyped_storage().resize_(2 * s.untyped_storage().nbytes())
        loss.backward()
        KEPT.append(s)   # the user's tensor, kept: no `.grad` may be its memory
    else:
        OutputSavedTwice.apply(p1, p2, s).sum().backward()


def _run(case: str, context) -> list[torch.Tensor]:
    p1, p2 = nn.Parameter(torch.zeros(16, 16)), nn.Parameter(torch.zeros(16, 16))
    seen = []
    KEPT.clear()
    if case == "retained graph":
        with context():
            loss = SavedTwice.apply(p1, p2, torch.full((16, 16), 1.0) * 1)
            for i in range(3):
                loss.backward(retain_graph=i < 2)
                seen += [p1.grad.clone(), p2.grad.clone()]
        return seen
    for i in range(3):   # micro-batches: the gradients accumulate
        with context():
            _micro_batches(case, p1, p2, i)
        seen += [g.clone() for g in (p1.grad, p2.grad) if g is not None]
    return seen + [k.clone() for k in KEPT]


@pytest.mark.parametrize("case", ["saved twice", "two functions", "retained graph",
                                  "read twice", "two layouts", "storage grown",
                                  "output saved twice"])
@pytest.mark.parametrize("tiers", ["nvme", "host"])
def test_saved_tensors_returned_as_gradients_are_exact(case, tiers, path, nvme_dir):
    plain = _run(case, contextlib.nullcontext)
    moved = _run(case, lambda: offload.activations(tiers=tiers, nvme_dir=nvme_dir, min_bytes=0))
    assert len(moved) == len(plain)
    for i, (a, b) in enumerate(zip(plain, moved)):
        assert torch.equal(a, b), (i, a[0, 0].item(), b[0, 0].item())
