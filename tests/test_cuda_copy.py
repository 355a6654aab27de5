"""CUDA copy engine (runs only where a GPU is present; conftest skips `cuda` tests
elsewhere): D2H/H2D on caller streams with events, the chained device -> pinned -> NVMe
write (starts only when the D2H event completes) and NVMe -> pinned -> device read.

Tensors are large and copied on side streams right after being produced, so a missing
event wait shows up as wrong bytes instead of passing by luck."""
from __future__ import annotations

import pytest
import torch

from offload._ext import load_core

C = load_core()
MiB = 1 << 20

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not C.cuda_compiled, reason="offload._C built without CUDA"),
]


def _recorded_event(stream: torch.cuda.Stream) -> torch.cuda.Event:
    """torch creates the CUDA event lazily: record once so `cuda_event` is a real handle."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _produce(n_floats: int, seed: int) -> torch.Tensor:
    """A tensor whose last kernel is still running when this returns (long chain)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.rand(n_floats, device="cuda", generator=g)
    for _ in range(20):
        x = x * 1.0001 + 0.5
    return x


def test_cuda_is_usable_and_the_arena_is_pinned():
    assert C.cuda_usable() and C.cuda_unusable_reason() == ""
    # torch answers is_pinned() False for every pointer until it has initialised CUDA itself
    # (seen on torch 2.11, H200): the runtime asks only after device tensors exist.
    torch.zeros(1, device="cuda")
    arena = C.HostArena(8 * MiB)
    assert arena.pinned
    block = arena.allocate(MiB)
    view = torch.frombuffer(block, dtype=torch.uint8)
    assert view.is_pinned()


def test_copy_d2h_then_h2d_round_trip_on_side_streams():
    n = 64 * MiB // 4
    arena = C.HostArena(n * 4)
    block = arena.allocate(n * 4)
    torch.frombuffer(block, dtype=torch.uint8).zero_()
    src = _produce(n, seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())      # src is produced on the current stream
    d2h_done = _recorded_event(side)
    C.copy_d2h(block.ptr, src.data_ptr(), n * 4, side.cuda_stream, d2h_done.cuda_event)
    d2h_done.synchronize()                              # host reads the block only after D2H
    host = torch.frombuffer(block, dtype=torch.float32)
    assert torch.equal(host, src.cpu())

    dst = torch.empty_like(src)
    h2d_done = _recorded_event(side)
    side.wait_stream(torch.cuda.current_stream())       # dst's allocation is ordered before
    C.copy_h2d(dst.data_ptr(), block.ptr, n * 4, side.cuda_stream, h2d_done.cuda_event)
    torch.cuda.current_stream().wait_event(h2d_done)    # consumer waits for the H2D
    assert torch.equal(dst, src)


def test_write_after_event_waits_for_the_d2h(nvme_dir):
    n = 128 * MiB // 4
    arena = C.HostArena(n * 4)
    store = C.NvmeStore([nvme_dir], n * 4 + MiB, workers=8)
    block = arena.allocate(n * 4)
    torch.frombuffer(block, dtype=torch.uint8).zero_()  # stale bytes a racing write would store
    src = _produce(n, seed=2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    d2h_done = _recorded_event(side)
    C.copy_d2h(block.ptr, src.data_ptr(), n * 4, side.cuda_stream, d2h_done.cuda_event)
    ext = store.allocate(n * 4)
    fut = store.write_after_event(ext, block, d2h_done.cuda_event)  # no host sync in between
    del block                                            # the write holds the pinned memory
    assert fut.wait() == n * 4
    back = torch.empty(n, dtype=torch.float32)
    store.read_ptr(ext, back.data_ptr(), n * 4).wait()
    assert torch.equal(back, src.cpu())
    store.close()


def test_read_then_h2d_delivers_to_the_device(nvme_dir):
    n = 64 * MiB // 4 + 3
    expected = torch.rand(n)
    arena = C.HostArena(2 * n * 4)
    store = C.NvmeStore([nvme_dir], n * 4 + MiB, workers=8)
    ext = store.allocate(n * 4)
    store.write_ptr(ext, expected.data_ptr(), n * 4).wait()
    for round_ in range(3):                              # blocks get reused between rounds
        block = arena.allocate(n * 4)
        dst = torch.full((n,), -1.0, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())    # dst's fill is ordered before the H2D
        h2d_done = _recorded_event(side)
        fut = store.read_then_h2d(ext, block, dst.data_ptr(), n * 4, side.cuda_stream,
                                  h2d_done.cuda_event)
        block.release()                                  # store keeps it until the H2D ran
        assert fut.wait() == n * 4
        torch.cuda.current_stream().wait_event(h2d_done)
        scribble = arena.allocate(n * 4)                 # must not clobber an unfinished H2D
        if scribble is not None:
            torch.frombuffer(scribble, dtype=torch.uint8).fill_(0xFF)
            scribble.release()
        assert torch.equal(dst.cpu(), expected), f"round {round_}"
    store.close()


def test_read_then_h2d_checks_its_arguments(nvme_dir):
    arena = C.HostArena(MiB)
    store = C.NvmeStore([nvme_dir], MiB)
    ext = store.allocate(4096)
    block = arena.allocate(4096)
    stream = torch.cuda.Stream()
    event = _recorded_event(stream)
    with pytest.raises(ValueError, match="exceeds the block"):
        store.read_then_h2d(ext, block, 1, 8192, stream.cuda_stream, event.cuda_event)
    with pytest.raises(ValueError, match="dst_ptr is 0"):
        store.read_then_h2d(ext, block, 0, 4096, stream.cuda_stream, event.cuda_event)
    with pytest.raises(ValueError, match="event handle is 0"):
        store.write_after_event(ext, block, 0)
    store.close()
