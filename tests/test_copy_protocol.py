"""CopyStreams' stream protocol, on the simulated GPU of tests/sim_gpu.py (CPU only).

Each numbered Note of offload/tiers/copies.py has a test that removes its sync and shows the
scenario then yields wrong bytes for some seed, while the intact code is exact for all
seeds. The simulator's random interleavings are seeded: every run is the same.
"""
from __future__ import annotations

import gc
import logging
import random
import threading
import types
import weakref
from collections import deque

import pytest
import torch

from offload.tiers import copies as cuda_streams
from offload.tiers.copies import CopyStreams, GraphCaptureError
from offload.tiers.base import sync_d2h, sync_h2d
from offload.tiers.nvme_device import read_then_h2d, write_after_d2h
from offload.util.trace import TraceRecorder
from sim_gpu import CAPTURE_REFUSED, SimAllocator, SimArena, SimGpu, SimStore

SEEDS = range(40)


# --------------------------------------------------------------------------- scenario
def _pattern(i):
    return 1 + (i * 37) % 250


def run_step(seed, n_tensors=24, sizes=(16, 32, 48), prefetch_depth=3, copies_kwargs=None,
             distinct=False):
    """A forward that offloads many small tensors and a backward that reloads them.

    Every hazard the Notes guard against is provoked: the producer kernel is still queued
    when the copy is issued (1), the source is dropped and its block reused by compute (2),
    reloads start before their D2H may have run (5), the reloaded tensor is dropped while a
    compute read is queued and the next reload reuses its block (6), the compute read is
    queued right away (7). (For Note 8 see `run_block_reuse`: here the stream order
    around a reused block makes that race too rare to show.)

    With `distinct`, tensor i has size sizes[i] (give each its own), else a random choice.

    Returns:
        list of (expected bytes, bytes the compute stream read) per tensor.
    """
    sim = SimGpu(seed)
    arena = SimArena(sim)
    copies = CopyStreams(_backend=sim, **(copies_kwargs or {}))
    rng = random.Random(seed + 1000)
    saved = []
    for i in range(n_tensors):
        n = sizes[i] if distinct else rng.choice(sizes)
        x = sim.empty(n, None, sim.compute)
        sim.fill(x, _pattern(i))                # the producing kernel, still queued
        block = arena.allocate(n)
        ticket = copies.offload(x, block)
        del x                                   # autograd keeps only our handle
        scratch = sim.empty(n, None, sim.compute)
        sim.fill(scratch, 0xEE)                 # later compute reuses freed blocks
        del scratch
        saved.append((ticket, block, n, i))
        sim.run_some()
    results = []
    prefetched = deque()

    def prefetch():                             # the prefetcher runs ahead of backward
        ticket, block, n, i = saved.pop()
        prefetched.append((copies.reload(block, n, after=ticket), n, i))
        # ... and the runtime lets go of the block (and ticket) at once: Note 8's business.
        del ticket, block
        z = sim.empty(n, None, sim.compute)
        sim.fill(z, 0xDD)
        copies.offload(z, arena.allocate(n))    # another D2H wants pinned memory now

    while saved or prefetched:
        while saved and len(prefetched) < prefetch_depth:
            prefetch()
        reload, n, i = prefetched.popleft()
        out: list = []
        t = reload.tensor_for_use()
        sim.read(t, out)                        # backward kernel reading the tensor
        del t, reload
        results.append((bytes([_pattern(i)]) * n, out))
        sim.run_some()
    copies.close()
    sim.finish()
    return [(want, got[0]) for want, got in results]


def _exact(seed, **kwargs):
    return all(want == got for want, got in run_step(seed, **kwargs))


