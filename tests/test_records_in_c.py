"""The core's records, storage index, timeline and kept-tensor handles (hooks.py NOTE
[Handles in C]: csrc/saved_record.cpp, csrc/storage_index.cpp, csrc/timeline.cpp,
csrc/saved_handles.cpp, csrc/hook_front.cpp, csrc/hook_unpacker.cpp) against the Python
ones they stand for.

Most tests run both ways: `core` (the default where the core is built: Record, StorageIndex,
KeptSave, Timeline) and `python` (the ledger given the Python meter, as in a process without
the core: PyRecord, the Python StorageIndex, Kept, PyTimeline). Figures, gradients, timings kept and messages must
be identical; what differs is that the core's objects are not walked by the collector.
"""
from __future__ import annotations

import gc
import math
import threading
import time
import weakref

import pytest
import torch
import torch.nn as nn

import offload
from offload import process
from offload._ext import core_available, load_core
from offload.runtime import records
from offload.runtime.saved_bytes import PySavedBytes
from offload.runtime.tensor_meta import StorageIndex
from offload.runtime.timeline import PyTimeline

pytestmark = pytest.mark.skipif(not core_available(), reason="needs the compiled core")

# Figures that vary run to run whatever the path: times, the I/O threads' timing (how much
# was in flight), and buffer addresses (an unaligned source is written through the bounce
# buffer).
_VARIES = ("_s", "_gbps", "fraction", "inflight", "peak_prefetch_bytes", "bounced_bytes",
           "staging_peak_bytes")


class _Tier:
    """What a record needs of its tier: `release`, noting every payload given back."""

    def __init__(self, fail: bool = False) -> None:
        self.released = []
        self.fail = fail

    def release(self, payload) -> None:
        self.released.append(payload)
        if self.fail:
            raise RuntimeError("a closed tier")


def _meter(kind: str):
    """A step's meter of the core, or of the Python path: what its records count into."""
    return load_core().SavedBytes() if kind == "core" else PySavedBytes()


def _types(kind: str):
    """(index type, record type) of the core, or of the Python path."""
    if kind == "core":
        return load_core().StorageIndex, load_core().Record
    return StorageIndex, records.PyRecord


@pytest.mark.parametrize("kind", ["core", "python"])
def test_the_index_keys_by_version_and_layout_and_forgets_dead_records_and_storages(kind):
    """The same contract for both index types."""
    index_type, record_type = _types(kind)
    meter, tier = _meter(kind), _Tier()
    index = index_type()
    t = torch.randn(10)
    s = t.untyped_storage()

    def moved(storage):   # a record whose bytes moved out: it holds its storage weakly
        return record_type(storage, tier, object(), storage.nbytes(), False, None, meter,
                           None)

    r0, r1 = moved(s), moved(s)
    index.add(s, 0, r0)
    assert index.lookup(s, 0) is r0 and index.lookup(s, 1) is None and r0.version == 0
    index.add(s, 1, r1)                         # a newer version: versions only grow
    assert index.lookup(s, 1) is r1 and index.lookup(s, 0) is None
    chunk = moved(s)                            # an untracked alias: by layout, apart
    index.add(s, 1, chunk, ("a",))
    assert index.lookup(s, 1, ("a",)) is chunk and index.lookup(s, 1) is r1
    del r1
    assert index.lookup(s, 1) is None           # records are held weakly
    r2 = moved(s)
    index.add(s, 2, r2)
    del t, s
    gc.collect()
    # A dead storage never matches again, even if its id is reused.
    assert r2() is None
    for _ in range(100):                        # storages made now may reuse the id
        other = torch.randn(10).untyped_storage()
        assert index.lookup(other, 2) is None and index.lookup(other, 0) is None


@pytest.mark.parametrize("kind", ["core", "python"])
def test_a_kept_record_names_its_storage_and_the_index_finds_it(kind):
    index_type, record_type = _types(kind)
    t = torch.randn(10)
    s = t.untyped_storage()
    kept = record_type(s, None, None, 40, True, None, _meter(kind), None)
    index = index_type()
    index.add(s, 3, kept)
    assert kept() is s and index.lookup(s, 3) is kept and len(index) == 1
    index.clear()
    assert len(index) == 0 and index.lookup(s, 3) is None


