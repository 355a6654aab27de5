"""Saved tensor subclasses (subclasses NOTE [Subclasses]): traceable wrapper subclasses move
through their inner tensors and come back bit-exact; an in-place change of the outer tensor
still raises autograd's error; what cannot move is counted by type, with one warning.
"""
from __future__ import annotations

import contextlib
import logging
import tempfile

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import offload
from offload.runtime import subclasses

TIERS = ["host", "nvme", "host,nvme"]


def _kw(tiers, nvme_dir):
    kw = {"tiers": tiers, "min_bytes": 0}
    if "nvme" in tiers:
        kw["nvme_dir"] = nvme_dir
    if tiers == "host,nvme":
        kw["host_bytes"] = "1KiB"
    return kw


def _two_tensor_grads(ctx):
    torch.manual_seed(0)
    w = TwoTensor(torch.randn(16, 16), torch.randn(16, 16)).requires_grad_()
    x = TwoTensor(torch.randn(4, 16), torch.randn(4, 16))
    with ctx:
        y = (x @ w).sin()
        (y * y.cos()).exp().sum().backward()
    return w.grad


@pytest.mark.parametrize("tiers", TIERS)
def test_a_wrapper_subclass_moves_through_its_inner_tensors(tiers, nvme_dir):
    ref = _two_tensor_grads(contextlib.nullcontext())
    ctx = offload.activations(**_kw(tiers, nvme_dir))
    got = _two_tensor_grads(ctx)
    assert torch.equal(ref.a, got.a) and torch.equal(ref.b, got.b)
    assert ctx.stats.offloaded_tensors >= 6      # two inner tensors of each saved TwoTensor
    assert ctx.stats.unmoved_bytes_by_type == {}
    assert ctx.stats.host_bytes + ctx.stats.nvme_bytes > 0


def _jagged_grads(ctx, lengths):
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 32)
    parts = [torch.randn(n, 32) for n in lengths]
    with ctx:
        nt = torch.nested.nested_tensor(parts, layout=torch.jagged)
        sum(t.pow(2).sum() for t in lin(nt).relu().unbind()).backward()
    return [p.grad for p in lin.parameters()]


@pytest.mark.parametrize("tiers", TIERS)
def test_a_jagged_nested_tensor_keeps_its_ragged_size(tiers, nvme_dir):
    """Before: its offsets were moved like its values and came back as another tensor, so
    the rebuilt tensor had another ragged size (j5 for j4) and the backward raised a shape
    mismatch; its empty sequence-length caches were warned about as unmovable. Its values
    move, its offsets stay the very tensor, and nothing is counted as unmoved."""
    for lengths in ([30, 20], [7, 40, 1]):
        ref = _jagged_grads(contextlib.nullcontext(), lengths)
        ctx = offload.activations(**_kw(tiers, nvme_dir))
        got = _jagged_grads(ctx, lengths)
        assert all(torch.equal(a, b) for a, b in zip(ref, got)), lengths
        assert ctx.stats.host_bytes + ctx.stats.nvme_bytes > 0
        assert ctx.stats.unmoved_bytes_by_type == {}


@pytest.mark.parametrize("tiers", TIERS)
def test_a_subclass_changed_in_place_and_dropped_raises_autograds_error(tiers, nvme_dir):
    w = TwoTensor(torch.randn(8, 8), torch.randn(8, 8)).requires_grad_()

    def forward():
        y = (w * 2).tanh()          # saves its result, a TwoTensor
        y.mul_(3)                   # changes it through the outer tensor
        return y.sum()
    with pytest.raises(RuntimeError) as plain:
        forward().backward()
    with pytest.raises(RuntimeError) as ours:
        with offload.activations(**_kw(tiers, nvme_dir)):
            forward().backward()
    assert str(ours.value) == str(plain.value)


