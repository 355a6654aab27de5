"""One NVMe budget per directory for the whole process (NOTE [One budget] in
offload/tiers/nvme_space.py), on small real filesystems (loop-mounted ext4; root only).

Before: every context opened its own store of OFFLOAD_NVME_BYTES (50 % of what was *left*),
so a loop keeping each step's graph failed at step 7 of a 64 MiB disk with a raw
ValueError, and an idle store of an earlier step made a context with other settings fail
with "only 6 MiB free".
"""
from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn as nn

import offload
from offload.tiers import nvme_space
from mounts import free_bytes as _free_bytes

MiB = 1 << 20


def _stores_in(directory):
    """(store, users) of the process's stores for `directory` (other tests may hold theirs)."""
    return [v for k, v in nvme_space.open_stores().items()
            if k == (os.path.realpath(directory),)]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.Tanh(), nn.Linear(1024, 512), nn.Tanh(),
                         nn.Linear(512, 1))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(512, 512, generator=g) for _ in range(n)]


def _plain_grads(model, batches):
    model.zero_grad(set_to_none=True)
    torch.stack([model(x).sum() for x in batches]).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_graphs_kept_alive_share_one_budget(small_disk, caplog):
    """12 steps whose graphs all stay alive: ~4 MiB each to NVMe, 50 % of a 64 MiB disk."""
    offload.process.reset()   # "every tier is full" is said once per process
    model, batches = _model(), _batches(12)
    ref = _plain_grads(model, batches)
    model.zero_grad(set_to_none=True)
    losses, contexts = [], []
    with caplog.at_level(logging.WARNING, logger="offload"):
        for x in batches:
            with offload.activations(model=model, tiers="nvme", nvme_dir=small_disk,
                                     min_bytes=0) as ctx:
                losses.append(model(x).sum())
            contexts.append(ctx)
            assert len(_stores_in(small_disk)) == 1         # one store, however many steps
    assert contexts[0].stats.nvme_bytes > 0
    assert sum(c.stats.full_kept_bytes for c in contexts) > 0, "the budget never filled up"
    assert "every tier is full" in caplog.text
    torch.stack(losses).sum().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(ref, model.parameters()))
    assert all(c.tiers["nvme"].used_bytes == 0 for c in contexts)


def test_a_full_shared_budget_raises_tier_full_when_strict(small_disk):
    model, batches = _model(), _batches(12)
    losses = []
    with pytest.raises(offload.TierFullError, match="every tier is full"):
        for x in batches:
            with offload.activations(tiers="nvme", nvme_dir=small_disk, min_bytes=0,
                                     strict=True):
                losses.append(model(x).sum())


@pytest.mark.parametrize("strict", [True, False])
def test_a_graph_dropped_without_backward_gives_its_room_to_the_next_forward(nvme_dir,
                                                                          strict):
    """A skipped batch (its loss dropped: say it was NaN), then the next forward in the
    same block: only one graph is alive, but the dropped one's writes were still landing
    (a capped disk), and their requests held its space (NOTE [Full while released I/O
    lands]): the next forward's saves stayed on the device, or raised TierFullError under
    strict. (A helper's find.)"""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)],
                          nn.Linear(256, 1))
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    # One forward saves 9 x 256 KiB: 2.25 MiB of a 3 MiB tier, written at 5 MB/s: ~0.5 s,
    # so the writes still run when the next forward saves, however slow a loaded machine
    # makes the forwards (at 20 MB/s they had once landed by then, and nothing waited).
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, nvme_bytes="3MiB", min_bytes=0,
                             nvme_max_bw="5MB", strict=strict) as ctx:
        loss = model(x).sum()
        del loss
        model(x).sum().backward()
    assert ctx.stats.full_kept_bytes == 0 and ctx.stats.nvme_bytes >= 2 * 9 * 256 * 1024
    assert ctx.stats.stall_forward_s > 0   # the wait for the dropped graph's writes counts
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters()))
    offload.empty_cache()


def test_two_live_contexts_reserve_one_budget(small_disk):
    free_before = _free_bytes(small_disk)
    x = torch.randn(256, 512, requires_grad=True)
    a = offload.activations(tiers="nvme", nvme_dir=small_disk, min_bytes=0)
    b = offload.activations(tiers="nvme", nvme_dir=small_disk, min_bytes=0, io_workers=2)
    with a:
        ya = (x * 2).tanh().sum()
    with b:                                   # other settings: shares the store in use
        yb = (x * 3).tanh().sum()
    (store, users), = _stores_in(small_disk)
    assert users == 2
    reserved = free_before - _free_bytes(small_disk)
    assert reserved <= store.capacity_bytes + MiB   # one reservation, not two
    assert store.capacity_bytes <= free_before // 2 + MiB
    (ya + yb).backward()
    x_ref = x.detach().clone().requires_grad_()
    ((x_ref * 2).tanh().sum() + (x_ref * 3).tanh().sum()).backward()
    assert torch.equal(x.grad, x_ref.grad)
    assert _stores_in(small_disk)[0][1] == 0        # idle, kept for the next step


def test_a_store_in_use_says_which_settings_it_keeps(nvme_dir, caplog):
    x = torch.randn(256, 512, requires_grad=True)
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0):
        ya = (x * 2).tanh().sum()
    with caplog.at_level(logging.WARNING, logger="offload"):
        for _ in range(2):   # said once
            with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0,
                                     io_workers=2):
                yb = (x * 3).tanh().sum()
    said = [r.getMessage() for r in caplog.records if "is in use by another" in r.getMessage()]
    assert len(said) == 1, said
    assert "OFFLOAD_IO_WORKERS=4 (yours: 2)" in said[0] and "NVME_BYTES" not in said[0]
    (ya + yb).backward()