def test_a_core_record_holds_a_kept_storage_and_only_a_moved_one_weakly():
    """A kept or resident record holds its storage (its saves or payload do anyway: no weak
    reference object is made); one whose bytes moved must not keep them on the device."""
    core = load_core()
    meter = core.SavedBytes()
    t = torch.randn(10)
    s = t.untyped_storage()
    kept = core.Record(s, None, None, 40, True, None, meter, None)
    moved = core.Record(s, _Tier(), object(), 40, False, None, meter, None)
    alive = weakref.ref(s)
    del t, s
    gc.collect()
    assert alive() is not None and kept() is alive() and moved() is alive()
    del kept
    gc.collect()
    assert alive() is None and moved() is None


def test_a_core_records_cache_fields_refuse_what_its_load_cannot_read():
    """`del record.cache` stored NULL, which the core's load then dereferenced: a crash
    (found by reading, in a sanitizer review); so would `record.handed = 5`, which the
    core's unpack reads as a dict. records.py sets them to None, a storage, a dict."""
    core = load_core()
    s = torch.randn(10).untyped_storage()
    record = core.Record(s, None, None, 40, True, None, core.SavedBytes(), None)
    assert record.cache is None and record.handed is None and record.shared is None
    for name in ("cache", "handed", "shared"):
        with pytest.raises(AttributeError, match=f"Record.{name} cannot be deleted"):
            delattr(record, name)
    with pytest.raises(TypeError, match="must be None or a dict, got int"):
        record.handed = 5
    record.cache, record.handed = s, {}
    assert record.cache is s and record.handed == {}
    record.cache = record.handed = None
    assert record.cache is None and record.handed is None
    # One whose __init__ never ran (its fields NULL) reads None and can be set (a review
    # found both crashed).
    bare = core.Record.__new__(core.Record)
    assert bare.cache is None and bare.shared is None
    bare.shared = None


@pytest.mark.parametrize("kind", ["core", "python"])
def test_a_record_counts_itself_in_and_out_of_its_meter_and_gives_its_payload_back(kind):
    """Made: its resident bytes and, holding tier space, a live record. Dead: its payload
    back to its tier, then counted out; the last one out notes when (the step's end)."""
    _, record_type = _types(kind)
    meter, tier = _meter(kind), _Tier()
    s = torch.randn(4).untyped_storage()
    payload = object()
    before = time.perf_counter()
    resident = record_type(s, tier, payload, 16, True, None, meter, None)   # a CPU host copy
    moved = record_type(s, tier, object(), 8, False, None, meter, None)
    kept = record_type(s, None, None, 4, True, None, meter, None)          # no tier space
    assert (meter.resident, meter.peak, meter.live_records) == (20, 20, 2)
    assert meter.idle_since_s is None and tier.released == []
    assert gc.is_tracked(resident) is (kind == "python")
    del resident
    assert tier.released == [payload]
    assert (meter.resident, meter.live_records, meter.idle_since_s) == (4, 1, None)
    del moved, kept
    assert (meter.resident, meter.peak, meter.live_records) == (0, 20, 0)
    assert len(tier.released) == 2 and before <= meter.idle_since_s <= time.perf_counter()
    if kind == "core":
        with pytest.raises(RuntimeError, match="initialised once"):
            record_type(s, None, None, 4, False, None, meter, None).__init__(
                s, None, None, 4, False, None, meter, None)


@pytest.mark.parametrize("kind", ["core", "python"])
def test_records_count_their_storages_into_the_meter_for_the_steps_figures(kind):
    """Each record counts its storage once: saved bytes, kept bytes (no tier) or bytes per
    tier; `take_counts` hands them over once (Ledger.fold adds them to Stats)."""
    _, record_type = _types(kind)
    meter, host, nvme = _meter(kind), _Tier(), _Tier()
    s = torch.randn(4).untyped_storage()
    held = [record_type(s, host, object(), 16, True, None, meter, None),
            record_type(s, nvme, object(), 8, False, None, meter, None),
            record_type(s, host, object(), 32, False, None, meter, None),
            record_type(s, None, None, 4, True, None, meter, None)]       # kept
    packed, offloaded, storages, saved, kept, stored = meter.take_counts()
    assert (packed, offloaded, storages, saved, kept) == (0, 0, 4, 60, 4)
    assert sorted((id(t), n) for t, n in stored) == sorted([(id(host), 48), (id(nvme), 8)])
    assert meter.take_counts() == (0, 0, 0, 0, 0, [])                   # taken once
    del held
    assert meter.take_counts() == (0, 0, 0, 0, 0, [])                   # deaths count none