def run_block_reuse(seed, n=64):
    """Note 8: a block whose H2D is queued is dropped by the runtime; a new D2H gets it."""
    sim = SimGpu(seed)
    arena = SimArena(sim)
    copies = CopyStreams(_backend=sim)
    results = []
    for i in range(4):
        x = sim.empty(n, None, sim.compute)
        sim.fill(x, _pattern(i))
        block = arena.allocate(n)
        copies.offload(x, block).wait()
        del x
        reload = copies.reload(block, n)
        del block                               # the runtime is done with the block
        z = sim.empty(n, None, sim.compute)
        sim.fill(z, 0xDD)
        copies.offload(z, arena.allocate(n))    # same size: the arena's first choice
        del z
        out: list = []
        sim.read(reload.tensor_for_use(), out)
        del reload
        sim.run_some()
        results.append((bytes([_pattern(i)]) * n, out))
    copies.close()
    sim.finish()
    return all(want == got[0] for want, got in results)


def run_shared_reload(seed, n=32, rounds=6):
    """Note 12: one reloaded block read on the compute stream and then on a second stream
    (the hooks' unpack cache serving a backward node that runs on another stream). Each
    round's reload reuses the previous round's block as soon as the allocator allows."""
    sim = SimGpu(seed)
    arena = SimArena(sim)
    copies = CopyStreams(_backend=sim)
    side = sim.new_stream(None)
    blocks = []
    for i in range(rounds):   # the forward, finished: no D2H is pending any more
        x = sim.empty(n, None, sim.compute)
        sim.fill(x, _pattern(i))
        blocks.append(arena.allocate(n))
        copies.offload(x, blocks[-1]).wait()
        del x
    results = []
    for i in range(rounds):
        reload = copies.reload(blocks[i], n)
        t = reload.tensor_for_use()             # the first consumer, on the compute stream
        shared = cuda_streams.SharedReload(None, _backend=sim)
        first: list = []
        sim.read(t, first)
        sim.current = side                      # a node whose forward ran on `side`
        shared.use_on_current_stream(t.untyped_storage(), t.storage_offset())
        second: list = []
        sim.read(t, second, side)
        sim.current = sim.compute
        del t, reload
        results += [(bytes([_pattern(i)]) * n, first), (bytes([_pattern(i)]) * n, second)]
        later = sim.new_event(False)            # compute moves on (a host sync, say)
        sim.record(later, sim.compute)
        sim.synchronize(later)                  # ... while `side` may still be behind
    copies.close()
    sim.finish()
    return all(want == got[0] for want, got in results)


# --------------------------------------------------------------------------- protocol tests
@pytest.mark.parametrize("seed", SEEDS)
def test_round_trip_is_exact_in_every_interleaving(seed):
    for want, got in run_step(seed):
        assert got == want
    assert run_block_reuse(seed)


def test_the_simulated_allocator_rounds_splits_and_reuses_across_sizes_like_torchs():
    alloc = SimAllocator(64 << 20)
    s1, s2 = object(), object()
    a, b = alloc.allocate(1, s1), alloc.allocate(1000, s1)
    assert (a, b) == (0, 512)                     # 512-byte rounding, split off one segment
    alloc.release(a)
    alloc.release(b)                              # merged back into the whole 2 MiB segment
    assert alloc.allocate(1500, s1) == 0          # a freed block serves another size
    assert alloc.allocate(100, s2) == 2 << 20     # another stream: a segment of its own
    big = alloc.allocate(3 << 20, s1)             # large pool: a 20 MiB segment ...
    assert alloc.allocate(5 << 20, s1) == big + (3 << 20)   # ... split (more than 1 MiB left)


def test_the_simulated_gpu_has_a_current_stream_per_thread_and_pins_only_its_arena():
    sim = SimGpu(0)
    other = sim.new_stream(None)
    seen = []

    def device_thread():
        seen.append(sim.current)
        sim.current = other
        seen.append(sim.current)

    t = threading.Thread(target=device_thread)
    t.start()
    t.join()
    assert seen == [sim.compute, other] and sim.current is sim.compute
    pinned = torch.frombuffer(SimArena(sim).allocate(16), dtype=torch.uint8)
    assert sim.is_pinned(pinned) and not sim.is_pinned(torch.zeros(16, dtype=torch.uint8))