def test_two_contexts_sharing_a_store_every_step_are_told_once(nvme_dir, caplog):
    """Two contexts of other settings in every step (a model and its teacher): the store
    goes idle after each step's backward, and the warning came back at every step."""
    x = torch.randn(256, 512, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="offload"):
        for _ in range(3):
            with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0):
                ya = (x * 2).tanh().sum()
            with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0,
                                     io_workers=2):
                yb = (x * 3).tanh().sum()
            (ya + yb).backward()
    said = [r.getMessage() for r in caplog.records if "is in use by another" in r.getMessage()]
    assert len(said) == 1, said


def test_checksums_asked_for_are_never_dropped_for_a_store_in_use(nvme_dir):
    """Was: the second context shared the first's store without checksums, silently, and a
    corrupted read trained on (test_storage_errors.py's sabotage, in a shared store)."""
    x = torch.randn(256, 512, requires_grad=True)
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0):
        ya = (x * 2).tanh().sum()
    checked = offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0,
                                  nvme_checksum=True)
    with pytest.raises(offload.ConfigError, match=r"nvme_checksum / OFFLOAD_NVME_CHECKSUM asks "
                       r"for checksums, but the NVMe store of .* is in use by another context "
                       r"of this process, opened without checksums"):
        with checked:
            pass
    assert not checked.active
    (store, users), = _stores_in(nvme_dir)
    assert users == 1 and not store.checksum   # the failed entry took nothing
    ya.backward()
    del ya
    with checked:   # the store is idle now: reopened with checksums
        (x * 3).tanh().sum().backward()
    (store, users), = _stores_in(nvme_dir)
    assert store.checksum and users == 0 and checked.stats.nvme_bytes > 0
    # The other way round shares (checksums no one asked for cost time, not safety).
    with checked:
        yc = (x * 2).tanh().sum()
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0) as plain:
        yd = (x * 3).tanh().sum()
    assert plain.stats.nvme_bytes > 0
    (yc + yd).backward()


def test_an_idle_store_never_blocks_other_settings(small_disk):
    """An idle store of 50 % stays open after a step; a context asking for more than the
    rest of the disk must still open (the idle store is closed first)."""
    x = torch.randn(256, 512, requires_grad=True)
    with offload.activations(tiers="nvme", nvme_dir=small_disk, min_bytes=0) as first:
        (x * 2).tanh().sum().backward()
    assert first.stats.nvme_bytes > 0
    assert _free_bytes(small_disk) < 40 * MiB        # the idle store still holds its space
    with offload.activations(tiers="nvme", nvme_dir=small_disk, min_bytes=0,
                             nvme_bytes="40MiB") as second:
        (x * 2).tanh().sum().backward()
    assert second.stats.nvme_bytes > 0
    assert second.tiers["nvme"].capacity_bytes == 0  # closed; it had 40 MiB while open
    (store, users), = _stores_in(small_disk)
    assert store.capacity_bytes >= 40 * MiB and users == 0


@pytest.mark.parametrize("strict", [False, True])
def test_no_room_on_the_disk_is_a_full_tier_not_a_value_error(small_disk, strict, caplog):
    filler = os.path.join(small_disk, "filler")
    with open(filler, "wb") as f:               # leave less than one 1 MiB stripe
        f.truncate(0)
        os.posix_fallocate(f.fileno(), 0, max(_free_bytes(small_disk) - 512 * 1024, 0))
    try:
        x = torch.randn(256, 512, requires_grad=True)
        ctx = offload.activations(tiers="nvme", nvme_dir=small_disk, min_bytes=0,
                                  strict=strict)
        if strict:
            with pytest.raises(offload.TierFullError, match=r"\(raise OFFLOAD_NVME_BYTES, add"):
                with ctx:
                    (x * 2).tanh().sum().backward()
        else:
            from offload.runtime import storing
            storing.forget_warnings()     # said once per process: maybe by an earlier test
            with caplog.at_level(logging.WARNING, logger="offload"):
                for step in range(3):   # said once, not every step
                    x.grad = None
                    with ctx:
                        (x * 2).tanh().sum().backward()
            assert caplog.text.count("has no room") == 1, caplog.text
            assert "Raise OFFLOAD_NVME_BYTES or add a tier" in caplog.text
            assert ctx.stats.full_kept_bytes > 0 and ctx.stats.nvme_bytes == 0
            x_ref = x.detach().clone().requires_grad_()
            (x_ref * 2).tanh().sum().backward()
            assert torch.equal(x.grad, x_ref.grad)
    finally:
        os.unlink(filler)


def test_a_percentage_store_measures_again_when_the_space_went_meanwhile(small_disk):
    """Two processes sized 70% of one disk's free space from the same reading: the second
    one's reservation failed with ENOSPC on its first step. A percentage is measured again
    once (an absolute size is not: it was checked against the disk when the context was
    built)."""
    from offload._ext import load_core
    from offload.util.sizes import SizeSpec
    readings = iter([256 << 20, 16 << 20])   # the first read before someone took the space
    store = nvme_space.acquire_sized((small_disk,), lambda: next(readings), load_core(),
                                     workers=1, checksum=False, max_bytes_per_s=0,
                                     capacity_key=SizeSpec(fraction=0.7))
    try:
        assert store.capacity_bytes == 16 << 20
    finally:
        nvme_space.release((small_disk,), store, keep=False)
    readings = iter([256 << 20, 16 << 20])
    with pytest.raises(OSError) as err:
        nvme_space.acquire_sized((small_disk,), lambda: next(readings), load_core(),
                                 workers=1, checksum=False, max_bytes_per_s=0,
                                 capacity_key=SizeSpec(nbytes=256 << 20))
    assert err.value.errno == 28
    assert os.listdir(small_disk) == ["lost+found"]
