"""Pipeline telemetry: stall / overlap / queue depths in ctx.stats, and OFFLOAD_TRACE."""
from __future__ import annotations

import json
import logging
import os

import pytest
import torch
import torch.nn as nn

import offload
from offload.config import Config, env_table_markdown
from offload.errors import ConfigError
from offload.util.stats import Stats


def _model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)])


def _step(model, **settings):
    x = torch.randn(512, 256)
    with offload.activations(model=model, **settings) as ctx:
        model(x).pow(2).mean().backward()
    return ctx


def _events(doc, track_prefix):
    names = {ev["tid"]: ev["args"]["name"] for ev in doc["traceEvents"]
             if ev.get("name") == "thread_name"}
    return [ev for ev in doc["traceEvents"] if ev.get("ph") == "X"
            and names[ev["tid"]].startswith(track_prefix)]


def test_trace_of_a_cpu_nvme_step_has_compute_io_and_stall_events(tmp_path, nvme_dir,
                                                                  monkeypatch):
    path = tmp_path / "step.json"
    monkeypatch.setenv("OFFLOAD_TRACE", str(path))
    # A tiny staging arena forces the forward to wait for writes: stall events must appear.
    ctx = _step(_model(), tiers="nvme", nvme_dir=nvme_dir, min_bytes=0,
                staging_bytes="1MiB", prefetch_bytes="512KiB")
    doc = json.loads(path.read_text())
    writes, reads = _events(doc, "nvme write"), _events(doc, "nvme read")
    assert len(writes) == len(reads) > 0
    assert sum(ev["args"]["bytes"] for ev in writes) == ctx.stats.nvme_written_bytes
    assert sum(ev["args"]["bytes"] for ev in reads) == ctx.stats.nvme_read_bytes
    stalls = _events(doc, "stall")
    assert stalls and all(ev["dur"] >= 0 for ev in stalls)
    assert sum(ev["dur"] for ev in stalls) == pytest.approx(ctx.stats.stall_s * 1e6, rel=1e-3,
                                                            abs=5)
    (fwd,), (bwd,) = _events(doc, "forward"), _events(doc, "backward")
    assert fwd["ts"] + fwd["dur"] <= bwd["ts"] + 1e-3
    # Every write goes to the disk before the first read (a batch still waiting when the
    # backward starts goes then: its span starts there), every read in the backward.
    first_read = min(ev["ts"] for ev in reads)
    assert all(ev["ts"] <= first_read for ev in writes)
    assert any(ev["ts"] < bwd["ts"] for ev in writes)   # (staging: some in the forward)
    assert all(ev["ts"] >= bwd["ts"] - 1e-3 for ev in reads)


def test_trace_is_written_when_backward_runs_after_the_block(tmp_path, nvme_dir):
    path = tmp_path / "late.json"
    model = _model()
    x = torch.randn(512, 256)
    with offload.activations(model=model, tiers="nvme", nvme_dir=nvme_dir, min_bytes=0,
                             trace=str(path)):
        loss = model(x).pow(2).mean()
    assert not path.exists()  # the step is not over: backward has not run
    loss.backward()
    del loss
    doc = json.loads(path.read_text())
    assert _events(doc, "backward") and _events(doc, "nvme read")


def test_a_step_whose_backward_runs_after_the_block_ends_with_that_backward(nvme_dir, caplog):
    """README: "the step then ends when that backward finishes". Its `step_s` covers the
    backward (it covered the forward alone: `stall_fraction` read over 1 with a backward
    stall), and its INFO line comes when the backward ends, with those figures."""
    import time

    model = _model()
    x = torch.randn(512, 256)
    with caplog.at_level(logging.INFO, logger="offload"):
        with offload.activations(model=model, tiers="nvme", nvme_dir=nvme_dir,
                                 min_bytes=0) as ctx:
            loss = model(x).pow(2).mean()
        forward_s = ctx.stats.step_s
        assert not [r for r in caplog.records if "stall" in r.getMessage()]  # not over yet
        time.sleep(0.3)   # between the block and its backward: part of the step
        loss.backward()
        del loss
    s = ctx.stats
    assert s.step_s >= forward_s + 0.3
    assert s.stall_fraction <= 1.0
    (line,) = [r.getMessage() for r in caplog.records if "stall" in r.getMessage()]
    assert f"of {s.step_s:.3f} s" in line


