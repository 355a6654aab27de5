"""Saved tensors below OFFLOAD_MIN_BYTES (hooks.py NOTE [Handles in C]): the compiled core's
C path and the Python path hold, check and count them the same way.

Every test runs both ways: `core` (the default where the core is built: Packer /
SmallSave) and `python` (the ledger given the Python meter, as in a process without the
core: SmallKept). The figures, gradients and messages must be identical.
"""
from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
import torch.nn as nn

import offload
from offload._ext import core_available
from offload.runtime import records
from offload.runtime.saved_bytes import PySavedBytes
from offload.util.stats import Stats

pytestmark = pytest.mark.skipif(not core_available(), reason="needs the compiled core")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

# Timing and step-shape figures differ run to run; everything else must match.
_TIMED = ("_s", "_gbps", "fraction", "step_s")


class Net(nn.Module):
    """Small saves of every kind: inputs (linear, mul), outputs (gelu's input, exp's
    result, sigmoid's), a storage saved twice (`h * h`), views, a weight view (`w.t()`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.b = nn.Linear(32, 8)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.norm(self.a(x)))
        h = h * h + h.exp().sigmoid()
        h = h[:, :16].tanh() @ self.a.weight[:16, :16].t()
        return self.b(torch.cat([h, h], dim=1)).sum()


def _step(model, x, **kw):
    # The capacity given, not measured from the free memory (which moves between runs).
    with offload.activations(model=model, tiers="host", host_bytes=1 << 30, **kw) as ctx:
        model(x).backward()
    return ctx


def test_a_small_save_is_what_autograd_holds_and_the_collector_never_walks(path):
    """The point of the C path: the object autograd holds is not tracked by the garbage
    collector; the Python path's is."""
    held = []
    x = torch.randn(4, 8, requires_grad=True)
    with offload.activations(tiers="host") as ctx:
        y = (x * 2).sin()   # saves x * 2: small, made by an op
        hooks = ctx._step.hooks
        held.append(hooks.pack((x * 3).sin()))
    kind = type(held[0]).__name__
    assert kind == ("SmallSave" if path == "core" else "SmallKept")
    assert gc.is_tracked(held[0]) is (path == "python")
    y.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_are_exact_and_the_figures_add_up(path, device):
    model = Net().to(device)
    x = torch.randn(6, 16, device=device)
    plain = Net().to(device)
    plain.load_state_dict(model.state_dict())
    plain(x).backward()
    ctx = _step(model, x)
    for p, q in zip(model.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
    s = ctx.stats
    assert s.packed_tensors > 10 and s.param_tensors >= 1
    # One storage counted once however often it is saved; all of it resident at the peak.
    assert s.unique_storages < s.packed_tensors
    assert s.peak_resident_bytes == s.saved_bytes == s.kept_bytes > 0


def test_the_figures_match_on_the_same_step(monkeypatch):
    """The same program under both paths in one test (no cache needed): every figure equal."""
    model, x = Net(), torch.randn(6, 16)
    got = []
    for python in (False, True):
        if python:
            monkeypatch.setattr(records, "saved_bytes_meter", PySavedBytes)
        model.zero_grad()
        ctx = _step(model, x)
        got.append({k: v for k, v in ctx.stats.as_dict().items() if not k.endswith(_TIMED)})
        got[-1]["grads"] = [p.grad.clone() for p in model.parameters()]
    core, python = got
    for a, b in zip(core.pop("grads"), python.pop("grads")):
        assert torch.equal(a, b)
    assert core == python


def _error(fn) -> str:
    with pytest.raises(RuntimeError) as info:
        fn()
    return str(info.value)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["input", "output", "view of input", "weight"])
@pytest.mark.parametrize("min_bytes", [None, 0], ids=["small", "not small"])
def test_an_in_place_change_raises_autograds_own_message(path, case, device, min_bytes):
    """Small saves (SmallSave / SmallKept), and with min_bytes 0 saves that stay with their
    record on a CPU (KeptSave / Kept: tests/test_records_in_c.py) or move on CUDA."""
    kw = {} if min_bytes is None else {"min_bytes": min_bytes}

    def run(hooked: bool):
        w = torch.randn(8, requires_grad=True, device=device)
        x = w * 1
        ctx = offload.activations(tiers="host", **kw) if hooked else torch.enable_grad()
        with ctx:
            if case == "input":
                y = x * w          # saves x (an input of mul)
                x.add_(1)
            elif case == "output":
                y = x.exp()        # saves its own output
                y.add_(1)
            elif case == "view of input":
                v = x[2:6]
                y = v.sin()        # saves the view
                x.mul_(2)          # changes it through its base
            else:
                y = (x * w).sum() * w   # saves w (a weight: it stays, whatever its size)
                with torch.no_grad():
                    w.add_(1)
            y.sum().backward()

    expected = _error(lambda: run(False))
    assert "modified by an inplace operation" in expected
    assert _error(lambda: run(True)) == expected


def test_resident_bytes_fall_as_backward_frees_and_a_dropped_graph_frees_too(path):
    x = torch.randn(64, requires_grad=True)
    with offload.activations(tiers="host") as ctx:
        meter = ctx._step.ledger.meter
        h = x * 1                       # not a leaf (a leaf's saves count as weights)
        kept = h.sin().cos().exp()      # three small saves alive
        dropped = h.tanh().sigmoid()    # two, of a graph nobody runs backward on
        alive = meter.resident
        assert alive == 5 * 64 * 4
        del dropped                     # freed with its graph, no backward needed:
        more = h.exp()                  # so one more save does not raise the peak
        (kept + more).sum().backward()
    assert ctx.stats.peak_resident_bytes == alive
    assert ctx.stats.resident_bytes == 0 and meter.resident == 0


