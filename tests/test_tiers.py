"""Tier internals that the end-to-end tests cannot reach on a CPU-only machine."""
from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

from offload.util.stats import Stats
from offload.tiers import host as host_mod
from offload.tiers import pool

try:
    from offload._ext import load_core

    CORE = load_core()
except Exception as exc:  # pragma: no cover - depends on the build
    CORE, REASON = None, str(exc)


@pytest.fixture
def fake_pinned(monkeypatch):
    """Pinned arenas without a GPU: the real arena, unpinned, behind the same call."""
    if CORE is None:
        pytest.skip(REASON)

    class Core:
        @staticmethod
        def HostArena(capacity, pinned=None):
            assert pinned is True
            return CORE.HostArena(capacity, pinned=False)

    import offload._ext

    monkeypatch.setattr(offload._ext, "load_core", lambda: Core)
    monkeypatch.setattr(host_mod, "PINNED_CHUNK_BYTES", 1 << 20)
    pool.clear()
    yield
    pool.clear()


def test_pinned_memory_grows_in_chunks_up_to_capacity(fake_pinned):
    mib = 1 << 20
    tier = host_mod.HostTier(int(2.5 * mib), Stats(), capacity_key="t")
    views = [tier._allocate_pinned(400 << 10) for _ in range(5)]
    assert all(v is not None and v.numel() == 400 << 10 for v in views)
    # Two 400 KiB blocks per 1 MiB chunk; the last chunk is what the capacity leaves.
    assert [a.capacity_bytes for a in tier._arenas] == [mib, mib, mib // 2]
    assert tier._allocate_pinned(400 << 10) is None         # over the capacity: spill
    del views
    arenas = tier._arenas
    tier.close()
    assert pool.take("host-pinned", "t", list) is arenas    # clean: kept for the next step
    # (Closed first: a tier open at the same time would share the 2.5 MiB budget.)
    big_tier = host_mod.HostTier(8 * mib, Stats(), capacity_key="big")
    big = big_tier._allocate_pinned(3 * mib)                 # larger than a chunk: own chunk
    assert big is not None and big_tier._arenas[0].capacity_bytes == 3 * mib
    del big
    big_tier.close()


def test_pinned_arenas_in_use_are_not_pooled(fake_pinned):
    tier = host_mod.HostTier(4 << 20, Stats(), capacity_key="u")
    held = tier._allocate_pinned(4096)
    tier.close()
    assert pool.take("host-pinned", "u", list) == []       # not given back: a fresh list
    del held


def test_pool_one_slot_per_kind_evicts_and_closes():
    closed = []

    class Res:
        def __init__(self, name):
            self.name = name

        def close(self):
            closed.append(self.name)

    pool.clear()
    a, b = Res("a"), Res("b")
    pool.give_back("k", 1, a)
    assert pool.take("k", 2, lambda: Res("new")).name == "new"   # other key: not taken
    pool.give_back("k", 2, b)                                    # evicts a
    assert closed == ["a"]
    assert pool.take("k", 2, lambda: None) is b
    pool.clear()
    assert closed == ["a"]                                       # b was checked out


@pytest.fixture(autouse=True)
def own_host_budget(monkeypatch):
    """Each test's host tiers count into a budget of their own, whatever an earlier test of
    this process left alive (tiers/host_budget.py NOTE [One host budget])."""
    from offload.tiers import host_budget

    monkeypatch.setattr(host_budget, "_budget", None)
    monkeypatch.setattr(host_budget, "_told", set())


@pytest.fixture(params=["core", "python"])
def ref_payload(request, monkeypatch):
    """The host tier's CPU payload: the core's StorageRef, or the Python one it stands for."""
    if request.param == "core":
        if CORE is None:
            pytest.skip(REASON)
        assert host_mod._RefPayload is CORE.StorageRef
    else:
        monkeypatch.setattr(host_mod, "_RefPayload", host_mod._PyStorageRef)
        monkeypatch.setattr(host_mod, "_HostLedger", host_mod._PyHostLedger)
    return request.param


def test_host_tier_on_cpu_holds_references_and_counts_capacity(ref_payload):
    stats = Stats()
    tier = host_mod.HostTier(1000, stats)
    storage = torch.arange(600, dtype=torch.uint8).untyped_storage()
    p = tier.store(storage, storage.device)
    assert p is not None and p.resident and tier.used_bytes == 600
    assert (p.nbytes, p.device, p.storage is storage) == (600, storage.device, True)
    # The core's is an object the garbage collector never walks (one per stored storage).
    assert gc.is_tracked(p) is (ref_payload == "python")
    assert tier.fetch(p).data_ptr() == storage.data_ptr()           # a reference, no copy
    full = torch.zeros(600, dtype=torch.uint8).untyped_storage()
    assert tier.store(full, full.device) is None                    # full: spill
    tier.release(p)
    tier.release(p)                                                  # idempotent
    assert tier.used_bytes == 0 and tier.released(p)
    with pytest.raises(RuntimeError, match="after release"):
        tier.fetch(p)


def test_the_host_ledger_counts_refs_and_pinned_copies_against_one_capacity(ref_payload):
    ledger = host_mod._HostLedger(1000)
    storage = torch.zeros(600, dtype=torch.uint8).untyped_storage()
    assert ledger.take(500) and ledger.used_bytes == 500           # a pinned copy's bytes
    assert ledger.store(storage, storage.device) is None            # 500 + 600 > 1000
    assert not ledger.take(501) and ledger.used_bytes == 500
    ledger.give(500)
    ref = ledger.store(storage, storage.device)
    assert type(ref) is host_mod._RefPayload and ref.storage is storage and len(ledger) == 1
    assert ledger.used_bytes == 600 and ledger.capacity_bytes == 1000
    with pytest.raises(ValueError, match="give"):
        ledger.give(601)                                             # more than counted
    with pytest.raises(ValueError, match="nbytes"):
        ledger.take(-1)
    ledger.release(ref)
    ledger.release(ref)                                              # once
    assert ledger.used_bytes == 0 and len(ledger) == 0 and ref.storage is None
    # At the ends of the range: the sum overflowed (UB) and said yes (a sanitizer run).
    huge = host_mod._HostLedger(2**63 - 1)
    assert huge.take(1) and not huge.take(2**63 - 1) and huge.used_bytes == 1


def test_ledgers_of_one_budget_share_its_capacity(ref_payload):
    """NOTE [One host budget]: each tier's ledger counts its own bytes, and into the budget,
    whose capacity they fit into together."""
    budget = host_mod._HostLedger(1000)
    a = host_mod._HostLedger(1000, budget=budget)
    b = host_mod._HostLedger(5000, budget=budget)    # the budget's capacity is what counts
    assert a.budget is budget and b.capacity_bytes == 1000 and budget.ledgers == 2
    storage = torch.zeros(600, dtype=torch.uint8).untyped_storage()
    ref = a.store(storage, storage.device)
    assert ref is not None and (a.used_bytes, b.used_bytes, budget.used_bytes) == (600, 0, 600)
    assert b.store(storage, storage.device) is None                 # 600 + 600 > 1000
    assert not b.take(401) and b.take(400) and budget.used_bytes == 1000
    b.give(400)
    a.release(ref)
    assert (a.used_bytes, budget.used_bytes) == (0, 0)
    assert a.take(300) and budget.used_bytes == 300
    a.detach()                                        # its tier closed: out of the budget
    assert a.budget is None and a.used_bytes == 300 and budget.used_bytes == 0
    a.detach()                                        # once
    assert budget.ledgers == 1
    assert b.take(1000)
    del b   # dropped without a detach: what it counted leaves the budget with it
    gc.collect()
    assert budget.used_bytes == 0 and budget.ledgers == 0
    if ref_payload == "core":
        with pytest.raises(TypeError, match="has no budget of its own"):
            host_mod._HostLedger(10, budget=a.__class__(10, budget=budget))


def test_host_tiers_alive_at_once_share_one_capacity(ref_payload, caplog):
    """Was: each step's host tier had the whole OFFLOAD_HOST_BYTES, so graphs kept alive
    across steps held a multiple of it ("a size is per process", README)."""
    one, two = Stats(), Stats()
    first = host_mod.HostTier(1000, one)
    with caplog.at_level(logging.WARNING, logger="offload"):
        second = host_mod.HostTier(2000, two)    # shares the budget in use: 1000
    assert "host tier's budget is in use by another step" in caplog.text
    assert second.capacity_bytes == 1000
    s = [torch.zeros(400, dtype=torch.uint8).untyped_storage() for _ in range(3)]
    p0, p1 = first.store(s[0], s[0].device), second.store(s[1], s[1].device)
    assert p0 is not None and p1 is not None
    assert second.store(s[2], s[2].device) is None                  # 1200 > 1000
    assert "host 800 B of 1000 B used, 400 B of it by this step" in second.usage_text()
    first.close()                 # its 400 B leave the budget with it (abort or not)
    assert second.store(s[2], s[2].device) is not None
    second.release(p1)
    second.close()
    third = host_mod.HostTier(2000, Stats())   # none in use: a budget of its own size
    assert third.capacity_bytes == 2000 and third.used_bytes == 0
    del third   # dropped without close (a tier built by hand): the budget is free again
    gc.collect()
    fourth = host_mod.HostTier(500, Stats())
    assert fourth.capacity_bytes == 500
    fourth.close()


def test_one_setting_shares_the_budget_silently(ref_payload, caplog):
    """A percentage of the RAM available now resolves to other bytes from step to step: the
    same OFFLOAD_HOST_BYTES is one budget, and no warning (the review of 2026-12-06 saw one
    per step)."""
    from offload.util.sizes import SizeSpec

    half = SizeSpec(fraction=0.5)
    with caplog.at_level(logging.WARNING, logger="offload"):
        first = host_mod.HostTier(1000, Stats(), capacity_key=half, capacity_source="50% of A")
        second = host_mod.HostTier(1010, Stats(), capacity_key=half, capacity_source="50% of B")
    assert caplog.text == ""
    assert second.capacity_bytes == 1000 and second.capacity_source == "50% of A"
    first.close()
    second.close()
    third = host_mod.HostTier(1010, Stats(), capacity_key=half, capacity_source="50% of B")
    assert third.capacity_bytes == 1010 and third.capacity_source == "50% of B"   # idle: anew
    third.close()


def test_abort_frees_every_payload_at_once(ref_payload):
    tier = host_mod.HostTier(1000, Stats())
    storages = [torch.zeros(100, dtype=torch.uint8).untyped_storage() for _ in range(3)]
    ps = [tier.store(s, s.device) for s in storages]
    assert tier.used_bytes == 300
    tier.abort()
    assert tier.used_bytes == 0 and all(tier.released(p) for p in ps)
    assert all(p.storage is None for p in ps)                        # the bytes let go
    with pytest.raises(RuntimeError, match="after release"):
        tier.fetch(ps[0])


@pytest.mark.skipif(CORE is None, reason="needs the compiled core")
def test_the_cores_storage_ref_is_made_by_position_and_can_be_weakly_referenced():
    storage = torch.zeros(8, dtype=torch.uint8).untyped_storage()
    ref = CORE.StorageRef(storage, 8, storage.device)
    assert CORE.StorageRef.resident and ref.resident
    alive = weakref.ref(ref)
    for wrong in ((storage, 8), (storage, "8", storage.device)):
        with pytest.raises(TypeError):
            CORE.StorageRef(*wrong)
    with pytest.raises(TypeError, match="by position"):
        CORE.StorageRef(storage, 8, device=storage.device)
    with pytest.raises(AttributeError):
        ref.nbytes = 4                                               # only `storage` is set
    del ref
    assert alive() is None


def test_on_cuda_tells_devices_apart_without_a_gpu():
    from offload.tiers.base import on_cuda

    for _ in range(2):   # the second time from what it remembered
        assert not on_cuda(torch.device("cpu")) and not on_cuda(torch.device("meta"))
        assert on_cuda(torch.device("cuda", 0)) and on_cuda(torch.device("cuda"))


def test_a_host_tier_whose_store_is_overridden_is_stored_through_it():
    # The core's packer stores through `store_cpu`: a subclass with its own `store` (a
    # stand-in, a copying tier) must not be gone around.
    class OwnStore(host_mod.HostTier):
        def store(self, storage, device):
            return super().store(storage, device)

    assert OwnStore(1000, Stats()).store_cpu is None
    plain = host_mod.HostTier(1000, Stats())
    assert (plain.store_cpu is not None) is (CORE is not None)
