"""The nvme tier's transfers in the core (csrc/nvme_transfers.cpp, nvme_payload.cpp): every
write and read in flight for a tier's payloads, counted once, retired oldest first, batched,
held as long as the I/O needs their memory and no longer, with no object per saved tensor
for the garbage collector to track.

Queue order and lifetimes are tested with a stand-in store whose transfers land when the
test says so (the chained calls a CUDA step makes, through Python futures); batching,
backpressure and host reads with the core's own store on a temporary directory.
"""
from __future__ import annotations

import gc
import os
import threading
import traceback
import weakref

import pytest
import torch

import offload
from offload._ext import core_available, load_core
from offload.errors import ExtensionUnavailable, UsedAfterCloseError
from offload.tiers import nvme, nvme_device
from offload.util import ranges
from offload.util.stats import Stats

pytestmark = pytest.mark.skipif(not core_available(), reason="needs the compiled core")

CPU = torch.device("cpu")


class Future:
    """A transfer that lands when the test says so; counts how often it was asked."""

    def __init__(self, end_s: float = 0.0) -> None:
        self.finished = False
        self.end_s = end_s
        self.asked = 0
        self.asked_landed = 0   # asked again once it had landed
        self.waited = 0

    def done(self) -> bool:
        self.asked += 1
        self.asked_landed += self.finished
        return self.finished

    def wait(self, timeout_s=None) -> int:
        self.waited += 1
        self.finished = True
        return 1

    def tensor_for_use(self) -> torch.Tensor:
        self.finished = True
        return torch.ones(1)


class Extent:
    def __init__(self, store, nbytes: int) -> None:
        self.store, self.nbytes = store, nbytes

    def release(self) -> None:
        self.store.used_bytes -= self.nbytes


class Store:
    """What the transfers ask of another store than the core's: allocate (the chained
    transfers come from the tier)."""

    def __init__(self, capacity_bytes: int = 1 << 20) -> None:
        self.capacity_bytes, self.used_bytes = capacity_bytes, 0

    def allocate(self, nbytes: int, phase: int = 0):
        if self.used_bytes + nbytes > self.capacity_bytes:
            return None
        self.used_bytes += nbytes
        return Extent(self, nbytes)


def transfers(store=None, arena=None, stats=None, *, cap=1 << 20, batch_bytes=1 << 30,
              write_batch=4):
    stats = stats if stats is not None else Stats()
    t = load_core().NvmeTransfers(store if store is not None else Store(), arena, 4096, cap,
                                  batch_bytes, write_batch, stats, ranges, torch.frombuffer,
                                  torch.uint8)
    return t, stats


def chained_reads(t, n: int):
    """`n` payloads, each with a chained read in flight (started at i, landing at i + 1)."""
    out = []
    for i in range(n):
        p = t.allocate(1, CPU, 0, True)
        f = Future(end_s=float(i + 1))
        t.add_chained_read(p, f)
        out.append((p, f))
    return out


def read_busy(t) -> list:
    return sorted((round(a), b) for a, b in t.take_counts()[5])


# ---------------------------------------------------------------- reads, in order
def test_poll_counts_landed_reads_oldest_first_and_stops_at_the_first_in_flight():
    t, stats = transfers()
    reads = chained_reads(t, 4)
    reads[0][1].finished = reads[2][1].finished = True
    t.poll()
    # the oldest is seen; the third landed too but waits behind the second (FIFO engine)
    assert [f.asked for _, f in reads] == [1, 1, 0, 0]
    assert not t.idle
    for _, f in reads[1:]:
        f.finished = True
    t.poll()
    written, read, peak_writes, peak_reads, _, busy = t.take_counts()
    assert peak_reads == 4 and [end for _, end in sorted(busy, key=lambda iv: iv[1])] == [
        1.0, 2.0, 3.0, 4.0]
    assert t.take_counts()[5] == []           # taken once
    assert all(p.reading for p, _ in reads)   # landed, not yet fetched
    assert t.idle                             # ... and nothing is in flight


