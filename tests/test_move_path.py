"""The core's move path (hooks.py NOTE [Move path in C]): a plain CPU activation that the
standing decision sends to the nvme tier (or the host tier, which holds it by reference) is
stored by the core's packer and unpacked by its unpacker, with no Python frame of the hooks. These tests check that it is taken, and that
every case it must leave to the Python path (weights, no_offload, a backward's saves,
untracked aliases, a full tier, the round-trip plan, a forced decision) comes out as the
Python path alone decides it: same gradients bit for bit, same figures."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import offload
from offload._ext import core_available
from offload.config import Config
from offload.runtime import hooks as hooks_module, records
from offload.runtime.placement import Decision, Placement, TensorInfo
from offload.runtime.saved_bytes import PySavedBytes

needs_core = pytest.mark.skipif(not core_available(), reason="the core's move path")

# Timing and step-shape figures differ run to run; everything else must match.
# So do the bytes bounced (they follow the tensors' addresses), the staging peak and a
# tier's capacity (the host tier's default follows the memory free).
_VARYING = ("_s", "_gbps", "fraction", "step_s", "peak_prefetch_bytes", "inflight", "bounced",
            "staging_peak", "capacity")


def _figures(stats) -> dict:
    return {k: v for k, v in stats.as_dict().items()
            if not any(part in k for part in _VARYING) and not isinstance(v, float)}


class Net(nn.Module):
    """Saves of every kind the move path must tell apart: activations (inputs and outputs
    of their ops), a weight view (`w.t()` in linear), a buffer (model=), a storage saved
    twice (`h * h`), a part of a detached tensor (an untracked alias), a no_offload region
    and a reentrant checkpoint (its recompute saves during the backward)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(64, 128)
        self.b = nn.Linear(128, 64)
        self.register_buffer("scale", torch.full((128,), 0.5))

    def forward(self, x):
        h = torch.tanh(self.a(x)) * self.scale
        h = h * h
        part = h.detach()[:, :64].requires_grad_()   # an untracked alias of h's storage
        h = h[:, 64:].exp() + part.sin()
        with offload.no_offload():
            h = torch.sigmoid(h)
        h = checkpoint(lambda z: z.cos() * 2, h, use_reentrant=True)
        return self.b(torch.cat([h, h.sin()], dim=1)).sum(), part


def _run(tiers: str, nvme_dir: str, steps: int = 3, **kw):
    model = Net()
    x = torch.randn(32, 64, requires_grad=True)
    figures, grads = [], []
    for _ in range(steps):
        model.zero_grad()
        x.grad = None
        with offload.activations(model=model, tiers=tiers, nvme_dir=nvme_dir, min_bytes=0,
                                 **kw) as ctx:
            loss, part = model(x)
            loss.backward()
        figures.append(_figures(ctx.stats))
        grads.append([x.grad.clone(), part.grad.clone()]
                     + [p.grad.clone() for p in model.parameters()])
    return figures, grads


def _plain_grads():
    model = Net()
    x = torch.randn(32, 64, requires_grad=True)
    loss, part = model(x)
    loss.backward()
    return [x.grad, part.grad] + [p.grad for p in model.parameters()]


def _counting_python_path(monkeypatch) -> list[int]:
    """Counts the saves the core's packer hands to the Python hooks."""
    calls = [0]
    python_path = hooks_module.OffloadHooks._pack_strided

    def counted(*args):
        calls[0] += 1
        return python_path(*args)

    monkeypatch.setattr(hooks_module.OffloadHooks, "_pack_strided", counted)
    return calls


@needs_core
def test_plain_cpu_activations_on_nvme_take_the_move_path(nvme_dir, monkeypatch):
    calls = _counting_python_path(monkeypatch)
    x = torch.randn(256, requires_grad=True)
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0) as ctx:
        tier = ctx._hooks.storer.tiers["nvme"]
        assert type(tier).stores_cpu_in_core and tier.store_cpu is None   # not before a store
        h = x * 1
        for _ in range(200):
            h = h.sin()
        assert tier.store_cpu is not None
        h.sum().backward()
    assert tier.store_cpu is None   # closed: the core's packer may not store through it
    assert ctx.stats.offloaded_tensors == 200 and ctx.stats.nvme_bytes == 200 * 1024
    # The first store goes through the tier's Python `store` (it opens the heap and the
    # tier's `store_cpu`); every later one is the core's.
    assert calls[0] == 1
    assert ctx._hooks.ledger.live_records == 0


