"""CopyStreams on a real GPU (cuda-marked; skipped without one).

Round trips of odd sizes through both kinds of pinned blocks, and the race checks made
deterministic by holding copies back with a GPU spin (`torch.cuda._sleep`) on their stream:
correct code stays exact, and a removed consumer wait is seen. The stream protocol itself is
tested on the CPU with a simulated GPU in tests/test_copy_protocol.py.
"""
from __future__ import annotations

import pytest
import torch

from offload.tiers.copies import CopyStreams


def _pinned_blocks():
    """Block factories to test: torch-pinned memory always, the _C arena when built with CUDA."""
    kinds = [("torch-pinned", lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy())]
    try:
        from offload._ext import load_core
        core = load_core()
        if core.cuda_compiled and core.cuda_usable():
            arena = core.HostArena(256 << 20, pinned=True)
            kinds.append(("arena", arena.allocate))
    except Exception:   # no extension here: the torch-pinned case still runs
        pass
    return kinds


def _delay_copies(copies, cycles=50_000_000):
    """Make every copy start late (a GPU spin on its stream), so a missing wait shows."""
    backend = copies._backend
    real_copy = backend.copy

    def late_copy(dst, src, stream):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)
        real_copy(dst, src, stream)

    backend.copy = late_copy


@pytest.mark.cuda
@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, (1 << 20) + 3, 64 << 20])
def test_gpu_round_trip_odd_sizes(nbytes):
    for kind, make_block in _pinned_blocks():
        copies = CopyStreams(torch.device("cuda"))
        x = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        want = x.clone()
        block = make_block(nbytes)
        ticket = copies.offload(x, block)
        del x
        back = copies.reload(block, nbytes, after=ticket).tensor_for_use()
        assert torch.equal(back, want), kind
        copies.close()


@pytest.mark.cuda
def test_gpu_delayed_copies_stay_exact():
    copies = CopyStreams(torch.device("cuda"))
    _delay_copies(copies)
    x = torch.full((1 << 20,), 7, dtype=torch.uint8, device="cuda")
    block = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True).numpy()
    ticket = copies.offload(x, block)
    del x
    garbage = torch.full((1 << 20,), 0xEE, dtype=torch.uint8, device="cuda")  # reuses x's block if freed
    back = copies.reload(block, 1 << 20, after=ticket).tensor_for_use()
    assert int(back.min()) == int(back.max()) == 7
    del garbage
    copies.close()
    assert copies.stats.d2h_copies == copies.stats.h2d_copies == 1
    assert copies.stats.d2h_gbps > 0 and copies.stats.h2d_gbps > 0


@pytest.mark.cuda
def test_gpu_missing_consumer_wait_is_detected(monkeypatch):
    """Remove Note 7's wait: with the H2D held back by a GPU spin, compute reads early."""
    copies = CopyStreams(torch.device("cuda"))
    _delay_copies(copies)
    monkeypatch.setattr(copies._backend, "wait_event",
                        lambda stream, ev, real=copies._backend.wait_event:
                        None if stream == torch.cuda.current_stream() else real(stream, ev))
    # Random bytes: stale device memory cannot match them by accident.
    want = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8)
    block = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True).numpy()
    block[:] = want.numpy()
    back = copies.reload(block, 1 << 20).tensor_for_use()
    seen = back.clone()   # on the current stream, which no longer waits for the H2D
    copies.close()
    assert not torch.equal(seen.cpu(), want)