def test_a_step_whose_graph_dies_without_backward_keeps_the_blocks_time(nvme_dir):
    """No backward: the step's time is the block's, however long its graph lives on."""
    import time

    model = _model()
    with offload.activations(model=model, tiers="nvme", nvme_dir=nvme_dir,
                             min_bytes=0) as ctx:
        loss = model(torch.randn(512, 256)).pow(2).mean()
    block_s = ctx.stats.step_s
    time.sleep(0.3)
    del loss
    offload.empty_cache()   # finishes steps whose saved tensors are gone
    assert ctx.stats.step_s == block_s


def test_stats_report_overlap_and_queue_depths(nvme_dir):
    ctx = _step(_model(), tiers="nvme", nvme_dir=nvme_dir, min_bytes=0)
    s = ctx.stats.as_dict()
    assert s["peak_writes_inflight"] >= 1 and s["peak_reads_inflight"] >= 1
    assert s["io_busy_s"] > 0
    assert 0.0 <= s["overlap_fraction"] <= 1.0
    assert s["stall_fraction"] == pytest.approx(s["stall_s"] / s["step_s"], rel=1e-3, abs=1e-4)


def test_a_batched_write_is_timed_from_its_submission_not_its_pack(nvme_dir):
    """A helper's find: a direct write's span started when it joined the batch (NOTE [Write
    batches]), so the compute a batch waited through counted as disk time: three 1 MiB
    saves 0.3 s apart read io_busy_s 0.61 s of a 0.9 s forward and nvme_write_gbps 0.0034
    GB/s of a 2.7 GB/s disk (and the round-trip plan learns the link from that figure).
    The span starts when the batch goes to the engine now."""
    import time as time_mod

    x = torch.randn(256, 1024, requires_grad=True)      # 1 MiB
    ctx = offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0)
    with ctx:
        y = x
        for _ in range(3):
            y = y.sin()              # saves its input (1 MiB): batched, under 4 MiB
            time_mod.sleep(0.3)      # compute between saves
        y.sum().backward()
    stats = ctx.stats
    assert stats.nvme_written_bytes >= 2 << 20   # (x is a leaf: never moved)
    assert stats.io_busy_s < 0.25, stats.io_busy_s   # no sleep in it: 0.61 s before
    ctx.close()


def test_a_tiers_figures_by_a_name_no_tier_has_are_an_error_not_zeros(nvme_dir):
    ctx = _step(_model(), tiers="nvme", nvme_dir=nvme_dir, min_bytes=0)
    assert ctx.stats.tier("nvme").bytes > 0
    assert ctx.stats.tier("host").bytes == 0   # a tier not in use: its figures are zero
    with pytest.raises(KeyError, match=r"no tier is called 'nvm': the tiers are 'host', 'nvme'"):
        ctx.stats.tier("nvm")
    assert "nvm" not in ctx.stats.tiers


def test_overlap_fraction_is_the_share_of_io_time_not_stalled():
    stats = Stats()
    stats.write_clock.add_interval(0.0, 2.0)
    stats.read_clock.add_interval(1.0, 4.0)   # union: 4 s busy
    stats.add_stall(1.0, backward=True)
    assert stats.io_busy_s == pytest.approx(4.0)
    assert stats.overlap_fraction == pytest.approx(0.75)
    assert Stats().overlap_fraction == 1.0


def test_no_trace_file_without_the_setting(tmp_path, nvme_dir, monkeypatch):
    monkeypatch.delenv("OFFLOAD_TRACE", raising=False)
    monkeypatch.chdir(tmp_path)
    ctx = _step(_model(), tiers="nvme", nvme_dir=nvme_dir)
    assert not ctx.stats.trace.enabled
    assert os.listdir(tmp_path) == []


def test_trace_setting_is_in_the_env_table():
    assert "`OFFLOAD_TRACE`" in env_table_markdown()


