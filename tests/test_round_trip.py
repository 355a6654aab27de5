"""Round-trip decisions (keep what would not pay off) from measured timings (pure logic, CPU)."""
from __future__ import annotations

import math
import random

import pytest

from offload._ext import core_available, load_core
from offload.runtime.round_trip import LinkSpeed, TensorTiming, free_windows, keep_on_device, pays_off

MiB = 1 << 20


def _step(n_layers=16, nbytes=64 * MiB, fwd_layer_s=0.0005, bwd_layer_s=0.001):
    """One tensor per layer: forward packs in order, backward unpacks in reverse."""
    fwd_end = n_layers * fwd_layer_s
    return [TensorTiming(key=i, nbytes=nbytes, pack_s=(i + 1) * fwd_layer_s,
                         unpack_s=fwd_end + (n_layers - 1 - i) * bwd_layer_s)
            for i in range(n_layers)]


def test_pays_off_needs_the_round_trip_to_fit_with_margin():
    assert pays_off(gap_s=1.0, out_s=0.1, in_s=0.1)
    assert not pays_off(gap_s=0.25, out_s=0.1, in_s=0.1)      # fits once, not 1.5 times
    assert pays_off(gap_s=0.25, out_s=0.1, in_s=0.1, safety=1.0)
    assert not pays_off(gap_s=1.0, out_s=0.1, in_s=0.1, min_free_s=0.9)


def test_idle_link_window_matches_pays_off():
    link = LinkSpeed(out_bytes_per_s=1e9, in_bytes_per_s=2e9, latency_s=1e-5)
    t = TensorTiming("a", 10 * MiB, pack_s=1.0, unpack_s=1.05)
    done_s, start_s = free_windows([t], link)["a"]
    assert done_s == pytest.approx(1.0 + link.out_s(t.nbytes))
    assert start_s == pytest.approx(1.05 - link.in_s(t.nbytes))
    alone = pays_off(0.05, link.out_s(t.nbytes), link.in_s(t.nbytes))
    assert (keep_on_device([t], link) == set()) == alone


def test_copies_queue_behind_each_other():
    link = LinkSpeed(out_bytes_per_s=1e9, in_bytes_per_s=1e9)
    a = TensorTiming("a", 10**9, pack_s=0.0, unpack_s=10.0)
    b = TensorTiming("b", 10**9, pack_s=0.0, unpack_s=10.0)
    w = free_windows([a, b], link)
    assert sorted(v[0] for v in w.values()) == pytest.approx([1.0, 2.0])   # out: serial
    assert sorted(v[1] for v in w.values()) == pytest.approx([8.0, 9.0])   # in: serial, just in time


def test_end_of_forward_stays_and_the_rest_moves():
    link = LinkSpeed(out_bytes_per_s=50e9, in_bytes_per_s=50e9, latency_s=10e-6)
    timings = _step()
    keep = keep_on_device(timings, link)
    assert keep, "the last layers' tensors are needed almost at once: they must stay"
    assert keep == set(range(16 - len(keep), 16)), "kept tensors are the end of the forward"
    assert len(keep) < 16
    # A faster link bounces less; a very slow one keeps everything.
    fast = keep_on_device(timings, LinkSpeed(500e9, 500e9, 10e-6))
    assert len(fast) < len(keep)
    slow = keep_on_device(timings, LinkSpeed(1e8, 1e8))
    assert slow == set(range(16))


def test_tensor_never_unpacked_always_moves():
    link = LinkSpeed(1e9, 1e9)
    t = TensorTiming("unused", 10 * MiB, pack_s=0.0, unpack_s=None)
    assert free_windows([t], link)["unused"][1] == math.inf
    assert keep_on_device([t], link) == set()


@pytest.mark.parametrize("seed", range(20))
def test_every_tensor_still_moved_passes_in_the_final_simulation(seed):
    rng = random.Random(seed)
    timings = []
    for i in range(rng.randint(1, 60)):
        pack = rng.uniform(0, 1)
        unpack = None if rng.random() < 0.1 else pack + rng.uniform(0, 1)
        timings.append(TensorTiming(i, rng.randint(1, 256 * MiB), pack, unpack))
    link = LinkSpeed(rng.uniform(1e9, 60e9), rng.uniform(1e9, 60e9), rng.uniform(0, 1e-4))
    keep = keep_on_device(timings, link)
    moved = [t for t in timings if t.key not in keep]
    windows = free_windows(moved, link)
    for t in moved:
        done_s, start_s = windows[t.key]
        assert start_s - done_s >= 0.5 * (link.out_s(t.nbytes) + link.in_s(t.nbytes)) - 1e-12


@pytest.mark.parametrize("field,value", [("out_bytes_per_s", 0), ("in_bytes_per_s", -1.0),
                                         ("out_bytes_per_s", math.nan)])
def test_link_speed_rejects_non_positive_bandwidth(field, value):
    kwargs = {"out_bytes_per_s": 1e9, "in_bytes_per_s": 1e9, field: value}
    with pytest.raises(ValueError, match=f"LinkSpeed.{field}=.*positive, finite"):
        LinkSpeed(**kwargs)


def test_link_speed_rejects_negative_latency():
    with pytest.raises(ValueError, match=r"LinkSpeed.latency_s=-1: must be >= 0"):
        LinkSpeed(1e9, 1e9, latency_s=-1)


def test_safety_below_one_is_rejected():
    with pytest.raises(ValueError, match=r"safety=0.5: must be >= 1"):
        pays_off(1.0, 0.1, 0.1, safety=0.5)
    with pytest.raises(ValueError, match=r"safety=0.9: must be >= 1"):
        keep_on_device([], LinkSpeed(1e9, 1e9), safety=0.9)
    for timeline in _timelines():   # both timelines' plan refuse it alike
        with pytest.raises(ValueError, match=r"safety=0.75: must be >= 1"):
            timeline.round_trip_keep(1e9, 1e9, 0.0, 0.75, 0.1)


