"""The nvme tier's per-storage records (csrc/nvme_records.cpp: its payload, write and read)
and its read buffers: no object per saved tensor for the garbage collector to track beyond
what the tensors themselves need (docs/benchmarks.md *Hook cost*), with the same fields and
lifetimes as the Python objects they replaced."""
from __future__ import annotations

import gc

import pytest
import torch

import offload
from offload._ext import core_available, load_core
from offload.errors import ExtensionUnavailable
from offload.tiers import nvme, nvme_reads, nvme_writes

pytestmark = pytest.mark.skipif(not core_available(), reason="needs the compiled core")


def test_the_tier_makes_untracked_payloads_writes_and_reads(nvme_dir):
    x = torch.randn(4096, requires_grad=True)
    (x * 2).tanh().sum().backward()
    plain, x.grad = x.grad, None
    seen = {}
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0) as ctx:
        tier = ctx.tiers["nvme"]
        y = (x * 2).tanh()            # saves its output: one stored storage
        (payload,) = tier._live
        seen["payload"], seen["write"] = payload, payload.write
        assert tier.prefetch(payload)                 # a read in flight, not yet fetched
        seen["read"] = payload.read
        y.sum().backward()
    assert type(seen["payload"]) is load_core().NvmePayload
    assert type(seen["write"]) is load_core().NvmeWrite
    assert type(seen["read"]) is load_core().NvmeRead
    for name, obj in seen.items():
        assert not gc.is_tracked(obj), name
    # The tier let go of both transfers, and of the payload once autograd dropped its save.
    assert seen["payload"].write is None and seen["payload"].read is None
    assert seen["payload"].released
    assert torch.equal(x.grad, plain)


def test_the_records_fields_start_empty_and_take_what_the_tier_sets():
    device = torch.device("cpu")
    p = nvme._NvmePayload(None, 4096, device, 64, False)
    assert (p.nbytes, p.device, p.phase, p.cuda, p.resident) == (4096, device, 64, False, False)
    assert (p.write, p.read, p.released) == (None, None, False)
    w = nvme_writes.Write(4096)
    assert (w.nbytes, w.future, w.source, w.address, w.direct_bytes, w.d2h, w.start_s) == (
        4096, None, None, 0, 0, None, 0.0)
    p.write, w.address, w.direct_bytes, w.start_s = w, 1 << 63, 4096, 2.5
    assert p.write is w and (w.address, w.direct_bytes, w.start_s) == (1 << 63, 4096, 2.5)
    p.write = None
    p.released = True
    assert p.released and p.write is None
    future, buf = object(), torch.empty(8, dtype=torch.uint8)
    r = nvme_reads.Read(8, future, buf, False)
    assert (r.nbytes, r.future, r.buf, r.gpu, r.observed) == (8, future, buf, False, False)
    assert r.start_s > 0     # when it was made, on time.perf_counter()'s clock
    for field in ("nbytes", "extent", "device", "phase", "cuda"):
        with pytest.raises(AttributeError):
            setattr(p, field, 1)        # what the payload stands for does not change


def test_the_core_counts_the_records_alive_for_the_leak_check():
    alive = load_core()._nvme_records_alive
    before = alive()
    p = nvme._NvmePayload(None, 1, torch.device("cpu"), 0, False)
    p.write, p.read = nvme_writes.Write(1), nvme_reads.Read(1, None, None, False)
    assert alive() == tuple(n + 1 for n in before)
    del p                               # the payload takes its write and read with it
    assert alive() == before


@pytest.mark.parametrize("make, message", [
    (lambda: nvme._NvmePayload(None, 1, torch.device("cpu"), 0), r"takes 5 arguments \(4 given\)"),
    (lambda: nvme_reads.Read(1, None, None), r"takes 4 arguments \(3 given\)"),
    (lambda: nvme_writes.Write(nbytes=1), "by position only"),
    (lambda: nvme_writes.Write(True), "nbytes must be an int, not bool"),
    (lambda: nvme._NvmePayload(None, 1, torch.device("cpu"), 0.5, False),
     "phase must be an int, not float"),
])
def test_the_records_refuse_bad_arguments_naming_them(make, message):
    with pytest.raises(TypeError, match=message):
        make()


@pytest.mark.parametrize("from_arena", [True, False])
@pytest.mark.parametrize("phase", [0, 64, 448])
def test_a_read_buffer_has_the_payloads_phase_and_holds_its_memory(from_arena, phase):
    core, alignment, nbytes = load_core(), 4096, 10_000
    arena = core.HostArena(1 << 20, pinned=False)
    block = arena.allocate(nbytes + alignment) if from_arena else None
    taken = arena.used_bytes
    gc.collect()
    before = {id(o) for o in gc.get_objects()}
    buf = nvme_reads.phase_buffer(core, nbytes, phase, alignment, block)
    made = [o for o in gc.get_objects() if id(o) not in before]
    # The tensor holds the block itself: no memoryview per read for the collector to track.
    assert not [o for o in made if isinstance(o, memoryview)]
    del made
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes
    assert buf.storage_offset() == 0 and buf.untyped_storage().nbytes() == nbytes
    assert buf.data_ptr() % alignment == phase
    if from_arena:
        del block
        assert arena.used_bytes == taken > 0   # the tensor keeps the block
        buf.fill_(7)
        assert int(buf.sum()) == 7 * nbytes
        del buf
        assert arena.used_bytes == 0           # ... and only the tensor
    assert nvme_reads.phase_buffer(core, 0, phase, alignment).numel() == 0


def test_a_core_built_before_the_records_is_named_with_the_fix(nvme_dir, monkeypatch):
    # A stale build imports (offload stays importable) and says what to do when used.
    monkeypatch.setattr(nvme, "_NvmePayload", None)
    x = torch.randn(64, requires_grad=True)
    with pytest.raises(ExtensionUnavailable, match=r"predates the nvme tier.*pip install -e \."):
        with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0):
            (x * 2).tanh().sum().backward()