def test_a_core_record_is_made_the_same_by_position_or_by_keyword():
    core = load_core()
    meter, tier = core.SavedBytes(), _Tier()
    s = torch.randn(4).untyped_storage()
    args = (s, tier, "payload", 16, False, None, meter, None)
    names = ("storage", "tier", "payload", "nbytes", "resident", "meta", "meter", "prefetcher")
    by_position = core.Record(*args)
    by_keyword = core.Record(**dict(zip(names, args)))
    mixed = core.Record(*args[:4], **dict(zip(names[4:], args[4:])))
    for record in (by_position, by_keyword, mixed):
        assert (record(), record.tier, record.payload, record.nbytes, record.resident,
                record.meter) == (s, tier, "payload", 16, False, meter)
    assert meter.live_records == 3
    for wrong in (args[:7], args + (None,)):
        with pytest.raises(TypeError):
            core.Record(*wrong)
    with pytest.raises(TypeError):
        core.Record(s, tier, "payload", "16", False, None, meter, None)   # nbytes not an int

    class Index:   # an integer type (numpy's, say): taken by position as by keyword
        def __index__(self):
            return 16

    assert core.Record(s, None, None, Index(), False, None, meter, None).nbytes == 16
    assert core.Record(s, None, None, nbytes=Index(), resident=False, meta=None, meter=meter,
                       prefetcher=None).nbytes == 16
    with pytest.raises(TypeError, match="weak reference"):   # a meter refers to tiers weakly
        core.Record(s, object(), "payload", 16, False, None, meter, None)
    assert meter.live_records == 3                                      # none half made
    assert meter.take_counts()[2] == 5          # the 3 above and the two kept: no other
    unset = core.Record.__new__(core.Record)
    with pytest.raises(RuntimeError, match="once initialised"):
        unset.note_packed(core.Timeline(), 0)


def test_the_core_meter_refers_to_a_tier_weakly_and_leaves_out_one_that_died():
    core = load_core()
    meter = core.SavedBytes()
    s = torch.randn(4).untyped_storage()
    tier = _Tier()
    alive = weakref.ref(tier)
    record = core.Record(s, tier, "payload", 16, False, None, meter, None)
    del record, tier
    gc.collect()
    assert alive() is None                                   # the meter did not keep it
    assert meter.take_counts() == (0, 0, 1, 16, 0, [])       # its bytes have no name left


@pytest.mark.parametrize("kind", ["core", "python"])
def test_a_record_notes_its_pack_on_a_timeline_now(kind):
    _, record_type = _types(kind)
    timeline = load_core().Timeline() if kind == "core" else PyTimeline()
    meter = _meter(kind)
    s = torch.randn(4).untyped_storage()
    first = record_type(s, None, None, 16, True, None, meter, None)
    second = record_type(s, None, None, 8, True, None, meter, None)
    before = time.perf_counter()   # the timeline's clock (the unpacks note theirs with it)
    first.note_packed(timeline, 5)
    second.note_packed(timeline, 9)
    after = time.perf_counter()
    assert (first.timeline, first.row, second.timeline, second.row) == (timeline, 0,
                                                                        timeline, 1)
    rows = timeline.rows()
    assert [(r[0], r[1], r[3]) for r in rows] == [((5, 16), 16, None), ((9, 8), 8, None)]
    assert all(before <= r[2] <= after for r in rows)
    if kind == "core":
        with pytest.raises(TypeError, match="core's Timeline, not PyTimeline"):
            first.note_packed(PyTimeline(), 1)
        assert first.row == 0 and len(timeline.rows()) == 2


