"""The NVMe tier's GPU path end to end, on the simulated GPU of tests/sim_gpu.py (CPU only).

NvmeTier runs its real code for CUDA sources: D2H into a pinned staging block on the
offload stream, the write chained after the copy's event (nvme_device.write_after_d2h),
read → H2D chained on the prefetch stream (nvme_device.read_then_h2d), the consumer's stream
waiting on the H2D. The device, its streams and the store's engine are simulated; the tier
sees "CUDA" tensors (a tensor subclass reporting a CUDA device, whose bytes live in the
simulated device memory). Every interleaving the simulator picks must give back the bytes
the producer kernels wrote, and leave nothing held.
"""
from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest
import torch

import offload
from offload._ext import load_core
from offload.tiers.copies import CopyStreams
from offload.util.stats import Stats
from offload.tiers.nvme import NvmeTier
from sim_gpu import SimArena, SimFuture, SimGpu, SimStore

CUDA = torch.device("cuda", 0)


class _CudaLabel(torch.Tensor):
    """A simulated device tensor: its bytes are in SimGpu's memory, its device says CUDA."""

    @property
    def device(self):
        return CUDA


def _flat_of_simulated(storage: torch.UntypedStorage) -> torch.Tensor:
    """tiers.base.flat_bytes for the simulated device: the bytes, labelled CUDA (the tier
    hands them to CopyStreams, which checks the device)."""
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    return torch.Tensor._make_subclass(_CudaLabel, flat)


@pytest.fixture(autouse=True)
def _simulated_flat_bytes(monkeypatch):
    from offload.tiers import nvme_device

    monkeypatch.setattr(nvme_device, "flat_bytes", _flat_of_simulated)


def _own_storage(t: torch.Tensor) -> torch.UntypedStorage:
    """A storage of just `t`'s bytes in the simulated device memory (the runtime hands tiers
    storages; a simulated block is a slice of one big buffer). It keeps `t`, and so the
    simulator's block, alive as long as it lives."""
    buffer = (ctypes.c_uint8 * t.numel()).from_address(t.data_ptr())
    buffer.sim_block = t
    return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()


class _Sim(SimGpu):
    def device(self, device):
        return CUDA


class _Future(SimFuture):
    """Waiting drives the engine, as a blocking wait on a real IoFuture would."""

    def __init__(self, store):
        super().__init__()
        self._store = store

    def wait(self, timeout_s=None):
        while not self.done():
            self._store.progress()
        return super().wait(timeout_s)


class _Extent:
    def __init__(self, store, nbytes):
        self.store, self.nbytes = store, nbytes

    def release(self):
        self.store.used_bytes -= self.nbytes
        self.store.data.pop(self, None)


class _Store(SimStore):
    """SimStore plus what NvmeTier asks of a store (allocation, budget, bookkeeping)."""

    alignment = 4096
    bytes_bounced = 0

    def __init__(self, sim, capacity_bytes):
        super().__init__(sim)
        self.capacity_bytes, self.used_bytes, self.paths, self.closed = capacity_bytes, 0, [], False

    def allocate(self, nbytes, phase=0):
        if self.used_bytes + nbytes > self.capacity_bytes:
            return None
        self.used_bytes += nbytes
        return _Extent(self, nbytes)

    def read_then_h2d(self, extent, block, dst_ptr, nbytes, stream, event):
        fut = _Future(self)
        self.jobs.append(("read", extent, block, dst_ptr, nbytes, stream, event, fut))
        return fut

    def write_after_event(self, extent, block, event):
        fut = _Future(self)
        self.jobs.append(("write", extent, block, event, fut))
        return fut

    def close(self):
        self.closed = True


class _StagingArena(SimArena):
    def __init__(self, sim, capacity):
        super().__init__(sim, capacity)
        self.capacity_bytes, self.used_bytes, self.peak_bytes = capacity, 0, 0

    def reset_peak(self):
        self.peak_bytes = 0


