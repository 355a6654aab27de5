"""Chrome-trace recorder: valid JSON, well-formed and nested events, no-op when disabled,
atomic writes, thread safety."""
from __future__ import annotations

import json
import os
import threading

import pytest

from offload.util import trace
from offload.util.trace import NULL_RECORDER, TraceRecorder


class FakeClock:
    """Deterministic clock: each call returns the current value; tests advance it."""

    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _x_events(doc):
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def _track_names(doc):
    return {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def test_span_and_add_produce_well_formed_complete_events():
    clock = FakeClock()
    rec = TraceRecorder(clock=clock)
    with rec.span("step", track="compute", step=3):
        clock.t += 0.001
        with rec.span("block 0", track="forward"):
            clock.t += 0.002
    rec.add("write 4096 B", "nvme write", 100.0005, 100.0025, args={"bytes": 4096})

    doc = json.loads(json.dumps(rec.to_dict()))   # JSON-serializable as is
    events = _x_events(doc)
    assert len(events) == 3
    for e in events:
        assert set(e) >= {"name", "cat", "ph", "ts", "dur", "pid", "tid"}
        assert e["dur"] >= 0 and e["ts"] >= 0
    by_name = {e["name"]: e for e in events}
    assert by_name["step"]["ts"] == 0 and by_name["step"]["dur"] == pytest.approx(3000)
    assert by_name["step"]["args"] == {"step": 3}
    assert by_name["block 0"]["ts"] == pytest.approx(1000)
    assert by_name["write 4096 B"]["args"] == {"bytes": 4096}
    names = _track_names(doc)
    assert names[by_name["step"]["tid"]] == "compute"
    assert names[by_name["block 0"]["tid"]] == "forward"
    assert names[by_name["write 4096 B"]["tid"]] == "nvme write"
    procs = [e for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert procs[0]["args"]["name"] == "offload"


def test_known_tracks_come_first_in_fixed_order():
    rec = TraceRecorder(clock=FakeClock())
    for track in ("zzz custom", "stall", "h2d", "forward"):
        rec.add(track, track, 100.0, 100.1)
    names = _track_names(rec.to_dict())
    assert [names[t] for t in sorted(names)] == ["forward", "h2d", "stall", "zzz custom"]


def test_nested_spans_stay_on_one_lane_and_nest():
    clock = FakeClock()
    rec = TraceRecorder(clock=clock)
    with rec.span("outer", track="backward"):
        for i in range(3):
            clock.t += 0.001
            with rec.span(f"inner {i}", track="backward"):
                clock.t += 0.001
        clock.t += 0.001
    doc = rec.to_dict()
    events = _x_events(doc)
    assert len({e["tid"] for e in events}) == 1
    outer = next(e for e in events if e["name"] == "outer")
    for e in events:
        assert outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + 1e-6


def test_overlapping_io_events_are_spread_over_lanes_that_nest():
    rec = TraceRecorder(clock=FakeClock(0.0))
    # four workers writing at once, partly overlapping
    spans = [(0.0, 1.0), (0.5, 1.5), (0.6, 0.9), (1.2, 2.0), (0.1, 0.2)]
    for i, (a, b) in enumerate(spans):
        rec.add(f"w{i}", "nvme write", a, b)
    doc = rec.to_dict()
    lanes: dict[int, list] = {}
    for e in _x_events(doc):
        lanes.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    assert len(_x_events(doc)) == len(spans)
    assert len(lanes) >= 2
    names = _track_names(doc)
    assert sorted(names[t] for t in lanes)[0] == "nvme write"
    assert all(names[t].startswith("nvme write") for t in lanes)
    for intervals in lanes.values():   # every pair in a lane is disjoint or nested
        for a0, a1 in intervals:
            for b0, b1 in intervals:
                disjoint = a1 <= b0 or b1 <= a0
                nested = (a0 <= b0 and b1 <= a1) or (b0 <= a0 and a1 <= b1)
                assert disjoint or nested


def test_span_records_even_when_body_raises():
    rec = TraceRecorder(clock=FakeClock())
    with pytest.raises(KeyError):
        with rec.span("failing", track="compute"):
            raise KeyError("x")
    assert [e["name"] for e in _x_events(rec.to_dict())] == ["failing"]


def test_negative_duration_is_clamped_to_zero():
    rec = TraceRecorder(clock=FakeClock(0.0))
    rec.add("skewed", "d2h", 2.0, 1.999999)
    (e,) = _x_events(rec.to_dict())
    assert e["dur"] == 0


def test_counters_are_chrome_counter_events():
    rec = TraceRecorder(clock=FakeClock(0.0))
    rec.counter("in flight", {"d2h": 3, "h2d": 1}, t_s=0.5)
    (c,) = [e for e in rec.to_dict()["traceEvents"] if e["ph"] == "C"]
    assert c["args"] == {"d2h": 3, "h2d": 1} and c["ts"] == pytest.approx(5e5)


def test_add_is_thread_safe():
    rec = TraceRecorder()

    def worker(k):
        for i in range(500):
            t = rec.now()
            rec.add(f"{k}:{i}", "nvme read", t, t + 1e-6)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(rec) == 4000
    assert len({e["name"] for e in _x_events(rec.to_dict())}) == 4000


def test_write_is_valid_json_and_atomic(tmp_path):
    rec = TraceRecorder(clock=FakeClock())
    rec.add("copy", "d2h", 100.0, 100.001)
    path = tmp_path / "step.json"
    assert rec.write(path) == str(path)
    assert json.loads(path.read_text())["traceEvents"]
    assert os.listdir(tmp_path) == ["step.json"]   # no temporary file left behind


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "step.json"
    path.write_text("old")
    rec = TraceRecorder(clock=FakeClock())
    rec.add("copy", "d2h", 100.0, 100.001)

    def broken_replace(src, dst):
        # the temp file must be complete, in the target's directory, before the rename
        assert os.path.dirname(src) == str(tmp_path)
        json.loads(open(src).read())
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trace.os, "replace", broken_replace)
    with pytest.raises(OSError, match="No space left"):
        rec.write(path)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["step.json"]


def test_disabled_recorder_is_a_noop(tmp_path):
    rec = NULL_RECORDER
    assert not rec.enabled
    s1 = rec.span("a", track="forward", x=1)
    s2 = rec.span("b")
    assert s1 is s2                      # nothing allocated per span
    with s1:
        pass
    rec.add("x", "d2h", 0.0, 1.0)
    rec.counter("q", {"d2h": 1})
    assert len(rec) == 0
    assert rec.to_dict() == {"traceEvents": [], "displayTimeUnit": "ms"}
    assert rec.write(tmp_path / "never.json") is None
    assert os.listdir(tmp_path) == []