def test_the_figures_are_up_to_date_when_read_inside_the_block(path):
    """`ctx.stats` folds what the step counted (in its meter) when read: the same figures
    inside the block as after it, and none counted twice."""
    x = torch.randn(256, requires_grad=True)
    with offload.activations(tiers="host", min_bytes=1024) as ctx:
        y = (x * 2).sin().exp()        # sin's input and exp's output: 1 KiB, stored
        z = (x[:8] * 3).cos()          # cos's input: 32 B, small
        inside = ctx.stats.as_dict()
        again = ctx.stats.as_dict()
        (y.sum() + z.sum()).backward()
    after = ctx.stats.as_dict()
    expect = dict(packed_tensors=3, unique_storages=3, host_bytes=2048,
                  saved_bytes=2048 + 32, kept_bytes=32, offloaded_tensors=2)
    for figures in (inside, again, after):
        assert {k: figures[k] for k in expect} == expect


def test_a_tier_error_at_a_records_death_is_swallowed_and_a_pending_error_kept():
    """A record dies wherever autograd drops it, also while an exception propagates: its
    tier's error (a closed tier) must not replace that exception or escape, and the record
    is still counted out (the step's end waits for no record left)."""
    core = load_core()
    meter, tier = core.SavedBytes(), _Tier(fail=True)
    s = torch.randn(4).untyped_storage()

    def fail_while_a_record_dies():
        record = core.Record(s, tier, object(), 16, False, None, meter, None)
        raise KeyError("the user's error")   # the frame (and the record) dies with it

    with pytest.raises(KeyError, match="the user's error"):
        fail_while_a_record_dies()
    gc.collect()
    assert len(tier.released) == 1 and meter.live_records == 0

    refused = _Tier()
    for wrong in (PySavedBytes(), None):
        with pytest.raises(TypeError, match="the core's SavedBytes meter, not "
                                            f"{type(wrong).__name__}"):
            core.Record(s, refused, object(), 16, False, None, wrong, None)
    gc.collect()
    assert refused.released == []    # a record no meter counted is never given back


def test_records_give_their_payloads_back_one_at_a_time_across_threads():
    """Records die on autograd's threads: a tier's release is never run by two at once (the
    meter's release lock, waited for without the GIL, which its holder needs to finish)."""
    core = load_core()
    meter = core.SavedBytes()
    inside, most = [0], [0]

    class SlowTier:
        def release(self, payload):
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            time.sleep(0.001)   # lets the other threads run while this one is inside
            inside[0] -= 1

    tier = SlowTier()
    s = torch.randn(4).untyped_storage()
    batches = [[core.Record(s, tier, object(), 8, False, None, meter, None)
                for _ in range(20)] for _ in range(4)]
    assert meter.live_records == 80
    threads = [threading.Thread(target=batch.clear) for batch in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert meter.live_records == 0 and most[0] == 1


def test_a_record_outliving_its_index_dies_cleanly():
    core = load_core()
    meter, tier = core.SavedBytes(), _Tier()
    s = torch.randn(4).untyped_storage()
    record = core.Record(s, tier, object(), 16, False, None, meter, None)
    index = core.StorageIndex()
    index.add(s, 0, record)
    other = core.StorageIndex()
    other.add(s, 0, record)                     # moved to another index: out of the first
    assert len(index) == 0 and other.lookup(s, 0) is record
    del index, other                            # the step's index goes first
    del record
    assert len(tier.released) == 1
    index = core.StorageIndex()
    record = core.Record(s, tier, object(), 16, False, None, meter, None)
    index.add(s, 0, record)
    del record                                  # a record going first takes its entry out
    assert len(index) == 0


def test_the_core_index_takes_only_core_records():
    core = load_core()
    s = torch.randn(4).untyped_storage()
    py = records.PyRecord(s, None, None, 16, False, None, PySavedBytes(), None)
    with pytest.raises(TypeError, match="the core's Record"):
        core.StorageIndex().add(s, 0, py)


def test_the_core_hooks_take_one_argument_and_say_which_hook_refused():
    with offload.activations(tiers="host", min_bytes=0) as ctx:
        hooks = ctx._step.hooks
        for hook, name in ((hooks.pack, "pack"), (hooks.unpack_hook(), "unpack")):
            assert type(hook).__name__ == name.capitalize() + "er"   # the core's, not Python
            for args, kwargs in (((), {}), ((torch.ones(1), torch.ones(1)), {}),
                                 ((), {"t": torch.ones(1)})):
                with pytest.raises(TypeError, match=f"the {name} hook takes one argument"):
                    hook(*args, **kwargs)


def test_what_autograd_holds_is_untracked_with_the_core(path, nvme_dir):
    x = torch.randn(64, requires_grad=True)
    held = {}
    with offload.activations(tiers="host", min_bytes=0) as ctx:
        held["host"] = ctx._step.hooks.pack(x * 2)          # a CPU storage: kept resident
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0) as ctx:
        held["nvme"] = ctx._step.hooks.pack(x * 3)          # moved
        held["weight"] = ctx._step.hooks.pack(x)            # a leaf needing grad: a weight
    core = path == "core"
    assert type(held["host"]).__name__ == ("KeptSave" if core else "Kept")
    assert type(held["weight"]).__name__ == ("KeptSave" if core else "Kept")
    assert held["weight"].record is None
    assert type(held["nvme"]).__name__ == ("MovedSave" if core else "Moved")
    assert gc.is_tracked(held["nvme"]) is not core
    for handle in (held["host"], held["nvme"]):
        assert type(handle.record) is (load_core().Record if core else records.PyRecord)
        assert gc.is_tracked(handle.record) is not core
    assert gc.is_tracked(held["host"]) is not core
    timeline = ctx._step.timeline   # where the step notes when its storages move
    assert type(timeline) is (load_core().Timeline if core else PyTimeline)
    assert gc.is_tracked(timeline) is not core
    held.clear()