def run_backward_on_a_thread(seed, n=64, count=6):
    """Forward on this thread (compute stream); backward on another thread whose current
    stream is its own, as autograd runs a node on its device thread with the stream the
    node's forward ran on current."""
    sim = SimGpu(seed)
    arena = SimArena(sim)
    copies = CopyStreams(_backend=sim)
    node_stream = sim.new_stream(None)
    saved = []
    for i in range(count):
        x = sim.empty(n, None, sim.compute)
        sim.fill(x, _pattern(i))
        block = arena.allocate(n)
        saved.append((copies.offload(x, block), block, i))
        del x
        sim.run_some()
    results = []

    def backward():
        sim.current = node_stream
        while saved:
            ticket, block, i = saved.pop()
            t = copies.reload(block, n, after=ticket).tensor_for_use()
            out: list = []
            sim.read(t, out)                    # on this thread's current stream
            del t, ticket, block
            results.append((bytes([_pattern(i)]) * n, out))
            sim.run_some()

    worker = threading.Thread(target=backward)
    worker.start()
    worker.join()
    assert sim.current is sim.compute           # the forward thread's stream is unchanged
    copies.close()
    sim.finish()
    return all(want == got[0] for want, got in results)


@pytest.mark.parametrize("seed", SEEDS[:10])
def test_backward_on_autograd_device_thread_is_exact(seed):
    assert run_backward_on_a_thread(seed)


def test_note7_a_consumer_stream_taken_on_the_forward_thread_reads_early(monkeypatch):
    real_init = CopyStreams.__init__

    def init(copies, *a, **kw):                 # the consumer resolved once, on the wrong thread
        real_init(copies, *a, **kw)
        forward = copies._backend.current_stream(copies.device)
        copies._backend.current_stream = lambda device: forward

    monkeypatch.setattr(CopyStreams, "__init__", init)
    assert not all(run_backward_on_a_thread(seed) for seed in SEEDS)


def test_simulated_gpu_catches_a_plain_race():
    """Sanity check of the simulator itself: an unordered copy+read is caught."""
    caught = 0
    for seed in SEEDS:
        sim = SimGpu(seed)
        a, b = sim.empty(8, None, sim.compute), sim.empty(8, None, sim.compute)
        sim.fill(a, 7)
        other = sim.new_stream(None)
        sim.copy(b, a, other)       # no wait on the fill
        out: list = []
        sim.read(b, out, other)
        sim.finish()
        caught += out[0] != bytes([7]) * 8
    assert caught > 0


class _DropWaits:
    """Wrap SimGpu, ignoring `wait_event` on the stream that `which(copies, sim)` names."""

    def __init__(self, which):
        self.which = which

    def install(self, monkeypatch):
        real_init = CopyStreams.__init__
        which = self.which

        def init(copies, *a, **kw):
            real_init(copies, *a, **kw)
            sim = copies._backend
            target = which(copies, sim)
            real_wait = sim.wait_event
            sim.wait_event = lambda s, ev: None if s is target else real_wait(s, ev)

        monkeypatch.setattr(CopyStreams, "__init__", init)


def _detected(monkeypatch_mutation, monkeypatch):
    """Number of seeds (stopping at the first) whose step is no longer exact."""
    monkeypatch_mutation(monkeypatch)
    return int(any(not _exact(seed) for seed in SEEDS))


def test_note1_without_producer_wait_the_d2h_reads_stale_bytes(monkeypatch):
    drop = _DropWaits(lambda copies, sim: copies.offload_stream)
    assert _detected(drop.install, monkeypatch) > 0


def test_note2_without_holding_the_source_compute_overwrites_it(monkeypatch):
    real = cuda_streams._Pending.__init__

    def no_src(self, *a, **kw):
        real(self, *a, **kw)
        self.src = None

    assert _detected(lambda mp: mp.setattr(cuda_streams._Pending, "__init__", no_src),
                     monkeypatch) > 0