def test_a_read_fetched_out_of_order_is_counted_once_and_keeps_nothing():
    t, _ = transfers()
    reads = chained_reads(t, 3)
    p, f = reads[2]
    ticket = weakref.ref(f)
    assert torch.equal(t.fetch(p), torch.ones(1))     # fetched first (the backward jumped)
    assert not p.reading
    del f, reads[2]
    gc.collect()
    assert ticket() is None                   # the FIFO entry left behind holds no ticket
    for _, f in reads:
        f.finished = True
    t.poll()
    assert len(t.take_counts()[5]) == 3 and t.idle


def test_polling_never_asks_a_read_already_seen():
    # The backward fetches in the order the reads were issued and polls before each fetch:
    # every poll asks only the oldest read still in flight (a queue that walked the reads it
    # had seen would cost the step time in proportion to its saved tensors).
    t, _ = transfers()
    reads = chained_reads(t, 500)
    for p, f in reads:
        t.poll()
        f.finished = True
        t.fetch(p)                            # (polls too)
    t.poll()
    assert max(f.asked_landed for _, f in reads) == 1   # seen done once, then never asked
    assert max(f.asked for _, f in reads) == 3          # the same few asks for each read
    assert t.idle


def test_a_released_payloads_chained_read_keeps_its_ticket_until_it_lands():
    t, _ = transfers()
    ((p, f),) = chained_reads(t, 1)
    ticket = weakref.ref(f)
    t.release(p)                              # released mid-read: the ticket holds memory
    assert p.released and not p.reading and not t.idle
    del f
    gc.collect()
    t.poll()
    assert ticket() is not None               # still in flight: kept
    ticket().finished = True
    t.poll()
    gc.collect()
    assert ticket() is None and t.idle


@pytest.mark.parametrize("wait", [True, False])
def test_drain_waits_for_deferred_reads_and_poll_does_not(wait):
    t, _ = transfers()
    ((p, f),) = chained_reads(t, 1)
    t.release(p)
    t.drain() if wait else t.poll()
    assert f.waited == (1 if wait else 0) and t.idle == wait


def test_a_read_released_while_the_deferred_ones_are_walked_is_not_lost():
    # A record dies (the collector) while the transfers poll their deferred reads, on the
    # same thread: its read must stay deferred until it lands.
    t, _ = transfers()
    (first, f1), (late, f2) = chained_reads(t, 2)
    t.release(first)
    asked = f1.done
    ticket = weakref.ref(f2)

    def done_and_a_release_meanwhile() -> bool:
        t.release(late)                       # released while the list is walked
        return asked()

    f1.done = done_and_a_release_meanwhile
    del f2
    t.poll()
    gc.collect()
    assert late.released and ticket() is not None and not t.idle   # deferred, not dropped
    del f1.done
    f1.finished = ticket().finished = True
    t.poll()
    gc.collect()
    assert t.idle and ticket() is None


def test_a_failed_read_raises_at_fetch_and_is_over():
    class Failing(Future):
        def tensor_for_use(self):
            raise OSError(5, "read failed")

    t, _ = transfers()
    p = t.allocate(8, CPU, 0, True)
    t.add_chained_read(p, Failing())
    with pytest.raises(OSError, match="read failed"):
        t.fetch(p)
    assert not p.reading


# ---------------------------------------------------------------- writes
def test_chained_writes_retire_oldest_first_and_a_read_waits_for_its_own():
    t, stats = transfers()
    payloads = [t.allocate(16, CPU, 0, True) for _ in range(3)]
    futures = [Future(end_s=float(i + 1)) for i in range(3)]
    tickets = [object() for _ in range(3)]
    for p, f, d2h in zip(payloads, futures, tickets):
        t.add_chained(p, f, d2h)
    assert t.pending_d2h(payloads[1]) is tickets[1] and t.writes_pending
    futures[1].finished = True
    t.poll()
    assert all(p.writing for p in payloads)   # the second landed, behind the first
    futures[0].finished = True
    t.poll()
    assert [p.writing for p in payloads] == [False, False, True]
    assert t.pending_d2h(payloads[0]) is None
    t.before_read(payloads[2])                # NOTE [Read after write]: waits for it
    assert futures[2].waited == 1 and not payloads[2].writing and not t.writes_pending
    written, _, peak_writes, _, busy, _ = t.take_counts()
    assert written == 3 and peak_writes == 3 and len(busy) == 3
    assert stats.stall_backward_s >= 0 and stats.stall_s == stats.stall_backward_s


