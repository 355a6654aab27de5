"""offload's work shows in the user's profiler as `offload::…` ranges (util/ranges.py)."""
from __future__ import annotations

import torch
from torch.profiler import profile

import offload
from offload.util import ranges


def _step(nvme_dir, **settings):
    x = torch.randn(256, 1024, requires_grad=True)
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0, **settings) as ctx:
        y = x
        for _ in range(12):
            y = (y * 1.01).sin()
        y.sum().backward()
    return ctx


def test_an_nvme_step_shows_its_ranges_in_torch_profiler(nvme_dir):
    with profile() as prof:
        ctx = _step(nvme_dir)
    seen = {e.key: e.count for e in prof.key_averages() if e.key.startswith("offload::")}
    for name in (ranges.PACK, ranges.UNPACK, ranges.WRITE, ranges.PREFETCH, ranges.WAIT_READ):
        assert name in seen, f"{name} missing from the profile: {sorted(seen)}"
    assert seen[ranges.PACK] == ctx.stats.packed_tensors


def _count_ranges(monkeypatch) -> list:
    made: list = []
    real = ranges.record_function
    monkeypatch.setattr(ranges, "record_function", lambda name: made.append(name) or real(name))
    return made


def test_no_profiler_no_ranges(nvme_dir, monkeypatch):
    made = _count_ranges(monkeypatch)
    _step(nvme_dir)
    assert made == []                    # nothing but the flag check when none runs


def test_the_range_counter_sees_ranges_under_a_profiler(nvme_dir, monkeypatch):
    """The control for the test above: the same counter does count under a profiler."""
    made = _count_ranges(monkeypatch)
    with profile():
        _step(nvme_dir)
    assert ranges.PACK in made and ranges.WRITE in made


def test_a_recomputed_block_shows_as_a_range(nvme_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU())
                                  for _ in range(3)])
    with profile() as prof:
        with offload.activations(model=model, policy="recompute", tiers="nvme",
                                 nvme_dir=nvme_dir, min_bytes=0):
            model(torch.randn(8, 64)).sum().backward()
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get(ranges.RECOMPUTE) == 3           # each block re-run once, in backward