def test_trace_directory_must_exist(tmp_path):
    missing = tmp_path / "nope" / "t.json"
    with pytest.raises(ConfigError, match=r"OFFLOAD_TRACE='.*t.json': directory '.*nope' does "
                                          r"not exist \(point it at a file.*unset OFFLOAD_TRACE"):
        Config.from_env(env={"OFFLOAD_TRACE": str(missing)}).validate()


def test_trace_path_may_not_be_a_directory(tmp_path):
    # Given as a keyword, the fix names the keyword (it said "unset OFFLOAD_TRACE").
    with pytest.raises(ConfigError, match=r"trace='.*': '.*' is a directory \(point it at a "
                                          r"file in an existing, writable directory, or leave "
                                          r"trace= out\)"):
        offload.activations(trace=str(tmp_path))


def test_a_trace_that_cannot_be_written_is_said_with_its_setting(tmp_path, caplog):
    """The step goes through; the warning names the setting as it was given (a keyword
    here: it said "(OFFLOAD_TRACE)" whatever the source)."""
    sub = tmp_path / "gone"
    sub.mkdir()
    ctx = offload.activations(trace=str(sub / "t.json"), min_bytes=0)
    sub.rmdir()   # after the build's check: the write fails at the step's end
    x = torch.randn(64, 64, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="offload"), ctx:
        (x @ x).sin().sum().backward()
    said = [r.getMessage() for r in caplog.records if "could not write the trace" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(f"(trace={str(sub / 't.json')!r})"), said
    assert x.grad is not None


def test_cpu_nvme_step_moves_tensors_in_place(nvme_dir):
    # NOTE [Phase] (tiers/nvme.py): only the partial sectors at the two ends of a transfer
    # may go through a bounce buffer, never whole tensors of this size (that would be a
    # hidden copy of every byte on the engine threads); the biases (1 KiB) may, when their
    # writes queue beside a neighbour's (csrc/io_engine.cpp NOTE [Small chunks ...]).
    ctx = _step(_model(), tiers="nvme", nvme_dir=nvme_dir, min_bytes=0)
    s = ctx.stats
    assert s.nvme_written_bytes == s.nvme_read_bytes > 0
    assert s.nvme_bounced_bytes <= 2 * 2 * 4095 * s.offloaded_tensors
    assert s.nvme_bounced_bytes < 0.05 * s.nvme_written_bytes


def test_heap_settings_are_held_only_while_a_cpu_nvme_step_runs(nvme_dir):
    from offload.tiers.heap import HeapSettings

    model, x = _model(), torch.randn(512, 256)
    with offload.activations(model=model, tiers="nvme", nvme_dir=nvme_dir, min_bytes=0):
        loss = model(x).pow(2).mean()
        assert HeapSettings.active()
        loss.backward()
    assert not HeapSettings.active()
    with offload.activations(model=model, tiers="host", min_bytes=0):
        model(x).pow(2).mean().backward()
        assert not HeapSettings.active()  # nothing streams out on the host tier


@pytest.mark.parametrize("mode", ["reuse", "release"])
def test_cpu_heap_mode_reaches_the_heap_settings_and_grads_stay_exact(nvme_dir, mode):
    from offload.tiers.heap import HeapSettings

    model = _model()
    torch.manual_seed(1)
    model(torch.randn(512, 256)).pow(2).mean().backward()   # the input _step draws
    ref = [p.grad.clone() for p in model.parameters()]
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    seen = []
    acquire = HeapSettings.acquire

    def spy(self):
        seen.append(self.mode)
        acquire(self)

    import unittest.mock
    with unittest.mock.patch.object(HeapSettings, "acquire", spy):
        _step(model, tiers="nvme", nvme_dir=nvme_dir, min_bytes=0, cpu_heap=mode)
    assert seen and set(seen) == {mode}
    assert all(torch.equal(a, p.grad) for a, p in zip(ref, model.parameters()))


def test_a_cpu_nvme_step_without_torch_thp_says_so_once(monkeypatch, caplog):
    from offload.tiers.heap import HeapSettings, torch_thp_enabled

    monkeypatch.setattr(HeapSettings, "_thp_hinted", False)
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    assert torch_thp_enabled()
    with caplog.at_level(logging.INFO, logger="offload"):
        for _ in range(2):
            h = HeapSettings("reuse")
            h.acquire()
            h.release()
    assert not [r for r in caplog.records if "THP_MEM_ALLOC_ENABLE" in r.getMessage()]
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE")
    assert not torch_thp_enabled()
    with caplog.at_level(logging.INFO, logger="offload"):
        for _ in range(2):
            h = HeapSettings("reuse")
            h.acquire()
            h.release()
    hints = [r for r in caplog.records if "THP_MEM_ALLOC_ENABLE=1" in r.getMessage()]
    assert len(hints) == 1 and hints[0].levelno == logging.INFO


def test_the_info_line_names_the_nvme_rates_only_with_an_nvme_tier(nvme_dir):
    """`tiers=host` printed "nvme w/r 0.00/0.00 GB/s" every step."""
    x = torch.randn(256, 256, requires_grad=True)
    lines = {}
    for tiers in ("host", "host,nvme", "nvme"):
        with offload.activations(tiers=tiers, nvme_dir=nvme_dir, min_bytes=0) as ctx:
            (x * 2).tanh().sum().backward()
        lines[tiers] = ctx.stats.summary()
    assert "nvme" not in lines["host"], lines["host"]
    assert "nvme w/r" in lines["host,nvme"] and "nvme capacity" in lines["host,nvme"]
    # A CPU host tier holds the storages themselves: no transfer, so nothing was hidden (it
    # said "100% of I/O hidden"); the nvme tier's I/O is.
    assert "(no I/O)" in lines["host"] and "of I/O hidden" not in lines["host"]
    assert "of I/O hidden" in lines["nvme"] and "(no I/O)" not in lines["nvme"], lines["nvme"]


def test_the_info_line_on_stderr_names_offload_once():
    """Without a handler of the application's, OFFLOAD_LOG=INFO attaches one to stderr; it
    printed "offload INFO: offload: saved ..." (the logger's name before a message that
    begins with it)."""
    import subprocess
    import sys
    code = ("import torch, offload\n"
            "x = torch.randn(64, 64, requires_grad=True)\n"
            "with offload.activations(tiers='host', min_bytes=0):\n"
            "    (x * 2).tanh().sum().backward()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "OFFLOAD_LOG": "INFO"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stderr.splitlines() if "saved " in x)
    assert line.startswith("INFO: offload: saved "), line


def test_design_doc_explains_every_stats_field():
    """docs/design.md *Telemetry* has one row per `as_dict()` field (README's Troubleshooting
    sends users there), and names no field that is gone."""
    import re

    import offload

    path = os.path.join(os.path.dirname(__file__), "..", "docs", "design.md")
    text = open(path, encoding="utf-8").read()
    section = text[text.index("## Telemetry\n"):]
    section = section[:section.index("\n## ", 1)]
    documented = set()
    for row in re.findall(r"^\| (`.*?) \|", section, re.M):
        documented.update(re.findall(r"`(\w+)`", row))
    fields = set(offload.Stats().as_dict())
    assert fields - documented == set(), "fields docs/design.md does not explain"
    assert documented - fields == set(), "docs/design.md explains fields Stats lacks"


def test_steps_alive_at_entry_counts_graphs_kept_across_steps():
    """README's Troubleshooting: RSS growing from step to step because saved tensors outlive
    their step shows here (exit_*_used_bytes cannot: the tiers close only once the step's
    stored tensors are freed)."""
    import gc

    gc.collect()   # an earlier test's graph in a reference cycle dies now, not in the loop
    x = torch.randn(256, 256, requires_grad=True)
    kept, seen = [], []
    for _ in range(3):
        with offload.activations(tiers="host", min_bytes=0) as ctx:
            kept.append((x * 2).sin().sum())
        seen.append(ctx.stats.steps_alive_at_entry)
    base = seen[0]   # 0, unless an earlier test of this process kept a graph
    assert seen == [base, base + 1, base + 2]
    torch.stack(kept).sum().backward()
    del kept
    with offload.activations(tiers="host", min_bytes=0) as ctx:
        (x * 2).sin().sum().backward()
    assert ctx.stats.steps_alive_at_entry == base
    assert ctx.stats.as_dict()["steps_alive_at_entry"] == base