class _Core:
    """The parts of offload._C the tier uses: a CUDA build whose store and arena are simulated."""

    cuda_compiled = True

    def __init__(self, sim):
        self.sim, self.store = sim, None
        self.DEFAULT_ALIGNMENT = load_core().DEFAULT_ALIGNMENT

    def NvmeStore(self, dirs, capacity, **kwargs):
        self.store = _Store(self.sim, capacity)
        return self.store

    def HostArena(self, capacity, pinned=None):
        return _StagingArena(self.sim, capacity)


def _pattern(i):
    return 1 + (i * 53) % 250


def run_step(seed, nvme_dir, n_tensors=16, sizes=(64, 96, 160), prefetch_depth=3):
    offload.empty_cache()   # no store or arena of another simulated device from the pool
    sim = _Sim(seed)
    core = _Core(sim)
    copies = CopyStreams(CUDA, _backend=sim)
    stats = Stats()
    tier = NvmeTier((nvme_dir,), lambda: 1 << 20, workers=1, staging_bytes=1 << 18,
                    stats=stats, core=core, capacity_key=("sim", seed),
                    copies=lambda device: copies)
    rng = random.Random(seed + 7)
    saved = []
    for i in range(n_tensors):
        n = rng.choice(sizes)
        x = sim.empty(n, None, sim.compute)
        sim.fill(x, _pattern(i))                    # the producing kernel, still queued
        payload = tier.store(_own_storage(x), CUDA)
        assert payload is not None
        del x                                       # autograd keeps only the payload
        scratch = sim.empty(n, None, sim.compute)
        sim.fill(scratch, 0xEE)                     # later compute reuses freed blocks
        del scratch
        saved.append((payload, n, i))
        sim.run_some()
        if rng.random() < 0.3 and core.store.jobs:
            core.store.progress()                   # the engine runs when it likes
    results = []
    ahead = []
    while saved or ahead:
        while saved and len(ahead) < prefetch_depth:
            payload, n, i = saved.pop()
            tier.prefetch(payload)
            ahead.append((payload, n, i))
        payload, n, i = ahead.pop(0)
        t = tier.fetch(payload)                     # the consumer stream waits on the H2D
        out: list = []
        sim.read(t, out)                            # the backward kernel
        del t
        tier.release(payload)
        results.append((bytes([_pattern(i)]) * n, out))
        sim.run_some()
    tier.drain()
    tier.close()
    copies.close()
    sim.finish()
    assert tier.used_bytes == 0 and core.store.used_bytes == 0 and not core.store.jobs
    return [(want, got[0]) for want, got in results], stats


@pytest.fixture(autouse=True)
def _no_pooled_sim_resources():
    yield
    offload.empty_cache()   # the simulated store and arena must not serve a real step


@pytest.mark.parametrize("seed", range(12))
def test_nvme_tier_gpu_path_is_exact_in_every_interleaving(seed, nvme_dir):
    results, stats = run_step(seed, nvme_dir)
    assert all(want == got for want, got in results)
    assert stats.nvme_written_bytes == sum(len(w) for w, _ in results)
    assert stats.nvme_read_bytes + 0 <= stats.nvme_written_bytes


def test_without_the_chained_event_wait_the_write_takes_stale_bytes(nvme_dir, monkeypatch):
    """The simulated engine must be able to catch a write that does not wait for its D2H:
    with the event wait removed, some seed writes the block before the copy filled it."""
    real = _Store.write_after_event

    def no_wait(self, extent, block, event):
        fut = real(self, extent, block, event)
        self.jobs[-1] = ("write", extent, block, None, fut)
        return fut

    def progress(self, fail=False):
        job = self.jobs[0]
        if job[0] == "write" and job[3] is None:
            self.jobs.popleft()
            self.data[job[1]] = bytes(job[2])
            job[4].set(len(job[2]))
            return
        SimStore.progress(self, fail)

    monkeypatch.setattr(_Store, "write_after_event", no_wait)
    monkeypatch.setattr(_Store, "progress", progress)
    wrong = [seed for seed in range(12)
             if not all(w == g for w, g in run_step(seed, nvme_dir)[0])]
    assert wrong, "no interleaving exposed the missing event wait"