class _FailingFuture(Future):
    """A chained (GPU) write that failed: its wait raises a Python StorageError."""

    def done(self) -> bool:
        return True

    def wait(self, timeout_s=None) -> int:
        raise offload.StorageError(5, "simulated EIO")


def test_a_failed_chained_write_is_raised_again_by_its_own_read():
    """nvme_writes.cpp NOTE [A failed write stays failed] for a write whose error is a
    Python exception (a chained write's future): raised where it is retired, then by each
    read of its payload. The second raise aborted the process (pybind11's `restore()` of a
    kept error may run once; found by a review)."""
    t, _ = transfers()
    p = t.allocate(16, CPU, 0, True)
    t.add_chained(p, _FailingFuture(), None)
    with pytest.raises(offload.StorageError, match="simulated EIO"):
        t.poll()   # another tensor's pack or unpack retires it
    assert p.write_failed
    frames = []
    for _ in range(2):
        with pytest.raises(offload.StorageError, match="simulated EIO") as raised:
            t.before_read(p)
        frames.append([f.name for f in traceback.extract_tb(raised.value.__traceback__)])
    # Each raise keeps where the write failed, and does not grow with the raises before it.
    assert frames[0] == frames[1] and frames[0][-1] == "wait", frames
    assert not t.prefetch(p)   # a read-ahead leaves it to the payload's own read


def test_backpressure_with_a_predicate_is_a_stall():
    t, stats = transfers()
    payloads = [t.allocate(16, CPU, 0, True) for _ in range(3)]
    for p in payloads:
        t.add_chained(p, Future(), None)
    t.retire_oldest(lambda: not payloads[1].writing, "wait staging space")
    assert [p.writing for p in payloads] == [False, False, True]
    assert stats.stall_forward_s > 0 and stats.stall_backward_s == 0


# ---------------------------------------------------------------- with the core's store
@pytest.fixture
def core_store(nvme_dir):
    store = load_core().NvmeStore([nvme_dir], 8 << 20, workers=2)
    yield store
    store.close()


def test_direct_writes_go_in_batches_and_a_release_submits_its_own_first(core_store):
    arena = load_core().HostArena(1 << 20, pinned=False)
    t, stats = transfers(core_store, arena, write_batch=4)
    sources = [torch.full((1024,), float(i)) for i in range(3)]
    used = [core_store.used_bytes]
    payloads = []
    for s in sources:
        payloads.append(t.store_direct(s.untyped_storage(), CPU))
        used.append(core_store.used_bytes)
    assert t.own_bytes == 3 * 4096 and used[0] < used[1] < used[2] < used[3]
    t.poll()
    assert all(p.writing for p in payloads)   # batched: nothing waits on them
    t.release(payloads[1])                    # the engine takes the batch, then the extent
    assert payloads[1].released and t.own_bytes == 2 * 4096
    t.drain()
    assert not any(p.writing for p in payloads) and t.take_counts()[0] == 3 * 4096
    assert core_store.used_bytes == used[3] - (used[2] - used[1])
    out = t.fetch(payloads[2])
    assert torch.equal(out.view(torch.float32), sources[2])
    t.abort()
    assert core_store.used_bytes == 0 and t.own_bytes == 0 and not t.live


def test_the_direct_write_cap_retires_the_oldest_as_a_forward_stall(core_store):
    t, stats = transfers(core_store, None, cap=8192, write_batch=32)
    sources = [torch.randn(1024) for _ in range(4)]
    payloads = [t.store_direct(s.untyped_storage(), CPU) for s in sources]
    assert not payloads[0].writing and not payloads[1].writing   # retired to make room
    assert payloads[3].writing
    assert stats.stall_forward_s > 0
    t.drain()
    for p, s in zip(payloads, sources):
        assert torch.equal(t.fetch(p).view(torch.float32), s)
    t.abort()