@needs_core
def test_plain_cpu_activations_on_the_host_tier_take_the_move_path(monkeypatch):
    calls = _counting_python_path(monkeypatch)
    x = torch.randn(256, requires_grad=True)

    def chain():
        h = x * 1
        for _ in range(200):
            h = h.sin()
        return h

    plain = torch.autograd.grad(chain().sum(), x)[0]
    with offload.activations(tiers="host", min_bytes=0) as ctx:
        tier = ctx._hooks.storer.tiers["host"]
        assert type(tier).stores_cpu_in_core and tier.store_cpu is not None
        h = chain()
        assert tier.used_bytes == 200 * 1024 and len(tier._ledger) == 200
        grad = torch.autograd.grad(h.sum(), x)[0]
    assert tier.store_cpu is None   # closed: the core's packer may not store through it
    assert calls[0] == 0            # every store was the core's, the first one too
    s = ctx.stats.as_dict()
    assert s["offloaded_tensors"] == 200 and s["host_bytes"] == 200 * 1024
    assert s["exit_host_used_bytes"] == 0 and ctx._hooks.ledger.live_records == 0
    assert torch.equal(grad, plain)


@needs_core
@pytest.mark.parametrize("tiers", ["nvme", "nvme,host", "host,nvme", "host"])
def test_the_move_path_decides_what_the_python_path_decides(tiers, nvme_dir, monkeypatch):
    plain = _plain_grads()
    core_figures, core_grads = _run(tiers, nvme_dir)
    monkeypatch.setattr(records, "saved_bytes_meter", PySavedBytes)   # the Python hooks
    python_figures, python_grads = _run(tiers, nvme_dir)
    # The first step's: later steps keep what their round-trip plan, learned from measured
    # times, names (test_the_round_trip_plan_keeps_what_it_names_on_the_move_path).
    assert core_figures[0] == python_figures[0]
    for core, python in zip(core_grads, python_grads):
        for a, b, c in zip(core, python, plain):
            assert torch.equal(a, c) and torch.equal(b, c)
    first = core_figures[0]
    assert first["nvme_bytes"] + first["host_bytes"] > 0 and first["param_tensors"] > 0
    assert first["kept_bytes"] > 0


def _spilling_run(tiers: str, nvme_dir: str, **kw):
    """8 saved tensors of 256 KiB on `tiers`, whose first tier holds 4 of them (`kw`): the
    figures, x's gradient, and the first tier's used bytes once the forward filled it."""
    torch.manual_seed(0)
    x = torch.randn(64, 1024, requires_grad=True)
    with offload.activations(tiers=tiers, nvme_dir=nvme_dir, min_bytes=0, **kw) as ctx:
        y = x * 1
        for _ in range(8):
            y = y.sin()
        full = ctx._hooks.storer.tiers[tiers.split(",")[0]].used_bytes
        y.sum().backward()
    return _figures(ctx.stats), x.grad, full


@needs_core
def test_a_full_nvme_tier_spills_as_the_python_path_does(nvme_dir, monkeypatch):
    core, core_grad, _ = _spilling_run("nvme,host", nvme_dir, nvme_bytes="1MiB")
    monkeypatch.setattr(records, "saved_bytes_meter", PySavedBytes)
    python, python_grad, _ = _spilling_run("nvme,host", nvme_dir, nvme_bytes="1MiB")
    assert core == python and torch.equal(core_grad, python_grad)
    assert core["spilled_bytes"] > 0 and core["nvme_bytes"] > 0


@needs_core
def test_a_full_host_tier_spills_as_the_python_path_does(nvme_dir, monkeypatch):
    calls = _counting_python_path(monkeypatch)
    core, core_grad, full = _spilling_run("host,nvme", nvme_dir, host_bytes="1MiB")
    assert full == 4 * 256 * 1024
    assert calls[0] == 4   # the 4 that did not fit: the Python path spills them
    monkeypatch.setattr(records, "saved_bytes_meter", PySavedBytes)
    python, python_grad, _ = _spilling_run("host,nvme", nvme_dir, host_bytes="1MiB")
    assert core == python and torch.equal(core_grad, python_grad)
    assert core["spilled_bytes"] == 4 * 256 * 1024 and core["host_bytes"] == 4 * 256 * 1024
    assert core["exit_host_used_bytes"] == 0


