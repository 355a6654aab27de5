"""How the tiers drive CopyStreams on a CUDA run, checked on the CPU with a recording stub.

The stream protocol itself is tested in test_copy_protocol.py (simulated GPU) and on a real
GPU in test_cuda_race.py; here: which CopyStreams call each payload step makes, with which
arguments (pack → offload, prefetch → reload after the D2H, unpack → tensor_for_use or the
held source, release → nothing left behind).
"""
from __future__ import annotations

import pytest
import torch

from offload.util.stats import Stats
from offload.tiers.host import HostTier, _PinnedPayload

CUDA = torch.device("cuda", 0)   # only a label: nothing runs on it


class _D2H:
    def __init__(self, src):
        self.src = src

    def device_tensor_if_held(self):
        return self.src


class _H2D:
    def __init__(self, log, out):
        self.log, self.out = log, out

    def tensor_for_use(self):
        self.log.append("tensor_for_use")
        return self.out


class _Copies:
    def __init__(self):
        self.log = []

    def offload(self, src, block):
        self.log.append(("offload", src.numel(), block.numel()))
        return _D2H(None)

    def reload(self, block, nbytes, *, after=None):
        self.log.append(("reload", nbytes, after))
        return _H2D(self.log, block[:nbytes].clone())


def _tier():
    copies = _Copies()
    seen = []

    def provider(device):
        seen.append(device)
        return copies

    return HostTier(1 << 20, Stats(), copies=provider), copies, seen


def _pinned(tier, host, d2h=None):
    """A payload as HostTier.store makes it for a CUDA source (the tier counts its bytes)."""
    assert tier._ledger.take(host.numel())
    payload = _PinnedPayload(host, CUDA, d2h)
    tier._pinned.add(payload)
    return payload


def test_prefetch_reloads_after_the_d2h_and_fetch_hands_the_ticket_to_the_stream():
    tier, copies, seen = _tier()
    host = torch.arange(64, dtype=torch.uint8)
    d2h = _D2H(None)
    p = _pinned(tier, host, d2h)
    assert tier.prefetchable(p) and not tier.prefetched(p)
    assert tier.prefetch(p) and tier.prefetched(p)
    assert not tier.prefetch(p)                   # one reload per use
    assert copies.log == [("reload", 64, d2h)]    # Note 5: ordered after the D2H
    out = tier.fetch(p)
    assert torch.equal(out, host) and copies.log[-1] == "tensor_for_use"
    assert not tier.prefetched(p)
    tier.fetch(p)                                 # retain_graph: loads again
    assert [e for e in copies.log if e != "tensor_for_use"] == [("reload", 64, d2h)] * 2


def test_fetch_uses_the_source_while_its_d2h_is_pending():
    tier, copies, _ = _tier()
    src = torch.full((32,), 7, dtype=torch.uint8)
    p = _pinned(tier, torch.zeros(32, dtype=torch.uint8), _D2H(src))
    assert tier.fetch(p) is src
    assert copies.log == [] and tier._stats.pending_copy_hits == 1


def test_release_frees_the_space_and_refuses_later_use():
    tier, copies, _ = _tier()
    p = _pinned(tier, torch.zeros(32, dtype=torch.uint8), _D2H(None))
    assert tier.used_bytes == 32
    tier.prefetch(p)
    tier.release(p)
    tier.release(p)
    assert tier.used_bytes == 0 and tier.released(p) and not tier.prefetched(p)
    assert not tier.prefetch(p)


def test_without_copystreams_the_payload_is_not_prefetchable():
    tier = HostTier(1 << 20, Stats())
    p = _pinned(tier, torch.zeros(8, dtype=torch.uint8))
    assert not tier.prefetchable(p) and not tier.prefetch(p)


def test_a_cpu_run_never_creates_copy_streams(nvme_dir, monkeypatch):
    import offload
    from offload.tiers import copies as cuda_streams

    def boom(*a, **k):
        raise AssertionError("CopyStreams made on a CPU-only run")

    monkeypatch.setattr(cuda_streams, "CopyStreams", boom)
    x = torch.randn(64, 256, requires_grad=True)
    with offload.activations(tiers="host,nvme", nvme_dir=nvme_dir, host_bytes="64KiB",
                             min_bytes=0) as ctx:
        (x.exp() * 2).tanh().sum().backward()
    assert ctx.stats.nvme_bytes > 0 and ctx._step.copies == {}


def test_closing_a_step_folds_copy_stats_into_its_stats():
    import offload
    from offload.tiers.copies import CopyStats

    class FakeCopies:
        def __init__(self):
            self.closed = False
            self.stats = CopyStats(d2h_bytes=100, h2d_bytes=60, d2h_busy_s=1e-6,
                                   h2d_busy_s=2e-6, backpressure_wait_s=0.25,
                                   h2d_wait_s=0.5, max_d2h_inflight=3, max_h2d_inflight=2)

        def close(self):
            self.closed = True

    from offload.util.stats import Stats
    from offload.runtime.step import Step

    step = Step(offload.Config.from_env(env={}, policy="keep"), Stats())
    fake = FakeCopies()
    step.copies = {CUDA: fake}
    step.close_copies()
    s = step.stats
    assert fake.closed and step.copies == {}
    assert (s.d2h_bytes, s.h2d_bytes) == (100, 60)
    assert s.d2h_gbps == pytest.approx(0.1) and s.h2d_gbps == pytest.approx(0.03)
    assert (s.stall_forward_s, s.stall_backward_s, s.stall_s) == (0.25, 0.5, 0.75)
    assert (s.peak_d2h_inflight, s.peak_h2d_inflight) == (3, 2)
