"""A saved tensor's Python attributes come back with it (tensor_meta NOTE [Saved attributes]).

Plain autograd hands a saved input back as the very object it saved, so a backward that
reads `s.scale` sees the attribute as it is then. Every tier must do the same, whether it
hands back that object (host on CPU) or a new tensor (nvme, a spill, host on a GPU): the
core's handles and the Python ones, each compared bit for bit with plain autograd. And no
save may make an attribute dict for a tensor that has none.
"""
from __future__ import annotations

import contextlib
import gc

import pytest
import torch

import offload
from offload._ext import core_available

pytestmark = pytest.mark.skipif(not core_available(), reason="the nvme tier needs the core")

TIERS = ["host", "nvme", "host,nvme"]


@pytest.fixture(autouse=True)
def _one_thread():
    """One thread: with two, plain autograd itself gave another gradient in about one run of
    fifteen (8 chained tanh over 128x128, fresh processes), which bit-exact checks cannot
    tell from a wrong one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class ScaledMul(torch.autograd.Function):
    """x * s * s.scale; backward reads `s.scale` (a quantisation scale kept on the tensor)."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(s)
        return x * s * s.scale

    @staticmethod
    def backward(ctx, g):
        s, = ctx.saved_tensors
        return g * s * s.scale, None


class ScaledMulOrOne(torch.autograd.Function):
    """The same with the scale read as `getattr(s, "scale", 1.0)`: without its attribute, a
    wrong gradient and no error."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(s)
        return x * s * s.scale

    @staticmethod
    def backward(ctx, g):
        s, = ctx.saved_tensors
        return g * s * getattr(s, "scale", 1.0), None


class TwoTags(torch.autograd.Function):
    """Saves two tensors of one storage, each with its own `tag`; backward scales by both."""

    @staticmethod
    def forward(ctx, x, a, b):
        ctx.save_for_backward(a, b)
        return x * a

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * a * a.tag + b * b.tag, None, None


def _options(tiers: str, nvme_dir: str) -> dict:
    kw = {"tiers": tiers, "min_bytes": 0, "nvme_dir": nvme_dir}
    if tiers == "host,nvme":
        kw["host_bytes"] = "64KiB"   # the first saves fill it; the rest spill to nvme
    return kw


def _scaled_step(fn, tiers: str | None, nvme_dir: str, scale_after_forward=None):
    """x's gradient through `fn` of 8 saved 64 KiB tensors, each with `scale`; with
    `scale_after_forward`, each is rescaled between the forward and the backward."""
    torch.manual_seed(0)
    x = torch.randn(128, 128, requires_grad=True)
    saved = [torch.rand(128, 128) for _ in range(8)]
    for i, s in enumerate(saved):
        s.scale = 1.5 + i
    ctx = offload.activations(**_options(tiers, nvme_dir)) if tiers else contextlib.nullcontext()
    with ctx:
        y = x
        for s in saved:
            y = fn.apply(y, s).tanh()
        if scale_after_forward is not None:
            for s in saved:
                s.scale = scale_after_forward
        y.sum().backward()
    return x.grad, ctx


@pytest.mark.parametrize("tiers", TIERS)
def test_backward_reads_a_saved_tensors_attribute_on_every_tier(tiers, path, nvme_dir):
    plain, _ = _scaled_step(ScaledMul, None, nvme_dir)
    got, ctx = _scaled_step(ScaledMul, tiers, nvme_dir)
    assert torch.equal(got, plain)
    if "nvme" in tiers:   # new tensors came back: the attributes travelled with them
        assert ctx.stats.nvme_bytes > 0


@pytest.mark.parametrize("tiers", TIERS)
def test_an_attribute_changed_after_the_forward_is_seen_changed(tiers, path, nvme_dir):
    plain, _ = _scaled_step(ScaledMul, None, nvme_dir, scale_after_forward=0.25)
    got, _ = _scaled_step(ScaledMul, tiers, nvme_dir, scale_after_forward=0.25)
    unchanged, _ = _scaled_step(ScaledMul, None, nvme_dir)
    assert torch.equal(got, plain) and not torch.equal(got, unchanged)


@pytest.mark.parametrize("tiers", TIERS)
def test_getattr_with_a_default_computes_the_plain_gradient(tiers, path, nvme_dir):
    plain, _ = _scaled_step(ScaledMulOrOne, None, nvme_dir)
    got, _ = _scaled_step(ScaledMulOrOne, tiers, nvme_dir)
    assert torch.equal(got, plain)


def _two_tags_step(tiers: str | None, nvme_dir: str):
    torch.manual_seed(0)
    x = torch.randn(4096, requires_grad=True)
    a = torch.rand(4096)
    b = a.detach()   # the same storage and version: one record, two saves
    a.tag, b.tag = 2.0, 3.0
    ctx = offload.activations(**_options(tiers, nvme_dir)) if tiers else contextlib.nullcontext()
    with ctx:
        TwoTags.apply(x, a, b).sum().backward()
    return x.grad


@pytest.mark.parametrize("tiers", ["nvme", "host"])
def test_two_saves_of_one_storage_keep_their_own_attributes(tiers, path, nvme_dir):
    # On nvme both saves may be handed the one tensor their bytes came back as; each must
    # still carry its own object's attributes.
    assert torch.equal(_two_tags_step(tiers, nvme_dir), _two_tags_step(None, nvme_dir))


def _has_attribute_dict(t: torch.Tensor) -> bool:
    """Whether `t`'s Python object has made its attribute dict (reading `__dict__` would
    make it). The collector sees it among the object's referents while no C++ reference
    besides the object holds the tensor (torch's traversal skips it otherwise)."""
    return any(type(r) is dict for r in gc.get_referents(t))


@pytest.mark.parametrize("tiers", TIERS)
def test_no_save_makes_an_attribute_dict(tiers, path, nvme_dir):
    torch.manual_seed(0)
    x = torch.randn(128, 128, requires_grad=True)
    bare = [torch.rand(128, 128) for _ in range(4)]
    tagged = torch.rand(128, 128)
    tagged.scale = 2.0
    made = []   # tensors ops made, each saved by the next op
    with offload.activations(**_options(tiers, nvme_dir)) as ctx:
        y = x.sin()
        for s in bare:
            h = y * s   # saves s
            made.append(h)
            y = h.sin()   # saves h
        ScaledMul.apply(y, tagged).sum().backward()
    assert ctx.stats.packed_tensors == 10
    assert _has_attribute_dict(tagged)   # the check sees a dict where there is one
    assert not any(_has_attribute_dict(t) for t in bare + made)


@pytest.mark.cuda
def test_the_host_tier_on_a_gpu_carries_attributes():
    # On a GPU the host tier hands back a copy from pinned memory: a new tensor.
    torch.manual_seed(0)
    x = torch.randn(128, 128, device="cuda", requires_grad=True)
    s = torch.rand(128, 128, device="cuda")
    s.scale = 3.0
    plain = torch.autograd.grad(ScaledMul.apply(x, s).sum(), x)[0]
    with offload.activations(tiers="host", min_bytes=0) as ctx:
        got = torch.autograd.grad(ScaledMul.apply(x, s).sum(), x)[0]
    assert ctx.stats.host_bytes > 0
    assert torch.equal(got, plain)