def test_note5_without_waiting_for_the_d2h_the_h2d_reads_too_early(monkeypatch):
    drop = _DropWaits(lambda copies, sim: copies.prefetch_stream)
    assert _detected(drop.install, monkeypatch) > 0


def test_note6_without_record_stream_the_next_reload_reuses_a_block_in_use(monkeypatch):
    assert _detected(lambda mp: mp.setattr(SimGpu, "record_stream", lambda *a: None),
                     monkeypatch) > 0


def test_note6_is_caught_when_no_two_tensors_have_the_same_size(monkeypatch):
    """The caching allocator hands a freed block to the next request of another size (it
    rounds and splits), so a reload freed too early is overwritten by the next reload even
    when every tensor has its own size."""
    sizes = tuple(range(16, 16 + 24 * 20, 20))
    assert all(_exact(seed, sizes=sizes, distinct=True) for seed in SEEDS[:8])
    monkeypatch.setattr(SimGpu, "record_stream", lambda *a: None)
    assert any(not _exact(seed, sizes=sizes, distinct=True) for seed in SEEDS)


def test_note7_without_the_consumer_wait_backward_reads_before_the_h2d(monkeypatch):
    drop = _DropWaits(lambda copies, sim: sim.compute)
    assert _detected(drop.install, monkeypatch) > 0


@pytest.mark.parametrize("seed", SEEDS)
def test_a_reload_shared_by_two_streams_is_exact(seed):
    assert run_shared_reload(seed)


def test_note12_without_the_second_stream_wait_it_reads_before_the_h2d(monkeypatch):
    real = SimGpu.wait_event

    def no_ready_wait(sim, stream, ev):   # drop only waits on SharedReload's event
        if not getattr(ev, "shared_ready", False):
            real(sim, stream, ev)

    real_use = cuda_streams.SharedReload.use_on_current_stream

    def tag(self, *a, **kw):
        real_new = self._backend.new_event

        def tagged(*args, **kwargs):
            ev = real_new(*args, **kwargs)
            ev.shared_ready = True
            return ev

        self._backend.new_event = tagged
        try:
            real_use(self, *a, **kw)
        finally:
            del self._backend.new_event

    monkeypatch.setattr(SimGpu, "wait_event", no_ready_wait)
    monkeypatch.setattr(cuda_streams.SharedReload, "use_on_current_stream", tag)
    assert not all(run_shared_reload(seed) for seed in SEEDS)


def test_note12_without_record_stream_the_next_reload_overwrites_a_block_in_use(monkeypatch):
    real = SimGpu.record_stream
    side_records = []

    def compute_only(sim, tensor, stream):   # Note 6's record_stream stays
        if stream is sim.current and stream is not sim.compute:
            side_records.append(stream)
            return
        real(sim, tensor, stream)

    monkeypatch.setattr(SimGpu, "record_stream", compute_only)
    assert not all(run_shared_reload(seed) for seed in SEEDS)
    assert side_records, "the mutation removed nothing"


def test_note8_without_holding_the_h2d_source_a_new_d2h_overwrites_it(monkeypatch):
    real = cuda_streams._Pending.__init__

    def no_block(self, *a, **kw):
        real(self, *a, **kw)
        if self.kind == "h2d":
            self.block = self.host = None

    monkeypatch.setattr(cuda_streams._Pending, "__init__", no_block)
    assert any(not run_block_reuse(seed) for seed in SEEDS)