# --- The step end learns from columns (round_trip._Columns): it must decide exactly what the
# plain per-object simulation below decides (the algorithm as first written: one dict per
# round, sorted again each round), ties and never-unpacked tensors included.

def _reference_windows(items, link):
    out_done, busy_until = {}, -math.inf
    for t in sorted(items, key=lambda t: t.pack_s):
        start = max(t.pack_s, busy_until)
        busy_until = out_done[t.key] = start + link.out_s(t.nbytes)
    free_from, in_start = math.inf, {}
    for t in sorted(items, key=lambda t: -math.inf if t.unpack_s is None else t.unpack_s,
                    reverse=True):
        if t.unpack_s is None:
            in_start[t.key] = math.inf
            continue
        finish = min(t.unpack_s, free_from)
        free_from = in_start[t.key] = finish - link.in_s(t.nbytes)
    return {t.key: (out_done[t.key], in_start[t.key]) for t in items}


def _reference_keep(timings, link, safety=1.5):
    gap = lambda t: math.inf if t.unpack_s is None else t.unpack_s - t.pack_s  # noqa: E731
    moving, keep = {t.key: t for t in timings}, set()
    while moving:
        windows = _reference_windows(list(moving.values()), link)
        failing = [t for key, t in moving.items() if windows[key][1] - windows[key][0]
                   < (safety - 1.0) * (link.out_s(t.nbytes) + link.in_s(t.nbytes))]
        if not failing:
            break
        failing.sort(key=gap)
        for t in failing[:max(1, len(failing) // 2)]:
            keep.add(t.key)
            del moving[t.key]
    return keep, gap


def _timelines():
    """A new Python timeline, and the core's when it is built."""
    from offload.runtime.timeline import PyTimeline

    return [PyTimeline()] + ([load_core().Timeline()] if core_available() else [])


def _random_step(rng, n):
    # Coarse grids make ties in pack, unpack and gap common; some never come back.
    return [TensorTiming(key=(i, nb), nbytes=nb, pack_s=rng.randrange(50) * 1e-3,
                         unpack_s=None if rng.random() < 0.1 else 0.05 + rng.randrange(50) * 1e-3)
            for i in range(n) for nb in [rng.choice((1, 2, 4, 8)) * MiB]]


@pytest.mark.parametrize("seed", range(40))
def test_column_engine_decides_as_the_per_object_simulation(seed):
    from offload.runtime.round_trip import RoundTripPlan

    rng = random.Random(seed)
    timings = _random_step(rng, rng.randrange(1, 120))
    link = LinkSpeed(rng.choice((0.2e9, 1e9, 5e9)), rng.choice((0.2e9, 1e9, 5e9)),
                     rng.choice((0.0, 1e-5)))
    assert free_windows(timings, link) == _reference_windows(timings, link)
    keep, gap = _reference_keep(timings, link)
    assert keep_on_device(timings, link) == keep
    # The plan's cap: shortest gaps first (ties: the earlier tensor), skipping what does
    # not fit; from TensorTimings and from a timeline's columns alike.
    fraction = rng.choice((0.1, 0.3, 1.0))
    budget, chosen, total = fraction * sum(t.nbytes for t in timings), set(), 0
    for t in sorted((t for t in timings if t.key in keep), key=gap):
        if total + t.nbytes <= budget:
            chosen.add(t.key)
            total += t.nbytes
    plan = RoundTripPlan(max_fraction=fraction)
    plan.learn(timings, link)
    assert plan.keep == chosen
    # From a step's Timeline: the Python one (choose_kept over its columns) and the core's
    # (csrc/round_trip.cpp, in C++), which must choose the very same rows.
    for timeline in _timelines():
        for t in timings:
            row = timeline.add(t.key[0], t.nbytes, t.pack_s)
            if t.unpack_s is not None:
                timeline.unpacked(row, t.unpack_s)
        from_timeline = RoundTripPlan(max_fraction=fraction)
        from_timeline.learn_timeline(timeline, link)
        assert from_timeline.keep == chosen, type(timeline)


@pytest.mark.skipif(not core_available(), reason="the compiled core is not built")
def test_the_cores_round_trip_plan_chooses_the_pythons_rows():
    # csrc/round_trip.cpp against choose_kept, on many steps where ties decide: coarse time
    # grids, few sizes, caps that bind, safeties from 1 up, a latency, rows never unpacked.
    from offload.runtime.round_trip import choose_kept

    rng = random.Random(1234)
    for _ in range(400):
        n = rng.randrange(1, 200)
        timings = _random_step(rng, n)
        link = LinkSpeed(rng.choice((0.1e9, 1e9, 7e9)), rng.choice((0.1e9, 1e9, 7e9)),
                         rng.choice((0.0, 1e-5, 3e-4)))
        safety = rng.choice((1.0, 1.25, 1.5, 3.0))
        fraction = rng.choice((0.01, 0.05, 0.1, 0.5, 1.0))
        python, core = _timelines()
        for timeline in (python, core):
            for t in timings:
                row = timeline.add(t.key[0], t.nbytes, t.pack_s)
                if t.unpack_s is not None:
                    timeline.unpacked(row, t.unpack_s)
        expected = choose_kept(*python.columns(), link, safety, fraction)
        assert core.round_trip_keep(link.out_bytes_per_s, link.in_bytes_per_s, link.latency_s,
                                    safety, fraction) == expected
        assert python.round_trip_keep(link.out_bytes_per_s, link.in_bytes_per_s,
                                      link.latency_s, safety, fraction) == expected
