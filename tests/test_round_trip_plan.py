"""The round-trip plan, in the runtime: the previous step's measured gaps decide what stays put."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import offload
from offload.runtime.round_trip import LinkSpeed, TensorTiming
from offload.runtime.round_trip import RoundTripPlan, plan_for
from offload.tiers.pool import clear

from offload._ext import core_available

needs_core = pytest.mark.skipif(not core_available(), reason="offload._C unavailable")


def test_plan_keeps_the_shortest_gaps_up_to_the_cap():
    link = LinkSpeed(1e9, 1e9)   # 1 MB takes 1 ms each way
    # four 1 MB tensors packed at 0..3 ms; the last two are needed again at once
    timings = [TensorTiming((0, 10**6), 10**6, 0.000, 1.000),
               TensorTiming((1, 10**6), 10**6, 0.001, 0.900),
               TensorTiming((2, 10**6), 10**6, 0.002, 0.0035),
               TensorTiming((3, 10**6), 10**6, 0.003, 0.0031)]
    plan = RoundTripPlan(max_fraction=1.0)
    plan.learn(timings, link)
    assert plan.keep == {(2, 10**6), (3, 10**6)}
    capped = RoundTripPlan(max_fraction=0.25)   # room for one: the shortest gap
    capped.learn(timings, link)
    assert capped.keep == {(3, 10**6)}
    capped.learn(timings, None)              # nothing measured: keep nothing
    assert capped.keep == frozenset()


def test_plan_lives_with_the_model():
    model = nn.Linear(2, 2)
    a = plan_for(model, ("nvme",))
    assert plan_for(model, ("nvme",)) is a and plan_for(model, ("host",)) is not a
    assert plan_for(None, ("nvme",)) is None


def _gpt_step(model, idx, tgt, **kw):
    model.zero_grad(set_to_none=True)
    with offload.activations(model=model, **kw) as ctx:
        model.loss(idx, tgt).backward()
    return ctx.stats, [p.grad.clone() for p in model.parameters()]


@needs_core
def test_second_step_keeps_the_end_of_the_forward_and_stays_exact(nvme_dir, monkeypatch):
    from offload.bench.models import GPT, GPTConfig
    from offload.util.stats import Stats

    # The plan learns from the speeds the step measured; on this tiny model the disk is so
    # fast relative to the gaps that whether anything bounces depends on machine load. A
    # slow measured link (10 MB/s each way) makes the end of the forward bounce for sure.
    monkeypatch.setattr(Stats, "nvme_write_gbps", property(lambda self: 0.01))
    monkeypatch.setattr(Stats, "nvme_read_gbps", property(lambda self: 0.01))

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, hidden=64, layers=4, heads=4, seq_len=64))
    idx, tgt = model.example_batch(4)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    model.loss(idx, tgt).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    kw = dict(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0)
    torch.manual_seed(1)
    first, g1 = _gpt_step(model, idx, tgt, **kw)
    plan = plan_for(model, (("nvme",), 0))
    assert first.round_trip_kept_bytes == 0 and plan.link is not None
    assert plan.keep  # the loss's tensors are needed again at once: they bounce
    keep = set(plan.keep)   # what step 2 will use (step 2 then learns again)
    torch.manual_seed(1)
    second, g2 = _gpt_step(model, idx, tgt, **kw)
    assert all(torch.equal(a, b) for a, b in zip(ref, g1))
    assert all(torch.equal(a, b) for a, b in zip(ref, g2))
    # Kept exactly what the plan named, within its cap, as kept bytes.
    assert second.round_trip_kept_bytes == sum(n for _, n in keep)
    assert second.round_trip_kept_bytes <= 0.1 * first.nvme_bytes
    assert second.kept_bytes >= second.round_trip_kept_bytes
    assert second.nvme_bytes == first.nvme_bytes - second.round_trip_kept_bytes
    clear()