# --------------------------------------------------------------------------- chained NVMe path
def run_chained(seed, n_tensors=12, n=32):
    sim = SimGpu(seed)
    arena = SimArena(sim)
    store = SimStore(sim)
    copies = CopyStreams(_backend=sim)
    rng = random.Random(seed)
    results = []
    for i in range(n_tensors):
        store.data[i] = bytes([_pattern(i)]) * n
        store.data[("stale", i)] = b"\x77" * n
        abandoned = read_then_h2d(copies, store, ("stale", i), arena.allocate(n), n)
        del abandoned                            # a prefetch nobody uses (Note 9)
        other = arena.allocate(n)
        other[:] = 0x55
        plain = copies.reload(other, n)          # allocates on the prefetch stream at once
        ticket = read_then_h2d(copies, store, i, arena.allocate(n), n)
        if rng.random() < 0.5:
            store.progress()
        out, out2 = [], []
        while store.jobs and rng.random() < 0.5:
            store.progress()
        sim.run_some()
        if not store.jobs or rng.random() < 0.5:
            t = ticket.tensor_for_use() if not store.jobs else None
        else:
            t = None
        while t is None:
            store.progress()
            t = ticket.tensor_for_use() if not store.jobs else None
        sim.read(t, out)
        t2 = plain.tensor_for_use()
        sim.read(t2, out2)
        del t, t2, ticket, plain
        results.append((store.data[i], out))
        results.append((bytes([0x55]) * n, out2))
        sim.run_some()
    while store.jobs:
        store.progress()
    copies.close()
    sim.finish()
    return [(want, got[0]) for want, got in results]


@pytest.mark.parametrize("seed", SEEDS)
def test_chained_reload_is_exact(seed):
    for want, got in run_chained(seed):
        assert got == want


def test_note7_chained_without_waiting_for_the_engine_record_reads_early(monkeypatch):
    """Only the *tensor_for_use* wait on the I/O future is removed (store still progresses)."""
    sim_store_progress = SimStore.progress
    monkeypatch.setattr(cuda_streams.H2DTicket, "_wait_io", lambda self: None)
    caught = 0
    for seed in SEEDS:
        sim = SimGpu(seed)
        arena = SimArena(sim)
        store = SimStore(sim)
        copies = CopyStreams(_backend=sim)
        store.data["e"] = b"\x2a" * 32
        ticket = read_then_h2d(copies, store, "e", arena.allocate(32), 32)
        out: list = []
        t = ticket.tensor_for_use()     # wait enqueued before the engine's record
        sim.read(t, out)
        sim.run_some()
        sim_store_progress(store)
        sim.finish()
        copies.close()
        caught += out[0] != b"\x2a" * 32
    assert caught > 0


def test_note9_without_holding_the_chained_destination_a_reload_gets_corrupted(monkeypatch):
    real = cuda_streams._Pending.__init__

    def no_dst(self, *a, **kw):
        real(self, *a, **kw)
        self.dst = None

    monkeypatch.setattr(cuda_streams._Pending, "__init__", no_dst)
    assert any(any(w != g for w, g in run_chained(seed)) for seed in SEEDS)


def test_chained_read_error_surfaces_in_tensor_for_use_and_is_swept():
    from offload.errors import StorageError
    sim = SimGpu(0)
    arena = SimArena(sim)
    store = SimStore(sim)
    copies = CopyStreams(_backend=sim)
    store.data["e"] = b"\0" * 16
    ticket = read_then_h2d(copies, store, "e", arena.allocate(16), 16)
    store.progress(fail=True)
    with pytest.raises(StorageError, match="read failed"):
        ticket.tensor_for_use()
    sim.finish()
    copies.poll()
    assert copies.inflight["h2d"] == 0
    copies.close()