@needs_core
def test_a_forced_decision_is_kept_by_the_move_path_and_standing_comes_back(nvme_dir):
    x = torch.randn(256, requires_grad=True)
    keep = Decision((), "forced keep")
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0) as ctx:
        placement = ctx._hooks.storer.placement
        standing = placement.standing
        assert standing is not None and standing.targets == ("nvme",)
        h = (x * 1).sin()                      # the first store opens the tier's store_cpu
        with placement.forced(keep):
            assert placement.standing is None
            kept = h.sin().sin()
        assert placement.standing is standing
        moved = kept.sin()
        moved.sum().backward()
    s = ctx.stats
    assert s.nvme_bytes == 2 * 1024            # h's input and kept: not the two forced saves
    assert s.kept_bytes == 2 * 1024


class _Plan:
    """A round-trip plan that keeps the storages at the given positions (1 KiB each)."""

    def __init__(self, positions) -> None:
        self.keep = {(p, 1024) for p in positions}


@needs_core
def test_the_round_trip_plan_keeps_what_it_names_on_the_move_path(nvme_dir, monkeypatch):
    calls = _counting_python_path(monkeypatch)
    x = torch.randn(256, requires_grad=True)
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0) as ctx:
        ctx._hooks.storer.placement.round_trip = _Plan([3, 4, 9])
        h = x * 1
        for _ in range(12):
            h = h.sin()
        h.sum().backward()
    s = ctx.stats
    assert s.round_trip_kept_bytes == 3 * 1024 and s.nvme_bytes == 9 * 1024
    assert calls[0] == 1 + 3   # the first store, and each kept one: the Python path's


def test_standing_is_what_decide_answers_when_nothing_keeps():
    placement = Placement(Config.from_env(env={}, tiers="host", min_bytes=16))
    info = TensorInfo(1024, key=(0, 1024))
    assert placement.standing is placement.decide(info)
    for kept in (TensorInfo(1024, no_offload=True), TensorInfo(1024, in_backward=True),
                 TensorInfo(8)):
        assert placement.decide(kept).keep
    with placement.forced(Decision((), "forced")):
        assert placement.standing is None
    assert placement.standing is placement.decide(info)
    assert Placement(Config.from_env(env={}, tiers="host", policy="recompute")).standing is None


def _changed_in_place(kind: str):
    """A graph whose saved tensor is then changed in place; autograd's error on backward."""
    x = torch.randn(1024, requires_grad=True)
    a = (x * 1).sin()            # with offload: the first store opens the tier's store_cpu
    if kind == "input":          # sin saves its input b; mul_ names itself at unpack
        b = a * 2
        y = b.sin()
        b.mul_(3)
    elif kind == "output":       # exp saves its output; the message names exp
        b = a.exp()
        y = b * 1
        b.add_(1)
    else:                        # a view saved, then dropped after its base changed
        base = a * 2
        view = base[:512]
        y = view.sin()
        del view
        base.add_(1)
    with pytest.raises(RuntimeError) as raised:
        y.sum().backward()
    return str(raised.value)


@needs_core
@pytest.mark.parametrize("tiers", ["nvme", "host"])
@pytest.mark.parametrize("kind", ["input", "output", "view"])
def test_a_tensor_changed_after_the_move_path_stored_it_raises_autograds_error(kind, tiers,
                                                                                 nvme_dir,
                                                                                 monkeypatch):
    plain = _changed_in_place(kind)
    calls = _counting_python_path(monkeypatch)
    with offload.activations(tiers=tiers, nvme_dir=nvme_dir, min_bytes=0):
        moved = _changed_in_place(kind)
    # Only nvme's first store goes through the Python hooks (it opens the tier's store_cpu).
    assert calls[0] == (1 if tiers == "nvme" else 0)
    assert "modified by an inplace operation" in moved
    if kind != "view":     # version_check.py: a dead view is named as autograd would not
        assert moved == plain


def _saved_again_after_a_change():
    x = torch.linspace(-2.0, 2.0, 4096, requires_grad=True)
    h = x * 1.5
    unused = h.sin()   # saves h at version 0; its node never runs in the backward
    h.mul_(2)          # so autograd never checks that save's version
    (h.cos() * 3).sum().backward()   # saves h at version 1, and uses it
    return x.grad, unused


@pytest.mark.parametrize("path", [pytest.param("core", marks=needs_core), "python"])
@pytest.mark.parametrize("tiers", ["nvme", "host"])
def test_a_storage_saved_again_after_an_in_place_change_is_stored_again(tiers, path, nvme_dir,
                                                                        monkeypatch):
    # The storage index finds a stored storage by its version too (tensor_meta NOTE
    # [Versions]). A save whose node never runs raises no error, so an index that ignored
    # versions would hand the later save the bytes stored before the change, silently.
    plain, _ = _saved_again_after_a_change()
    if path == "python":
        monkeypatch.setattr(records, "saved_bytes_meter", PySavedBytes)
    with offload.activations(tiers=tiers, nvme_dir=nvme_dir, min_bytes=0) as ctx:
        grad, unused = _saved_again_after_a_change()
        del unused
    assert torch.equal(grad, plain)
    # h saved twice (sin, cos; the products by numbers save nothing), stored twice.
    assert ctx.stats.offloaded_tensors == 2 and ctx.stats.saved_bytes == 2 * 4096 * 4