@pytest.mark.parametrize("from_arena", [True, False])
@pytest.mark.parametrize("offset, phase", [(0, 0), (64, 64), (448, 448), (100, 0)])
def test_a_host_read_has_the_payloads_phase_and_holds_its_memory(core_store, from_arena,
                                                                 offset, phase):
    # A storage that starts `offset` bytes into an aligned block: written in place at that
    # phase (one not a multiple of 64 goes through the bounce buffer whole, at phase 0).
    memory = load_core().HostArena(1 << 16, pinned=False).allocate(20_000)
    src = torch.frombuffer(memory, dtype=torch.uint8, count=10_000, offset=offset)
    src.copy_(torch.randint(0, 255, (10_000,), dtype=torch.uint8))
    arena = load_core().HostArena((1 << 16) if from_arena else 4096, pinned=False)
    t, _ = transfers(core_store, arena)
    p = t.store_direct(src.untyped_storage(), CPU)
    assert p.phase == phase
    assert t.prefetch(p) and p.reading and not t.prefetch(p)
    gc.collect()
    before = {id(o) for o in gc.get_objects()}
    buf = t.fetch(p)
    made = [o for o in gc.get_objects() if id(o) not in before]
    assert not [o for o in made if isinstance(o, memoryview)]   # no view per read
    del made
    assert buf.dtype == torch.uint8 and buf.numel() == 10_000 and buf.storage_offset() == 0
    assert buf.untyped_storage().nbytes() == 10_000
    assert buf.data_ptr() % 4096 == phase and torch.equal(buf, src)
    if from_arena:
        assert arena.used_bytes > 0           # the tensor keeps the block ...
        del buf
        gc.collect()
        assert arena.used_bytes == 0          # ... and only the tensor
    else:
        assert arena.used_bytes == 0          # the arena is too small: fresh memory
    t.abort()


def test_the_transfers_payloads_and_buffers_are_untracked_and_counted(core_store):
    alive = load_core()._nvme_records_alive
    before = alive()
    t, _ = transfers(core_store, None)
    x = torch.randn(1024)
    p = t.store_direct(x.untyped_storage(), CPU)
    assert alive() == (before[0] + 1, before[1] + 1, before[2])
    t.drain()
    assert t.prefetch(p)
    assert alive() == (before[0] + 1, before[1], before[2] + 1)
    buf = t.fetch(p)
    assert not gc.is_tracked(t) and not gc.is_tracked(p)
    t.release(p)
    del p, buf
    t.close()
    del t
    gc.collect()
    assert alive() == before


def test_a_released_payload_is_not_fetched(core_store):
    t, _ = transfers(core_store, None)
    x = torch.randn(1024)
    p = t.store_direct(x.untyped_storage(), CPU)
    t.prefetch(p)
    t.release(p)
    t.release(p)                              # idempotent
    with pytest.raises(UsedAfterCloseError, match="used after its offload.activations"):
        t.fetch(p)
    assert not t.prefetch(p)
    t.drain()
    assert t.idle and t.own_bytes == 0 and core_store.used_bytes == 0


def test_a_payload_released_while_its_prefetch_waits_for_its_write_is_not_read(nvme_dir):
    """A prefetch first retires the payload's own write, letting the GIL go while it waits;
    a record dying on another thread meanwhile released the payload, and the prefetch then
    read its freed extent: UsedAfterCloseError("Extent was released") raised into the
    backward (found by reading, in a sanitizer review). It starts nothing now."""
    store = load_core().NvmeStore([nvme_dir], 8 << 20, workers=1,
                                  throttle_bytes_per_s=20 << 20)   # 4 MiB: ~0.2 s to write
    t, _ = transfers(store, None, write_batch=1)
    try:
        x = torch.randn(1 << 20)
        p = t.store_direct(x.untyped_storage(), CPU)
        assert p.writing
        releaser = threading.Timer(0.05, t.release, (p,))
        releaser.start()
        assert not t.prefetch(p)   # waits for the write; the release lands meanwhile
        releaser.join()
        assert p.released
        with pytest.raises(UsedAfterCloseError, match="used after its offload.activations"):
            t.fetch(p)
        t.drain()
        assert t.idle and t.own_bytes == 0 and store.used_bytes == 0
    finally:
        t.abort()
        store.close()


def test_after_close_nothing_is_stored_or_read(core_store):
    t, _ = transfers(core_store, None)
    p = t.store_direct(torch.randn(64).untyped_storage(), CPU)
    t.drain()
    t.close()
    with pytest.raises(UsedAfterCloseError, match="nvme tier used after close"):
        t.store_direct(torch.randn(64).untyped_storage(), CPU)
    with pytest.raises(UsedAfterCloseError, match="nvme tier used after close"):
        t.prefetch(p)