# --------------------------------------------------------------------------- graph capture (Note 14)
def test_note14_moving_tensors_under_graph_capture_raises_and_leaves_the_capture_intact():
    """Under capture a copy would be recorded into the graph, not run, and every wait or
    query of an event is refused by CUDA (and invalidates the capture). Each entry point
    that copies or waits says so, naming the way out, before it touches CUDA; `poll` and
    `done()` only skip their queries, so a captured region under no_offload() stays legal."""
    sim, arena, copies = _copies()
    x = sim.empty(64, None, sim.compute)
    sim.fill(x, 3)
    block = arena.allocate(64)
    before = copies.offload(x, block)            # in flight when the capture starts
    store = SimStore(sim)
    store.data["e"] = b"\x2a" * 64
    chained = read_then_h2d(copies, store, "e", arena.allocate(64), 64)
    store.progress()
    sim.begin_capture()
    y = sim.empty(64, None, sim.compute)
    calls = {"offload": lambda: copies.offload(y, arena.allocate(64)),
             "reload": lambda: copies.reload(block, 64, after=before),
             "reload_chained": lambda: read_then_h2d(copies, store, "e", arena.allocate(64), 64),
             "tensor_for_use": chained.tensor_for_use,
             "wait": before.wait,
             "drain": copies.drain}
    for name, call in calls.items():
        with pytest.raises(GraphCaptureError, match=r"is capturing a CUDA graph; .*Capture the "
                                                    r"graph outside offload.activations\(\), or "
                                                    r"wrap the captured region in "
                                                    r"offload.no_offload\(\)"):
            call()
    copies.poll()
    assert not before.done() and not chained.done()
    assert sim.end_capture() is False and sim.captured_ops == 0
    assert before.wait() >= 0 and chained.tensor_for_use() is not None
    copies.close()
    sim.finish()


def test_note14_the_simulated_gpu_refuses_a_query_during_capture():
    sim, arena, copies = _copies()
    ev = sim.new_event(False)
    sim.begin_capture()
    with pytest.raises(RuntimeError, match=CAPTURE_REFUSED):
        sim.query(ev)
    assert sim.end_capture() is True             # invalidated