def test_no_reference_cycle_keeps_a_step_alive(path):
    """The hooks hold their packer, the packer holds them weakly: neither is walked by the
    collector, so a cycle between them would never be freed."""
    x = torch.randn(32, requires_grad=True)
    with offload.activations(tiers="host") as ctx:
        hooks = weakref.ref(ctx._step.hooks)
        y = x.sin().cos()
    y.sum().backward()
    del ctx, y
    gc.collect()
    assert hooks() is None


def test_a_packer_called_after_its_context_is_gone_says_so():
    if not core_available():
        pytest.skip("the core's packer")
    with offload.activations(tiers="host", min_bytes=1024) as ctx:
        pack = ctx._step.hooks.pack
    assert type(pack).__name__ == "Packer"
    del ctx
    gc.collect()
    with pytest.raises(RuntimeError, match="after its offload.activations\\(\\) context"):
        pack(torch.randn(4096, requires_grad=True) * 2)   # not small: the full path is gone


def test_the_packer_is_the_hook_with_the_core_and_the_python_path_without(path):
    """With min_bytes 0 nothing is small, and the core's packer is still the hook: it makes
    the handles of kept tensors too (tests/test_records_in_c.py)."""
    with offload.activations(tiers="host", min_bytes=0) as ctx:
        hooks = ctx._step.hooks
        if path == "core":
            assert type(hooks.pack).__name__ == "Packer"
        else:
            assert hooks.pack == hooks.pack_full


def test_small_saves_under_the_profiler_take_the_python_path_and_are_recorded(path):
    x = torch.randn(16, requires_grad=True)
    with torch.profiler.profile() as prof:
        with offload.activations(tiers="host") as ctx:
            x.sin().cos().sum().backward()
    names = [e.name for e in prof.events()]
    assert any("pack" in n for n in names), sorted(set(names))[:20]
    assert ctx.stats.packed_tensors == 2


def test_a_storage_saved_by_both_paths_is_counted_once(path):
    """A profiler started mid-step sends later small saves through the Python path: a
    storage saved before and after is still one storage, resident once."""
    x = torch.randn(64, requires_grad=True)
    with offload.activations(tiers="host") as ctx:
        h = x * 1
        a = h.sin()                     # saves h (the C path, where the core is built)
        with torch.profiler.profile():
            b = h.cos()                 # saves h again (the Python path: ranges recorded)
        (a + b).sum().backward()
    s = ctx.stats
    assert (s.packed_tensors, s.unique_storages) == (2, 1)
    assert s.peak_resident_bytes == s.saved_bytes == s.kept_bytes == 64 * 4
    assert ctx._step.ledger.meter.resident == 0


def test_an_error_inside_the_packer_is_raised_and_nothing_is_counted():
    """An error while a SmallSave is being made (here: the sequence-number call) reaches the
    caller as it is; the half-made save is freed without touching the meter."""
    from offload._ext import load_core

    core = load_core()

    class Owner:
        def full(self, t):
            raise AssertionError("not reached")

    def broken():
        raise ValueError("sequence numbers unavailable")

    meter = core.SavedBytes()
    owner = Owner()
    packer = core.Packer(weakref.ref(owner), Owner.full, Owner.full, meter, 1 << 20,
                         torch.Tensor, torch.strided, lambda: False, broken, records.Record)
    x = torch.randn(8, requires_grad=True) * 2
    with pytest.raises(ValueError, match="sequence numbers unavailable"):
        packer(x)
    assert (meter.resident, meter.small_storages_alive, meter.take_counts()) == (0, 0, (0, 0, 0, 0, 0, []))
    for wrong in (PySavedBytes(), None):   # a packer counts into the core's meter only
        with pytest.raises(TypeError, match="the core's SavedBytes, not "
                                            f"{type(wrong).__name__}"):
            core.Packer(weakref.ref(owner), Owner.full, Owner.full, wrong, 1 << 20,
                        torch.Tensor, torch.strided, lambda: False, broken, records.Record)


def test_a_packer_takes_only_the_cores_own_record_type_and_index():
    """The core reads a Packer's records and index as its own types, with no Python call:
    a Python record class or another index object was read as them (heap overflows under
    ASan, a segfault in a plain build). Refused when the packer is made."""
    from offload._ext import load_core

    core = load_core()

    class Owner:
        def full(self, t):
            return t

    owner = Owner()
    front = (weakref.ref(owner), Owner.full, Owner.full, core.SavedBytes(), 1 << 20,
             torch.Tensor, torch.strided, lambda: False, lambda: 0)
    for wrong in (records.PyRecord, bytes):
        with pytest.raises(TypeError, match="record_type must be the core's Record"):
            core.Packer(*front, wrong)
    moves = dict(timeline=core.Timeline(), prefetcher=core.Prefetcher(
                     1 << 20, Stats(), lambda: False, lambda *a: None, "prefetch"),
                 lock=threading.RLock(), param_ids={}, no_offload=object(),
                 graph_task_id=lambda: -1, empty=torch.empty(0), cpu_device=torch.device("cpu"))
    with pytest.raises(TypeError, match="core's StorageIndex, not object"):
        core.Packer(*front, records.Record, index=object(), **moves)
    core.Packer(*front, records.Record, index=core.StorageIndex(), **moves)   # its own: taken