@pytest.mark.parametrize("call, message", [
    (lambda t: t.allocate(0, CPU, 0, False), "nbytes must be > 0"),
    (lambda t: t.allocate(-1, CPU, 0, False), "nbytes must be >= 0"),
    (lambda t: t.allocate(1.5, CPU, 0, False), "nbytes must be an int, not float"),
    (lambda t: t.allocate(True, CPU, 0, False), "nbytes must be an int, not bool"),
    (lambda t: t.allocate(1, CPU, 0), r"allocate takes 4 arguments \(3 given\)"),
    (lambda t: t.fetch(object()), "a payload must be an NvmePayload, not object"),
    (lambda t: t.add_direct(t.allocate(1, CPU, 0, False), None, 0),
     "direct writes need the core's NvmeStore"),
])
def test_bad_arguments_are_refused_by_name(call, message):
    t, _ = transfers()
    with pytest.raises((TypeError, ValueError), match=message):
        call(t)


def test_what_a_payload_stands_for_does_not_change():
    t, _ = transfers()
    p = t.allocate(4096, CPU, 64, False)
    assert (p.nbytes, p.device, p.phase, p.cuda, p.resident) == (4096, CPU, 64, False, False)
    assert (p.writing, p.reading, p.released, p.reading_on_device) == (False, False, False,
                                                                       False)
    for field in ("nbytes", "extent", "device", "phase", "cuda", "released", "writing"):
        with pytest.raises(AttributeError):
            setattr(p, field, 1)
    with pytest.raises(TypeError):
        type(p)()                             # made only by the transfers


# ---------------------------------------------------------------- through the tier
def test_a_real_nvme_step_holds_only_untracked_payloads(nvme_dir):
    x = torch.randn(4096, requires_grad=True)
    (x * 2).tanh().sum().backward()
    plain, x.grad = x.grad, None
    seen = {}
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0) as ctx:
        tier = ctx.tiers["nvme"]
        y = (x * 2).tanh()            # saves its output: one stored storage
        (payload,) = tier._live
        seen["payload"], seen["writing"] = payload, payload.writing
        assert tier.prefetch(payload) and payload.reading   # a read, not yet fetched
        y.sum().backward()
    assert type(seen["payload"]) is load_core().NvmePayload and seen["writing"]
    assert not gc.is_tracked(seen["payload"])
    # The tier let go of both transfers, and of the payload once autograd dropped its save.
    assert not seen["payload"].writing and not seen["payload"].reading
    assert seen["payload"].released
    assert torch.equal(x.grad, plain)


def test_a_core_built_before_the_transfers_is_named_with_the_fix(nvme_dir, monkeypatch):
    # A stale build imports (offload stays importable) and says what to do when used.
    monkeypatch.setattr(nvme, "_NvmeTransfers", None)
    x = torch.randn(64, requires_grad=True)
    with pytest.raises(ExtensionUnavailable, match=r"predates the nvme tier.*pip install -e \."):
        with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0):
            (x * 2).tanh().sum().backward()


@pytest.mark.parametrize("phase", [0, 64, 448])
def test_phase_buffer_has_the_phase_and_keeps_its_memory(phase):
    buf = nvme_device.phase_buffer(load_core(), 10_000, phase, 4096)
    assert buf.dtype == torch.uint8 and buf.numel() == 10_000 and buf.storage_offset() == 0
    assert buf.untyped_storage().nbytes() == 10_000 and buf.data_ptr() % 4096 == phase
    buf.fill_(7)
    assert int(buf.sum()) == 7 * 10_000
    assert nvme_device.phase_buffer(load_core(), 0, phase, 4096).numel() == 0