def test_note14_blocking_copies_refuse_a_capture_too(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(GraphCaptureError, match="a blocking device-to-host copy was called"):
        sync_d2h(types.SimpleNamespace(is_cuda=True), None, None)
    with pytest.raises(GraphCaptureError, match="a blocking host-to-device copy was called"):
        sync_h2d(torch.zeros(4, dtype=torch.uint8), torch.device("cuda", 0), None)


# --------------------------------------------------------------------------- write-behind, back-pressure
def test_write_behind_keeps_the_event_until_the_write_is_done():
    sim = SimGpu(0)
    arena = SimArena(sim)
    store = SimStore(sim)
    copies = CopyStreams(_backend=sim)
    x = sim.empty(64, None, sim.compute)
    sim.fill(x, 9)
    ticket = copies.offload(x, arena.allocate(64))
    del x
    wb = write_after_d2h(store, "ext", ticket)
    event = weakref.ref(ticket.event)
    del ticket
    copies.poll()
    gc.collect()
    assert event() is not None and not wb.done()   # Note 4: engine may still wait on it
    store.progress()                               # the engine waits for the D2H, then writes
    assert wb.wait() == 64 and wb.done()
    copies.poll()                                  # the finished D2H lets go of it too
    gc.collect()
    assert event() is None
    assert store.data["ext"] == b"\x09" * 64
    copies.close()
    sim.finish()


def test_back_pressure_bounds_the_source_bytes_held():
    sim = SimGpu(0)
    arena = SimArena(sim)
    copies = CopyStreams(_backend=sim, max_inflight_bytes=100)
    for i in range(20):                 # the device makes no progress unless we wait
        x = sim.empty(32, None, sim.compute)
        sim.fill(x, 1)
        copies.offload(x, arena.allocate(32))
        del x
        assert copies.inflight["held_source_bytes"] <= 100
    assert copies.stats.max_held_source_bytes <= 100 + 32
    assert copies.stats.d2h_copies >= 16
    copies.close()
    assert copies.inflight == {"d2h": 0, "h2d": 0, "held_source_bytes": 0}
    sim.finish()


def test_back_pressure_waits_for_as_many_copies_as_it_takes():
    """A large source behind small pending ones: one wait on the oldest copy is not enough,
    offload keeps waiting, oldest first, until the sources held fit again (Note 11)."""
    sim = SimGpu(0)
    arena = SimArena(sim)
    copies = CopyStreams(_backend=sim, max_inflight_bytes=100)
    for nbytes in (32, 32, 32, 96):
        x = sim.empty(nbytes, None, sim.compute)
        sim.fill(x, 1)
        copies.offload(x, arena.allocate(nbytes))
        del x
        assert copies.inflight["held_source_bytes"] <= 100
    assert copies.inflight == {"d2h": 1, "h2d": 0, "held_source_bytes": 96}
    copies.close()
    sim.finish()


def test_done_drops_the_source_and_device_tensor_if_held():
    sim = SimGpu(0)
    arena = SimArena(sim)
    copies = CopyStreams(_backend=sim)
    x = sim.empty(16, None, sim.compute)
    ticket = copies.offload(x, arena.allocate(16))
    assert ticket.device_tensor_if_held() is x and not ticket.done()
    sim.finish()
    assert ticket.done() and ticket.device_tensor_if_held() is None
    assert ticket.wait() == 0.0
    copies.close()


def test_stats_and_trace_from_timed_copies():
    sim = SimGpu(0)
    arena = SimArena(sim)
    rec = TraceRecorder()
    copies = CopyStreams(_backend=sim, trace=rec)
    blocks = []
    for _ in range(4):
        x = sim.empty(4096, None, sim.compute)
        blocks.append(arena.allocate(4096))
        copies.offload(x, blocks[-1])
    tickets = [copies.reload(b, 4096) for b in blocks]
    for t in tickets:
        t.wait()
    copies.close()
    s = copies.stats.as_dict()
    assert s["d2h_bytes"] == s["h2d_bytes"] == 4 * 4096
    assert s["d2h_copies"] == s["h2d_copies"] == 4
    assert s["d2h_gbps"] == pytest.approx(1.0) and s["h2d_gbps"] == pytest.approx(1.0)
    tracks = {}
    doc = rec.to_dict()
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            tracks.setdefault(names[e["tid"]].split(" #")[0], []).append(e)
    assert len(tracks["d2h"]) == 4 and len(tracks["h2d"]) == 4
    assert all(e["args"]["bytes"] == 4096 for e in tracks["d2h"])


# --------------------------------------------------------------------------- argument errors
def _copies():
    sim = SimGpu(0)
    return sim, SimArena(sim), CopyStreams(_backend=sim)


def test_offload_rejects_non_contiguous_source():
    sim, arena, copies = _copies()
    x = torch.zeros(4, 4, dtype=torch.uint8).t()
    with pytest.raises(ValueError, match=r"src must be contiguous \(size \(4, 4\), stride \(1, 4\)\)"):
        copies.offload(x, arena.allocate(16))


def test_offload_rejects_empty_source():
    sim, arena, copies = _copies()
    with pytest.raises(ValueError, match="src is empty"):
        copies.offload(sim.empty(0, None, sim.compute), arena.allocate(16))


def test_offload_rejects_source_on_another_device():
    sim, arena, copies = _copies()
    with pytest.raises(ValueError, match="src is on meta, these streams belong to cpu"):
        copies.offload(torch.empty(4, device="meta"), arena.allocate(16))


def test_offload_rejects_block_too_small():
    sim, arena, copies = _copies()
    x = sim.empty(64, None, sim.compute).view(torch.float32)
    with pytest.raises(ValueError, match=r"offload\(\): nbytes=64 does not fit the block of 32 bytes"):
        copies.offload(x, arena.allocate(32))


def test_reload_rejects_bad_nbytes():
    sim, arena, copies = _copies()
    with pytest.raises(ValueError, match=r"reload\(\): nbytes=0 does not fit"):
        copies.reload(arena.allocate(32), 0)


def test_closed_streams_refuse_copies():
    sim, arena, copies = _copies()
    copies.close()
    copies.close()   # idempotent
    with pytest.raises(RuntimeError, match="CopyStreams is closed"):
        copies.reload(arena.allocate(32), 32)


def test_max_inflight_bytes_must_be_positive():
    with pytest.raises(ValueError, match=r"max_inflight_bytes=0\): must be > 0"):
        CopyStreams(_backend=SimGpu(0), max_inflight_bytes=0)


def test_cpu_device_is_rejected_by_the_torch_backend():
    with pytest.raises(ValueError, match="CopyStreams\\(device='cpu'\\): needs a CUDA device"):
        CopyStreams("cpu")


def test_unpinned_blocks_warn_once(caplog):
    sim = SimGpu(0)
    arena = SimArena(sim, pinned=False)
    copies = CopyStreams(_backend=sim)
    with caplog.at_level(logging.WARNING, logger="offload"):
        for _ in range(3):
            copies.reload(arena.allocate(16), 16)
    assert sum("not page-locked" in r.message for r in caplog.records) == 1
    copies.close()
    sim.finish()


def test_a_uint8_view_of_a_block_works_as_a_block():
    sim, arena, copies = _copies()
    x = sim.empty(32, None, sim.compute)
    sim.fill(x, 5)
    view = torch.frombuffer(arena.allocate(32), dtype=torch.uint8)
    ticket = copies.offload(x, view)
    out: list = []
    sim.read(copies.reload(view, 32, after=ticket).tensor_for_use(), out)
    copies.close()
    sim.finish()
    assert out == [b"\x05" * 32]


def test_write_behind_needs_the_host_block_itself():
    sim, arena, copies = _copies()
    view = torch.frombuffer(arena.allocate(16), dtype=torch.uint8)
    ticket = copies.offload(sim.empty(16, None, sim.compute), view)
    with pytest.raises(TypeError, match=r"write_after_d2h\(\): the D2H copied into a tensor view"):
        write_after_d2h(SimStore(sim), "ext", ticket)
    copies.close()


def test_streams_are_the_same_for_every_step():
    # Note 13: CopyStreams of later steps reuse the device's streams, so reloads allocated on
    # the prefetch stream reuse the blocks earlier steps freed.
    sim = SimGpu(0)
    first = CopyStreams(_backend=sim)
    first.close()
    second = CopyStreams(_backend=sim)
    assert (second.offload_stream, second.prefetch_stream) == \
        (first.offload_stream, first.prefetch_stream)
    assert first.offload_stream is not first.prefetch_stream
    second.close()


def test_the_torch_backend_makes_one_stream_pair_per_device(monkeypatch):
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: made.append(device) or object())
    from offload.tiers import cuda_backend

    monkeypatch.setattr(cuda_backend, "_streams", {})
    backend = cuda_backend.TorchCuda()
    dev0, dev1 = torch.device("cuda", 0), torch.device("cuda", 1)
    pairs = [backend.copy_streams(d) for d in (dev0, dev1, dev0, dev1, dev0)]
    assert made == [dev0, dev0, dev1, dev1]
    assert pairs[0] is pairs[2] is pairs[4] and pairs[1] is pairs[3] and pairs[0] is not pairs[1]
    cuda_backend.after_fork_in_child()   # a forked child makes its own
    assert backend.copy_streams(dev0) is not pairs[0] and len(made) == 6


def test_a_tensor_block_must_be_uint8_on_the_cpu():
    sim, arena, copies = _copies()
    with pytest.raises(ValueError, match=r"reload\(block\): a tensor block must be a contiguous "
                                         r"uint8 CPU tensor, got torch.float32 on cpu"):
        copies.reload(torch.zeros(8), 8)


def test_non_uint8_source_moves_its_bytes():
    sim, arena, copies = _copies()
    x = sim.empty(16, None, sim.compute)
    sim.fill(x, 3)
    block = arena.allocate(16)
    copies.offload(x.view(torch.float32), block).wait()
    assert bytes(block) == b"\x03" * 16
    copies.close()