@pytest.mark.parametrize("kind", ["core", "python"])
def test_a_timeline_notes_each_rows_first_unpack_and_gives_rows_and_columns(kind):
    timeline = load_core().Timeline() if kind == "core" else PyTimeline()
    empty = timeline.columns()   # a step that stored nothing
    assert [list(c) for c in empty] == [[], [], [], []] and timeline.rows() == []
    assert [timeline.add(p, b, s) for p, b, s in ((0, 4096, 1.5), (1, 8192, 2.5),
                                                    (2, 1 << 40, 3.25))] == [0, 1, 2]
    timeline.unpacked(1, 4.0)
    timeline.unpacked(1, 5.0)   # a later unpack does not move the first
    timeline.unpacked(2, 3.5)
    assert len(timeline) == 3
    assert timeline.rows() == [[(0, 4096), 4096, 1.5, None], [(1, 8192), 8192, 2.5, 4.0],
                               [(2, 1 << 40), 1 << 40, 3.25, 3.5]]
    positions, nbytes, pack_s, unpack_s = timeline.columns()
    assert (positions.typecode, nbytes.typecode, pack_s.typecode) == ("q", "q", "d")
    assert (list(positions), list(nbytes), list(pack_s), unpack_s) == (
        [0, 1, 2], [4096, 8192, 1 << 40], [1.5, 2.5, 3.25], [None, 4.0, 3.5])
    for row in (3, -1):   # no row there (a negative index is not Python's "from the end")
        with pytest.raises(IndexError):
            timeline.unpacked(row, 1.0)
    with pytest.raises(OverflowError):
        timeline.add(3, 1 << 70, 4.0)   # refused whole: the columns stay in step
    assert timeline.add(4, 1, 5.0) == 3 and timeline.rows()[3] == [(4, 1), 1, 5.0, None]
    assert len(positions) == 3   # columns handed out are copies: later rows do not grow them