def _fds_in(directory: str) -> int:
    """Open files of this process under `directory` (a store's slabs, unlinked at once)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(directory)
        except OSError:
            pass
    return n


def test_closing_lets_go_of_the_store_and_the_arena(nvme_dir):
    # The tier gives them back to the process's pools at close: nothing may keep them alive
    # (an arena's pages would stay resident, a store's files open).
    store = load_core().NvmeStore([nvme_dir], 8 << 20, workers=1)
    arena = load_core().HostArena(1 << 16, pinned=False)
    t, _ = transfers(store, arena)
    p = t.store_direct(torch.randn(64).untyped_storage(), CPU)
    t.drain()
    t.release(p)
    held = weakref.ref(arena), weakref.ref(store)
    assert _fds_in(os.path.realpath(nvme_dir)) > 0
    t.close()
    del arena, store
    gc.collect()
    assert held[0]() is None and held[1]() is None
    assert _fds_in(os.path.realpath(nvme_dir)) == 0   # the C++ store itself is gone too


def test_a_read_waited_for_waits_for_the_small_reads_queued_behind_it(nvme_dir, monkeypatch):
    # NOTE [Wait for the group] (csrc/nvme_reads.cpp): a disk capped at 4 MB/s serves 4 KiB
    # reads far slower than this backward uses them. A fetch that must wait sleeps once for
    # its read and the small ones queued right behind it (at most 16, 256 KiB), whose
    # fetches then find them landed: some 64 / 16 sleeps, not one per read.
    waits = []
    add_stall = Stats.add_stall

    def counted(self, seconds, backward, start_s=None, what="stall"):
        if what == "wait read":
            waits.append(seconds)
        add_stall(self, seconds, backward, start_s, what)

    monkeypatch.setattr(Stats, "add_stall", counted)

    def step():
        x = torch.arange(1024, dtype=torch.float32).requires_grad_()
        h = x * 1
        for _ in range(64):
            h = h.sin()
        h.sum().backward()
        return x.grad

    plain = step()
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0,
                             nvme_max_bw="4MB") as ctx:
        moved = step()
    assert torch.equal(moved, plain)
    assert ctx.stats.nvme_read_bytes == 64 * 4096
    assert 1 <= len(waits) <= 8, len(waits)


@pytest.mark.skipif(not core_available(), reason="the core's engine")
def test_a_failed_step_cancels_the_writes_the_engine_has_not_started(nvme_dir, monkeypatch):
    """A block that raises frees its step at once (`NvmeTransfers.abort`): the writes queued
    behind the engine's throttle are cancelled, not written first. Before, the exception came
    out only once all 8 MiB had gone to the disk at 2 MB/s (~4 s)."""
    from offload.tiers import nvme_space

    written = []
    release = nvme_space.release

    def counted(dirs, store, keep):   # what the engine wrote by the time the store closes
        written.append(store.bytes_written)
        release(dirs, store, keep)

    monkeypatch.setattr(nvme_space, "release", counted)
    x = torch.randn(256 * 1024, requires_grad=True)   # 1 MiB a saved tensor
    with pytest.raises(ValueError, match="the user's"):
        with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0,
                                 nvme_max_bw="2MB", staging_bytes="16MiB") as ctx:
            h = x * 1   # (x itself, a leaf that requires grad, stays)
            for _ in range(8):
                h = h.sin()
            assert ctx.tiers["nvme"].used_bytes == 8 * 2**20
            raise ValueError("the user's")
    # One write starts at once and the next one 0.5 s later; the rest are skipped.
    assert written and written[0] <= 2 * 2**20, written


# Run in a child process: on the old core each crashed the interpreter or corrupted its heap.
_PREFETCH_CLEARED_IN_ITS_WAIT = """
import tempfile, torch, types
from offload._ext import load_core
from offload.util import ranges
from offload.util.stats import Stats
C = load_core()
import sys
d = sys.argv[1]
store = C.NvmeStore([d], 1 << 22, workers=1, direct=False)
armed = []
def profiling():
    if armed:
        armed.clear()
        tier.cpu_reads = None
        pf.clear()                        # drops the last reference to the transfers
        print("prefetcher cleared inside nvme::fetch", flush=True)
        print("transfers held by the read:", alive())
    return False
rng = types.SimpleNamespace(profiling=profiling, span=ranges.span, WRITE=ranges.WRITE,
                            WAIT_READ=ranges.WAIT_READ)
T = C.NvmeTransfers(store, None, 4096, 1 << 22, 1 << 30, 1, Stats(), rng, torch.frombuffer,
                    torch.uint8)