def test_what_cannot_move_is_counted_by_type_with_one_warning(caplog, monkeypatch):
    monkeypatch.setattr(subclasses, "_warned", set())
    a = torch.randn(16, 16).to_sparse()              # 256 values, 2 x 256 int64 indices
    b = torch.randn(16, 4, requires_grad=True)
    caplog.set_level(logging.WARNING, logger="offload")
    for _ in range(2):
        with offload.activations(tiers="host", min_bytes=0) as ctx:
            (torch.sparse.mm(a, b) * 2).sin().sum().backward()
    assert ctx.stats.unmoved_tensors_by_type == {"Tensor(sparse_coo)": 1}
    assert ctx.stats.unmoved_bytes_by_type == {"Tensor(sparse_coo)": 256 * 4 + 2 * 256 * 8}
    assert ctx.stats.saved_bytes >= 256 * 4 + 2 * 256 * 8     # counted, as kept
    warnings = [r.getMessage() for r in caplog.records if "stayed where they are" in r.getMessage()]
    assert len(warnings) == 1 and "Tensor(sparse_coo)" in warnings[0] and "5 KiB" in warnings[0]


def test_an_empty_view_is_named_for_what_keeps_it(caplog, monkeypatch):
    """Was counted as `Tensor(cpu)`, with a warning saying the runtime moves plain strided
    CPU tensors: an empty view has no elements to move, and still holds its storage."""
    monkeypatch.setattr(subclasses, "_warned", set())
    w = torch.randn(30, 30, requires_grad=True)
    caplog.set_level(logging.WARNING, logger="offload")
    with offload.activations(tiers="host", min_bytes=0) as ctx:
        z = (w * 1.5)[:0]
        (z * z).sum().backward()
    assert set(ctx.stats.unmoved_tensors_by_type) == {"Tensor(cpu, no elements)"}
    warnings = [r.getMessage() for r in caplog.records if "stayed where they are" in r.getMessage()]
    assert len(warnings) == 1 and "with elements" in warnings[0]


def _jvp_then_backward(ctx):
    """A JVP of an MLP in its input while its weights require grad, and a loss that uses
    the JVP too: forward-mode AD saves zero tensors for the weights' missing tangents."""
    import torch.autograd.forward_ad as fwad
    torch.manual_seed(0)
    w1 = torch.randn(64, 32, requires_grad=True)
    w2 = torch.randn(32, 64, requires_grad=True)
    x, v = torch.randn(8, 32), torch.randn(8, 32)
    with ctx, fwad.dual_level():
        y = (fwad.make_dual(x, v) @ w1.t()).tanh() @ w2.t()
        (y.sum() + fwad.unpack_dual(y).tangent.pow(2).sum()).backward()
    return w1.grad, w2.grad


@pytest.mark.parametrize("tiers", TIERS)
def test_a_zero_tensor_stays_and_holds_no_bytes(tiers, nvme_dir, caplog, monkeypatch):
    """Before: the nvme tier read the data of forward-mode AD's zero tensor, which has none
    ("Attempted to access the data pointer on an invalid python storage"), and the host
    tier counted its nominal size as moved. It stays, counted with no bytes, unwarned."""
    monkeypatch.setattr(subclasses, "_warned", set())
    caplog.set_level(logging.WARNING, logger="offload")
    plain = _jvp_then_backward(contextlib.nullcontext())
    ctx = offload.activations(**_kw(tiers, nvme_dir))
    got = _jvp_then_backward(ctx)
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    assert ctx.stats.unmoved_tensors_by_type.get("Tensor(cpu, zeros)", 0) >= 1
    assert ctx.stats.unmoved_bytes_by_type["Tensor(cpu, zeros)"] == 0
    assert not [r for r in caplog.records if "stayed where they are" in r.getMessage()]