class Block(nn.Module):
    """Saves of every kind: weights (and a view of one), activations, views of one storage
    saved several times (q, k, v), outputs saved by their own node (exp, sigmoid)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.out = nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = self.qkv(x).split(32, dim=-1)
        a = torch.softmax(q @ k.transpose(-1, -2) / 8, dim=-1)
        h = (a @ v).exp().sigmoid() * x
        return self.out(h) @ self.out.weight.t()


def _run(model, x, **kw):
    with offload.activations(model=model, **kw) as ctx:
        loss = model(x).square().sum()
        loss.backward()
    rows = ctx._step.timeline.rows()
    stats = {k: v for k, v in ctx.stats.as_dict().items() if not k.endswith(_VARIES)}
    return ctx, stats, [(r[0], r[1], math.isnan(r[3]) if r[3] is not None else None)
                        for r in rows]


# Capacities given, not measured from the machine's free memory and disk (which move).
SETTINGS = {
    "host": dict(tiers="host", min_bytes=0, host_bytes=1 << 30),
    "recompute": dict(tiers="host", min_bytes=0, policy="recompute", host_bytes=1 << 30),
    "nvme": dict(tiers="nvme", min_bytes=0, nvme_bytes=1 << 30),
    "split": dict(tiers="nvme", min_bytes=8192, nvme_bytes=1 << 30),  # small, kept, moved
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_figures_timings_and_gradients_match_between_the_paths(monkeypatch, nvme_dir,
                                                               setting):
    """The same step under both paths in one test, each from a fresh process state (the
    next step's round-trip plan is learned from measured times, which differ run to run):
    every figure, every timeline row (which storage, its size, whether its unpack was seen)
    and every gradient identical."""
    kw = dict(SETTINGS[setting])
    if kw["tiers"] == "nvme":
        kw["nvme_dir"] = nvme_dir
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    x = torch.randn(4, 16, 32)
    plain = nn.Sequential(Block(), Block())
    plain.load_state_dict(model.state_dict())
    plain(x).square().sum().backward()
    got = []
    for python in (False, True):
        if python:
            monkeypatch.setattr(records, "saved_bytes_meter", PySavedBytes)
        process.reset()
        model.zero_grad()
        _, stats, rows = _run(model, x, **kw)
        got.append((stats, rows, [p.grad.clone() for p in model.parameters()]))
    (core_stats, core_rows, core_grads), (py_stats, py_rows, py_grads) = got
    assert core_stats == py_stats
    assert core_rows == py_rows and len(core_rows) > 0
    for a, b, p in zip(core_grads, py_grads, plain.parameters()):
        assert torch.equal(a, b) and torch.equal(a, p.grad)


def test_records_die_with_their_saves_on_any_thread(path, nvme_dir):
    """Graphs dropped without backward, on another thread while this one saves: every
    record gives its space back, and the step ends with nothing left."""
    x = torch.randn(256, requires_grad=True)
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0) as ctx:
        ledger = ctx._step.ledger
        graphs = [(x * i).sin().cos() for i in range(1, 40)]
        assert ledger.live_records > 0

        def drop():
            while graphs:
                graphs.pop()

        dropper = threading.Thread(target=drop)
        dropper.start()
        kept = [(x * -i).tanh() for i in range(1, 40)]
        dropper.join()
        sum(k.sum() for k in kept).backward()
        assert ledger.live_records == 0
    assert ctx.stats.exit_nvme_used_bytes == 0


def test_retain_graph_unpacks_kept_and_moved_saves_again(path, nvme_dir):
    x = torch.randn(128, requires_grad=True)
    for kw in (dict(tiers="host"), dict(tiers="nvme", nvme_dir=nvme_dir)):
        with offload.activations(min_bytes=0, **kw):
            y = (x * 2).sin().exp().sum()
        y.backward(retain_graph=True)
        first = x.grad.clone()
        y.backward()
        assert torch.equal(x.grad, 2 * first)
        x.grad = None


def test_each_backward_of_a_step_that_only_keeps_marks_its_start_and_end(path):
    """Backward marks come from kept saves too (a CPU step on the host tier keeps every
    storage resident): the step ends at the end of its backward, once per backward."""
    x = torch.randn(64, requires_grad=True)
    with offload.activations(tiers="host", min_bytes=0) as ctx:
        y = (x * 2).sin().exp().sum()
    step = ctx._step
    marks = step.hooks.marks
    assert marks.first_unpack_s is None and not step._finished
    ended = []
    callback = marks.on_backward_end
    marks.on_backward_end = lambda: ended.append(1) or callback()
    y.backward(retain_graph=True)
    assert marks.first_unpack_s is not None and ended == [1]
    y.backward()
    assert ended == [1, 1] and step._finished


def test_an_end_of_backward_callback_set_during_a_backward_is_still_queued(path):
    """The core's Unpacker marks a backward again when the hooks' callback changes within
    it (not only when a new backward starts): the same as the Python path."""
    x = torch.randn(64, requires_grad=True)
    ended = []

    class SetsCallback(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            marks.on_backward_end = lambda: ended.append(1)
            return grad

    with offload.activations(tiers="host", min_bytes=0) as ctx:
        marks = ctx._step.hooks.marks
        a = (x * 2).sin()                 # sin's saved input: unpacked after the change
        b = SetsCallback.apply(a).exp()   # exp's saved output: unpacked before it
        b.sum().backward()
        assert ended == [1]
        marks.on_backward_end = None