tier = types.SimpleNamespace(cpu_reads=T)
storage = torch.arange(4096, dtype=torch.uint8).untyped_storage()
p = T.store_direct(storage, torch.device("cpu"))
T.drain()
pf = C.Prefetcher(1 << 30, Stats(), lambda: False, ranges.span, ranges.PREFETCH)
pf.register(tier, p)
import sys as _sys
count = _sys.getrefcount
held = [T]
def alive():   # references to the transfers beyond `held` (and the call's argument)
    return count(held[0]) - 2 > 0
del T
armed.append(1)
out = pf.fetch(tier, p)
print("no crash", out[:4].tolist())
"""

_TAKE_COUNTS_INSIDE_TAKE_COUNTS = """
import gc, torch
from offload._ext import load_core
from offload.util import ranges
from offload.util.stats import Stats
C = load_core()
class Fut:
    def done(self): return True
    def wait(self, timeout_s=None): return 1
    end_s = 1.0
class Ext:
    def release(self): pass
class PyStore:
    def allocate(self, nbytes, phase=0): return Ext()
T = C.NvmeTransfers(PyStore(), None, 4096, 1 << 20, 1 << 30, 4, Stats(), ranges,
                    torch.frombuffer, torch.uint8)
for _ in range(2):
    p = T.allocate(16, torch.device("cpu"), 0, False)
    T.add_chained(p, Fut(), None)
T.drain()
class Again:
    def __init__(self): self.me = self
    def __del__(self):
        print("nested take_counts:", len(T.take_counts()[4]), flush=True)
gc.collect()
gc.disable()
Again()                      # cyclic garbage, collected on the next collection
gc.set_threshold(1)
gc.enable()
out = T.take_counts()
print("outer take_counts:", len(out[4]))
# write_busy's end now lies before its start: the next retired write is stored there.
p = T.allocate(16, torch.device("cpu"), 0, False)
T.add_chained(p, Fut(), None)
T.drain()
print("no crash")
"""


def _child(code: str, *args: str) -> str:
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_prefetcher_cleared_while_it_reads_a_payload_keeps_the_transfers_it_reads(tmp_path):
    """Prefetcher.fetch read a CPU nvme payload through its entry's transfers after letting
    go of its lock without holding them: Python run in the read (the profiler flag, stats,
    another thread while the GIL is let go) that cleared the prefetcher freed the
    transfers' state under it (SIGSEGV; a use after free under ASan). Here the test holds
    them too (a freed state need not crash): the read must hold a reference of its own."""
    out = _child(_PREFETCH_CLEARED_IN_ITS_WAIT, str(tmp_path))
    assert "prefetcher cleared inside nvme::fetch" in out and "no crash [0, 1, 2, 3]" in out
    assert "transfers held by the read: True" in out


def test_take_counts_called_inside_take_counts_takes_nothing():
    """A collection while take_counts built its lists ran a __del__ that called it again:
    the figures were reported twice, and the outer call then erased past the lists' end
    (the next retired write was stored before their start: heap corruption)."""
    out = _child(_TAKE_COUNTS_INSIDE_TAKE_COUNTS)
    assert "nested take_counts: 0" in out and "outer take_counts: 2" in out
    assert "no crash" in out


@pytest.mark.parametrize("how", ["close", "dealloc"])
def test_closing_or_dropping_the_transfers_waits_for_a_direct_write_in_the_engine(how, tmp_path):
    """A direct write's source is held only by its write (the engine takes no owner of the
    memory it writes from): close() and the transfers' dealloc dropped it while the engine
    still wrote from it (a use after free under ASan; silent bytes from freed memory in a
    plain build). Both now wait for it: every byte is written when they return."""
    core = load_core()
    store = core.NvmeStore([str(tmp_path)], 64 << 20, workers=1, direct=False,
                           chunk_bytes=1 << 20, throttle_bytes_per_s=16 << 20)   # ~0.5 s
    transfers = core.NvmeTransfers(store, None, 4096, 1 << 30, 1 << 30, 1, Stats(), ranges,
                                   torch.frombuffer, torch.uint8)
    source = torch.ones(8 << 20, dtype=torch.uint8).untyped_storage()
    payload = transfers.store_direct(source, torch.device("cpu"))   # a batch of 1: submitted
    assert store.bytes_written < 8 << 20                            # still in the engine
    if how == "close":
        transfers.close()
    else:
        del transfers, payload
    assert store.bytes_written == 8 << 20
    store.close()
