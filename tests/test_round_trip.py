"""Round-trip decisions (keep what would not pay off) from measured timings (pure logic, CPU)."""
from __future__ import annotations

import math
import random

import pytest

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
