"""The prefetcher's order and budget, with fake payloads (no I/O), and tensor_meta pieces."""
from __future__ import annotations

import pytest
import torch

from offload._ext import core_attr
from offload.runtime.prefetch import Prefetcher
from offload.util.ranges import PREFETCH, profiling, span
from offload.util.stats import BusyClock, Stats
from offload.runtime.tensor_meta import ParamStorages, rebuild, view_meta
from offload.tiers.base import Payload


class FakePayload(Payload):
    __slots__ = ("log", "_started", "_released", "name")

    def __init__(self, name: int, nbytes: int, log: list):
        super().__init__(nbytes, torch.device("cpu"))
        self.name, self.log, self._started, self._released = name, log, False, False

    @property
    def prefetched(self):
        return self._started

    @property
    def released(self):
        return self._released

    def prefetch(self):
        # A tier's contract (tiers/base.py): nothing started for a load in flight or done,
        # or for a released payload.
        if self._started or self._released:
            return False
        self.log.append(("load", self.name))
        self._started = True
        return True

    def fetch(self):
        if not self._started:
            raise AssertionError("fetch before prefetch")
        self._started = False
        self.log.append(("use", self.name))
        return torch.zeros(self.nbytes, dtype=torch.uint8)

    def release(self):
        self._released = True


class FakeTier:
    """Hands the prefetcher's calls to the fake payloads' own (a tier owns them in the
    runtime: tiers/base.py NOTE [One owner])."""

    def prefetched(self, p):
        return p.prefetched

    def released(self, p):
        return p.released

    def prefetch(self, p):
        return p.prefetch()

    def fetch(self, p):
        return p.fetch()


TIER = FakeTier()

_CorePrefetcher = core_attr("Prefetcher")
_made = {"python": lambda budget, stats: Prefetcher(budget, stats),
         "core": lambda budget, stats: _CorePrefetcher(budget, stats, profiling, span, PREFETCH)}


@pytest.fixture(params=["python", "core"], autouse=True)
def prefetcher_kind(request, monkeypatch):
    """Every order test runs against both prefetchers (the core's: csrc/prefetcher.cpp)."""
    if request.param == "core" and _CorePrefetcher is None:
        pytest.skip("the core's prefetcher")
    monkeypatch.setitem(_made, "now", _made[request.param])
    return request.param


def make(n: int, nbytes: int, budget: int):
    log: list = []
    stats = Stats()
    pf = _made["now"](budget, stats)
    payloads = [FakePayload(i, nbytes, log) for i in range(n)]
    for p in payloads:
        pf.register(TIER, p)
    return pf, payloads, log, stats


def test_reverse_order_reads_ahead_within_budget():
    pf, ps, log, stats = make(8, 100, budget=250)
    for p in reversed(ps):
        pf.fetch(TIER, p)
        inflight = sum(1 for q in ps if q.prefetched)
        assert inflight * 100 <= 300  # budget, plus at most the one that crossed it
    loads = [name for kind, name in log if kind == "load"]
    assert loads == list(reversed(range(8)))          # each loaded once, in reverse order
    assert stats.prefetch_misses == 1 and stats.prefetch_hits == 7
    # The first fetch queued read-ahead behind its own load before waiting for it.
    assert log[:4] == [("load", 7), ("load", 6), ("load", 5), ("load", 4)]
    assert stats.peak_prefetch_bytes <= 300


def test_budget_smaller_than_one_payload_still_reads_ahead_one():
    pf, ps, log, _ = make(4, 1000, budget=10)
    pf.fetch(TIER, ps[3])
    assert ps[2].prefetched and not ps[1].prefetched


def test_out_of_order_fetch_jumps_the_cursor_and_loads_on_demand():
    pf, ps, log, stats = make(10, 100, budget=200)
    pf.fetch(TIER, ps[9])                 # own load, read-ahead 8, 7 (budget full)
    pf.fetch(TIER, ps[3])                 # backward jumped: own load; the cursor moves below 3
    assert not ps[2].prefetched     # ... but 8 and 7 still hold the budget
    pf.fetch(TIER, ps[8])                 # a hit; frees budget: read-ahead continues at 2
    assert ps[2].prefetched and not ps[6].prefetched
    pf.fetch(TIER, ps[7])
    assert ps[1].prefetched
    pf.fetch(TIER, ps[5])                 # skipped by the cursor: loaded on demand (a miss)
    assert stats.prefetch_misses == 3 and stats.prefetch_hits == 2
    assert [n for kind, n in log if kind == "use"] == [9, 3, 8, 7, 5]


def test_released_payloads_are_skipped_and_stop_counting():
    pf, ps, log, _ = make(6, 100, budget=200)
    ps[4].release()
    pf.fetch(TIER, ps[5])
    assert not ps[4].prefetched and ps[3].prefetched and ps[2].prefetched
    ps[3].release()
    ps[3]._started = False          # a released payload no longer holds read memory
    pf.fetch(TIER, ps[2])
    assert ps[1].prefetched and pf.inflight_bytes == 200   # 3 is still counted ...
    pf._prune()
    assert pf.inflight_bytes == 100                        # ... until the next prune


def test_busy_clock_counts_overlap_once():
    clock = BusyClock()
    clock.add_interval(0.0, 1.0)
    clock.add_interval(0.5, 1.5)
    clock.add_interval(3.0, 4.0)
    assert clock.busy_s == pytest.approx(2.5)
    assert BusyClock().busy_s == 0.0


def test_rebuild_shares_the_storage_and_layout():
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    view = base.transpose(0, 2)[1:, :, 1]
    flat = torch.empty(0, dtype=torch.uint8).set_(base.untyped_storage())
    copy = flat.clone()
    out = rebuild(copy.untyped_storage(), 0, view_meta(view))
    assert torch.equal(out, view) and out.stride() == view.stride()
    # A non-zero byte offset into a larger buffer (the aligned read buffer case).
    big = torch.zeros(4096 + copy.numel(), dtype=torch.uint8)
    big[4096:] = copy
    out2 = rebuild(big.untyped_storage(), 4096, view_meta(view))
    assert torch.equal(out2, view)
    with pytest.raises(ValueError, match="not a multiple"):
        rebuild(big.untyped_storage(), 3, view_meta(view))


def test_param_storages_recognise_params_buffers_and_views():
    lin = torch.nn.Linear(4, 4)
    bn = torch.nn.BatchNorm1d(4)
    params = ParamStorages()
    rm = bn.running_mean
    assert not params.is_param(rm, rm.untyped_storage())       # a buffer looks like data...
    params.add_module(bn)
    assert params.is_param(rm, rm.untyped_storage())           # ...until model= names it
    w = lin.weight.t()
    assert params.is_param(w, w.untyped_storage())             # view of a leaf needing grad
    act = lin(torch.randn(2, 4))
    assert not params.is_param(act, act.untyped_storage())