@needs_core
@pytest.mark.parametrize("tiers", ["nvme", "host"])
def test_a_moved_save_dropped_unpacked_gives_its_space_back(tiers, nvme_dir):
    x = torch.randn(1024, requires_grad=True)
    with offload.activations(tiers=tiers, nvme_dir=nvme_dir, min_bytes=0) as ctx:
        h = x * 1
        for _ in range(20):
            h = h.sin()
        assert ctx._hooks.ledger.live_records == 20
        assert ctx._hooks.storer.tiers[tiers].used_bytes == 20 * 4096
        del h                    # the graph dies without a backward
        assert ctx._hooks.ledger.live_records == 0
        assert ctx._hooks.storer.tiers[tiers].used_bytes == 0
    assert ctx.stats.as_dict()[f"exit_{tiers}_used_bytes"] == 0


class _SavesEachWay(torch.autograd.Function):
    """Saves one storage as several tensors (other dtypes, sizes, strides, offsets, the
    same tensor twice, a 0-d one, conj and neg bits) in the order given, and checks in the
    backward that each comes back as saved: values, dtype, size, stride, storage offset and
    bits. The references are kept on ctx, which the saved-tensor hooks never see."""

    @staticmethod
    def forward(ctx, x, order):
        flat = x.detach()
        views = {
            "float": flat,
            "again": flat,                                  # the same tensor, saved twice
            "int32": flat.view(torch.int32),                # the bytes as another dtype
            "int64": flat.view(torch.int64),
            "2d": flat.view(8, -1),
            "3d": flat.view(2, 4, -1),
            "t": flat.view(8, -1).t(),                      # strided
            "tail": flat[5:],                               # an offset into the storage
            "scalar": flat[3],                              # 0-d
            "complex": flat.view(torch.complex64).conj(),   # a conjugate bit
            "neg": torch._neg_view(flat.view(8, -1)),       # a negative bit
        }
        ctx.refs = [(name, views[name].clone(), views[name].stride(),
                     views[name].storage_offset(), views[name].is_conj(),
                     views[name].is_neg()) for name in order]
        ctx.save_for_backward(*(views[name] for name in order))
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        total = torch.zeros((), dtype=torch.float64)
        for saved, (name, ref, stride, offset, conj, neg) in zip(ctx.saved_tensors, ctx.refs):
            assert saved.dtype == ref.dtype and saved.shape == ref.shape, name
            assert (saved.stride(), saved.storage_offset()) == (stride, offset), name
            assert (saved.is_conj(), saved.is_neg()) == (conj, neg), name
            assert torch.equal(saved.resolve_conj().resolve_neg(), ref), name
            total = total + saved.resolve_conj().resolve_neg().abs().double().sum()
        return grad * 2 + total.float() * 1e-9, None


@needs_core
@pytest.mark.parametrize("order", [
    ("float", "again", "int32", "2d", "3d", "t", "tail", "scalar", "complex", "neg"),
    ("int32", "float", "again", "int64", "neg", "2d"),   # loaded first as int32
    ("complex", "3d", "scalar", "float"),                 # ... as complex64
    ("t", "tail", "2d"),
])
def test_a_moved_storage_comes_back_as_each_save_saw_it(order, nvme_dir):
    # The core hands a CPU nvme payload out typed as the first unpack's dtype, and the other
    # saves of the storage view that tensor (csrc/view_layout.cpp rebuild_flat): each must get
    # exactly what it saved, whichever loads first. (These saves have no grad_fn, so the
    # Python hooks pack them; they make the core's MovedSave, which the core unpacks.)
    x0 = torch.randn(64)

    def step():
        x = x0.clone().requires_grad_()
        h = x.sin()
        for _ in range(3):
            h = _SavesEachWay.apply(h, order)
        h.sum().backward()
        return x.grad

    plain = step()
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0) as ctx:
        moved = step()
    assert torch.equal(moved, plain)
    assert ctx.stats.nvme_bytes == 3 * 64 * 4 and ctx.stats.offloaded_tensors == 3 * len(order)