@pytest.mark.parametrize("tiers", TIERS)
def test_tensors_with_no_elements_stay_unwarned(tiers, nvme_dir, caplog, monkeypatch):
    """Before: "2 saved tensor(s) of type Tensor(cpu, no elements) (0 B) stayed where they
    are" for an empty batch through a matmul: they hold nothing, so nothing could move.
    They are still counted (an empty view of a storage with bytes still warns: above)."""
    monkeypatch.setattr(subclasses, "_warned", set())
    caplog.set_level(logging.WARNING, logger="offload")
    x = torch.empty(0, 4, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    with offload.activations(**_kw(tiers, nvme_dir)) as ctx:
        # Saved with no elements: the matmul's input and the tanh's output.
        ((x * 2) @ w.exp()).tanh().sum().backward()
    assert torch.equal(w.grad, torch.zeros(4, 3)) and x.grad.shape == (0, 4)
    assert ctx.stats.unmoved_tensors_by_type == {"Tensor(cpu, no elements)": 2}
    assert ctx.stats.unmoved_bytes_by_type == {"Tensor(cpu, no elements)": 0}
    assert not [r for r in caplog.records if "stayed where they are" in r.getMessage()]


def test_meta_tensors_count_no_bytes():
    """A meta tensor has no memory: it was counted as its nominal 39 KiB."""
    x = torch.randn(100, 100, requires_grad=True, device="meta")
    with offload.activations(tiers="host", min_bytes=0) as ctx:
        (x * 2).sin().sum().backward()
    assert ctx.stats.unmoved_tensors_by_type == {"Tensor(meta)": 1}
    assert ctx.stats.unmoved_bytes_by_type == {"Tensor(meta)": 0}
    assert ctx.stats.saved_bytes == 0


def _dtensor_step(mesh_dir: str, ctx_kwargs):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{mesh_dir}/rendezvous", rank=0,
                            world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(0)
        w = distribute_tensor(torch.randn(16, 16), mesh, [Shard(0)]).requires_grad_()
        x = distribute_tensor(torch.randn(8, 16), mesh, [Shard(0)])
        ctx = offload.activations(**ctx_kwargs) if ctx_kwargs else contextlib.nullcontext()
        with ctx:
            y = (x @ w).relu()
            (y.sigmoid() * y).sum().backward()
        return w.grad.to_local(), ctx
    finally:
        dist.destroy_process_group()


def test_a_dtensor_activation_moves_and_comes_back_exactly(nvme_dir):
    with tempfile.TemporaryDirectory() as d:
        ref, _ = _dtensor_step(d, None)
    with tempfile.TemporaryDirectory() as d:
        got, ctx = _dtensor_step(d, _kw("nvme", nvme_dir))
    assert torch.equal(ref, got)
    assert ctx.stats.nvme_bytes > 0 and ctx.stats.unmoved_bytes_by_type == {}


class _SparseGraphBlock(torch.nn.Module):
    """A graph convolution: a sparse adjacency handed to the block, or held as a buffer."""

    def __init__(self, adjacency: torch.Tensor | None = None) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(20, 20) / 4)
        if adjacency is not None:
            self.register_buffer("adj", adjacency)

    def forward(self, x, adj=None):
        return x + torch.tanh(torch.sparse.mm(self.adj if adj is None else adj, x @ self.w))


class _SparseGraph(torch.nn.Module):
    def __init__(self, buffer: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        adjacency = _adjacency(99) if buffer else None
        self.blocks = torch.nn.ModuleList([_SparseGraphBlock(adjacency) for _ in range(3)])

    def forward(self, x, adj=None):
        for block in self.blocks:
            x = block(x, adj)
        return x.pow(2).sum()


def _adjacency(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dense = (torch.rand(30, 30, generator=g) < 0.2).float() * torch.randn(30, 30, generator=g)
    return dense.to_sparse()


@pytest.mark.parametrize("policy", ["keep", "offload", "recompute", "auto"])
@pytest.mark.parametrize("where", ["buffer", "block input"])
def test_a_sparse_tensor_in_the_model_stays_and_the_step_is_exact(policy, where, nvme_dir,
                                                                   tmp_path, monkeypatch):
    """A sparse tensor has no storage torch will give (`untyped_storage()` raises "Cannot
    access storage of SparseTensorImpl"). A sparse buffer made every policy's context
    raise at entry with `model=`, keep's too; handed to a block, or taken by an op inside
    one, it made every step under auto raise (a helper's finds). It stays where it is, as
    the README says of what cannot move, and the gradients are plain autograd's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = _SparseGraph(buffer=where == "buffer")

    def batch(i):
        x = torch.randn(30, 20, generator=torch.Generator().manual_seed(i))
        return (x,) if where == "buffer" else (x, _adjacency(i))

    want = []
    for i in range(4):
        model.zero_grad(set_to_none=True)
        model(*batch(i)).backward()
        want.append([p.grad.clone() for p in model.parameters()])
    ctx = offload.activations(model=model, policy=policy, tiers="nvme", nvme_dir=nvme_dir,
                              min_bytes=0)
    for i in range(4):   # auto: warm-up, profile, planned steps
        model.zero_grad(set_to_none=True)
        with ctx:
            model(*batch(i)).backward()
        assert all(torch.equal(a, p.grad) for a, p in zip(want[i], model.parameters())), i
    ctx.close()