class _ReleasedWhileWaiting:
    """The tier's transfers, but `before_read` (which lets the GIL go while it waits for the
    payload's write) ends with the payload released, as a record dying on another thread
    meanwhile would."""

    def __init__(self, transfers, tier):
        self._transfers, self._tier = transfers, tier

    def __getattr__(self, name):
        return getattr(self._transfers, name)

    def before_read(self, payload):
        self._transfers.before_read(payload)
        self._tier.release(payload)


def _tier_with_one_payload(nvme_dir, name: str, store_type=_Store):
    """A tier on the simulated GPU (its store a `store_type`) holding one stored payload:
    (sim, core, copies, tier, payload)."""
    offload.empty_cache()
    sim = _Sim(0)
    core = _Core(sim)
    core.NvmeStore = lambda dirs, capacity, **kw: setattr(
        core, "store", store_type(sim, capacity)) or core.store
    copies = CopyStreams(CUDA, _backend=sim)
    tier = NvmeTier((nvme_dir,), lambda: 1 << 20, workers=1, staging_bytes=1 << 18,
                    stats=Stats(), core=core, capacity_key=("sim", name),
                    copies=lambda device: copies)
    x = sim.empty(64, None, sim.compute)
    sim.fill(x, 7)
    payload = tier.store(_own_storage(x), CUDA)
    return sim, core, copies, tier, payload


def test_a_payload_released_while_its_write_is_waited_for_starts_no_read(nvme_dir):
    """`DevicePaths._start_read` did not look again after `before_read`: it chained a read of the
    released payload's extent (on the core's store, "Extent was released" raised in an
    unrelated prefetch). Found by a code review; the core's host reads check it."""
    sim, core, copies, tier, payload = _tier_with_one_payload(nvme_dir, "released")
    paths = tier._device   # the tier's CUDA payloads (nvme_device.py)
    paths._transfers = _ReleasedWhileWaiting(paths._transfers, tier)
    assert tier.prefetch(payload) is False
    assert not payload.reading
    with pytest.raises(offload.UsedAfterCloseError):
        tier.fetch(payload)
    paths._transfers = paths._transfers._transfers
    tier.drain()
    tier.close()
    copies.close()
    sim.finish()
    assert tier.used_bytes == 0 and core.store.used_bytes == 0 and not core.store.jobs


class _FailedWriteStore(_Store):
    def write_after_event(self, extent, block, event):
        fut = super().write_after_event(extent, block, event)
        self.jobs.pop()   # never runs: it failed

        def failed(timeout_s=None):
            raise offload.StorageError(5, "simulated EIO")

        fut.wait, fut.done = failed, lambda: True
        return fut


def test_a_failed_write_is_left_to_its_own_read_not_a_read_ahead(nvme_dir):
    """nvme_writes.cpp NOTE [A failed write stays failed]: a read-ahead of a CUDA payload
    whose write failed raised that error in whatever unpack asked for the read-ahead; now
    it starts nothing, and the payload's own fetch raises it (found by a review)."""
    sim, _, copies, tier, payload = _tier_with_one_payload(nvme_dir, "failed", _FailedWriteStore)
    sim.run_some()
    with pytest.raises(offload.StorageError, match="simulated EIO"):
        tier.poll()   # retired where another tensor's pack or unpack polls
    assert tier.prefetch(payload) is False
    with pytest.raises(offload.StorageError, match="simulated EIO"):
        tier.fetch(payload)
    tier.release(payload)
    tier.close(reuse=False)
    copies.close()
    sim.finish()
