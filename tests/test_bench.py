"""offload-bench: end to end through the real CLI entry on a tiny GPT, the gradient check
catching a one-ulp corruption (in every step, or only an early one), memory kept between
steps counted, the RSS cross-check, buffered NVMe flagged, crash handling, cleanup,
--max-batch, `auto` timed only once its trial steps are done, argument and OFFLOAD_*
errors before the run. The test-only strategies come from a plugin
(tests/bench_test_strategies.py), never from the shipped CLI.

Each worker is a fresh Python process (importing torch costs seconds here), so the end-to-end
run happens once per module and several tests read its rows.
"""
from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import torch

from offload.bench import maxbatch, measure, report, rows as rows_mod
from offload.bench.cli import main
from offload.bench.result import RunResult
from offload.bench.rows import ROW_FIELDS, Row
from offload.bench.runner import GradChecker, Workspace
from offload.bench.strategies import PUBLIC_STRATEGIES

from mounts import mounted

MiB = 1 << 20
# Registered by a plugin each run names (importing it here would register them in this
# process for good, and the shipped CLI must not know them).
TEST_STRATEGIES = ["corrupt", "corrupt-early", "pooled-arena", "crash", "never-settles"]
PLUGIN = ["--plugin", os.path.join(os.path.dirname(__file__), "bench_test_strategies.py")]
ARENA_BYTES = 64 << 20  # bench_test_strategies.PooledArena's

TINY = ["--gpt", "hidden=64,layers=2,heads=2,vocab_size=128", "--seq", "32", "--batch", "2",
        "--warmup", "1", "--steps", "2"]


def _runtime_available() -> bool:
    try:
        import offload
    except Exception:
        return False
    return hasattr(offload, "activations")


def _workspaces() -> set[str]:
    """This process's benchmark workspaces (another test worker's run makes its own)."""
    tmp = tempfile.gettempdir()
    return {n for n in os.listdir(tmp) if n.startswith(f"offload-bench-{os.getpid()}-")}


@pytest.fixture(scope="module")
def bench_dirs():
    """A scratch area: the NVMe base (must be empty after the benchmark) and outputs."""
    root = tempfile.mkdtemp(prefix="offload-test-bench-", dir="/var/tmp")
    dirs = {"nvme": os.path.join(root, "nvme"), "root": root}
    os.mkdir(dirs["nvme"])
    yield dirs
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def e2e(bench_dirs):
    """One run of every strategy plus the test-only ones (TEST_STRATEGIES)."""
    out = os.path.join(bench_dirs["root"], "rows.json")
    plot = os.path.join(bench_dirs["root"], "plot.png")
    before = _workspaces()
    with pytest.MonkeyPatch.context() as mp:
        # Tiny tensors would stay put under the runtime's default threshold; the workers
        # must see the parent's environment (they fork from a server started earlier).
        mp.setenv("OFFLOAD_MIN_BYTES", "0")
        code = main(TINY + PLUGIN + [
            "--strategies", ",".join(PUBLIC_STRATEGIES + TEST_STRATEGIES),
            "--nvme-dir", bench_dirs["nvme"], "--json", out, "--plot", plot])
    with open(out) as f:
        text = f.read()
    rows = rows_mod.from_json(text)
    return {"code": code, "rows": {r.strategy: r for r in rows}, "order": rows, "json": text,
            "plot": plot, "dirs": bench_dirs, "new_workspaces": _workspaces() - before}


def test_every_field_for_every_strategy(e2e):
    assert [r.strategy for r in e2e["order"]] == PUBLIC_STRATEGIES + TEST_STRATEGIES
    doc = json.loads(e2e["json"])
    assert (doc["schema"], doc["schema_version"]) == ("offload-bench.rows", 1)
    for row, raw in zip(e2e["order"], doc["rows"]):
        assert list(raw) == list(ROW_FIELDS), row.strategy  # one schema: every field, in order
        assert isinstance(row.available, bool)
        assert row.available or row.reason, row.strategy


def test_baseline_and_peers_measured(e2e):
    rows = e2e["rows"]
    none, ckpt, hf = rows["none"], rows["checkpoint"], rows["ckpt+save_on_cpu"]
    for row in (none, ckpt, hf, rows["save_on_cpu"]):
        assert row.available, row.reason
        assert len(row.step_times_s) == 2 and row.step_s_min <= row.step_s_median
        assert row.peak_activation_source == "process rss"
        assert row.tokens_per_step == 2 * 32
        assert row.blocks == ["blocks.0", "blocks.1"]  # policy=recompute's blocks
    assert none.overhead_vs_none == 1.0
    # Accounting: checkpointing keeps less between forward and backward than plain autograd.
    assert 0 < ckpt.saved_bytes < none.saved_bytes == none.resident_bytes
    assert ckpt.resident_bytes < none.resident_bytes
    # Hugging Face's offload flag on a CPU: save_on_cpu keeps the very tensors, so it holds
    # what checkpoint holds.
    assert (hf.saved_bytes, hf.resident_bytes) == (ckpt.saved_bytes, ckpt.resident_bytes)
    for row in (ckpt, hf, rows["save_on_cpu"]):
        assert row.bit_exact is True and row.max_abs_diff == 0.0, row.strategy
        assert row.grads_differ_steps == []
        assert row.resident_check == "ok", (row.strategy, row.resident_check)
    assert none.bit_exact is None and none.grads_differ_steps is None  # the reference
    # Each row names where its resident bytes come from; the RSS growth agrees with them.
    assert none.resident_source == "saved-tensor hook (untimed pass)"
    assert "largest recomputed block" in ckpt.resident_source
    assert none.resident_check.startswith("reference")
    assert rows["torchtune"].available is False
    assert "needs a CUDA GPU" in rows["torchtune"].reason


def test_offload_rows(e2e):
    rows = e2e["rows"]
    if not _runtime_available():
        for name in ("offload-host", "offload-nvme", "auto"):
            assert rows[name].available is False
            assert "not implemented yet" in rows[name].reason
        pytest.skip("offload.activations() does not exist yet: rows say so")
    for name in ("offload-host", "offload-nvme"):
        row = rows[name]
        assert row.available, row.reason
        assert row.bit_exact is True, row.grads_differ
        assert row.saved_bytes > 0 and row.packed_tensors > 0
    nvme = rows["offload-nvme"]
    assert nvme.nvme_bytes > 0 and nvme.nvme_written_bytes >= nvme.nvme_bytes
    stats = nvme.runtime_stats
    assert stats["peak_resident_bytes"] < rows["none"].resident_bytes
    # On CPU the staging arena is RAM, so it counts as resident (see worker); the row has
    # the largest timed step (runtime_stats is the last one).
    assert nvme.resident_bytes >= stats["peak_resident_bytes"] + stats["staging_peak_bytes"]
    assert nvme.resident_source == "runtime peak_resident_bytes + staging arena peak"
    assert nvme.resident_check == "ok", nvme.rss_unexplained_bytes
    # /var/tmp is ext4: O_DIRECT, so no page cache hides written bytes from RSS.
    assert nvme.nvme_direct is True and rows["offload-host"].nvme_direct is None
    assert nvme.nvme_fs_types == ["ext4"] and nvme.nvme_in_ram is False
    # The pooled staging arena was dropped before the baseline (it held the warm-up's
    # pages) and its pages count again in the timed steps' peak.
    assert stats["staging_peak_bytes"] > 0
    assert nvme.pool_released_bytes > 0  # (the warm-up's arena use varies a little)
    assert nvme.peak_rss_delta_bytes >= stats["staging_peak_bytes"]
    # recompute: our checkpoint of the same blocks, their inputs to the tiers (nvme on CPU).
    rec = rows["recompute"]
    assert rec.available, rec.reason
    assert rec.bit_exact is True, rec.grads_differ
    assert rec.blocks == ["blocks.0", "blocks.1"] and rec.nvme_bytes > 0
    assert rec.resident_source == ("runtime peak_resident_bytes + staging arena peak + largest "
                                   "recomputed block (untimed pass)")
    assert rec.resident_bytes < rows["none"].resident_bytes
    auto = rows["auto"]
    assert auto.available, auto.reason
    assert auto.bit_exact is True, auto.grads_differ
    assert auto.resident_source == "runtime peak_resident_bytes + staging arena peak"


def test_gradient_check_catches_one_ulp(e2e):
    row = e2e["rows"]["corrupt"]
    assert row.available
    assert row.bit_exact is False
    assert 0 < row.max_abs_diff < 1e-6
    assert len(row.grads_differ) == 1
    assert row.grads_differ_steps == [0, 1]  # both timed steps


def test_gradient_check_covers_every_step(e2e):
    # Corrupted in the first timed step only; the last step (saved whole) is clean.
    row = e2e["rows"]["corrupt-early"]
    assert row.available
    assert row.bit_exact is False and row.grads_differ_steps == [0]
    assert row.max_abs_diff == 0.0  # the last step matches: only the checksums saw it
    assert row.grads_differ == e2e["rows"]["corrupt"].grads_differ


@pytest.mark.parametrize("ref, got, exact, diff", [
    ([1.0, float("nan")], [1.0, float("nan")], True, 0.0),   # NaN in both: the same bytes
    ([1.0, float("nan")], [1.0, 2.0], False, float("inf")),  # NaN on one side only
    ([1.0, 0.0], [1.0, -0.0], False, 0.0),                   # a zero's sign: other bits
    ([1.0, float("inf")], [1.0, float("inf")], True, 0.0),
    ([1.0, float("nan")], [1.5, float("nan")], False, 0.5),
    ([1 + 1j, 2j], [1 + 1j, 2.5j], False, 0.5),   # the imaginary part counts
])
def test_the_last_steps_gradients_compare_as_bytes(ref, got, exact, diff, tmp_path):
    """A model whose gradients hold NaN was "DIFF" against itself (`torch.equal` calls NaN
    unequal to NaN, while the per-step checksums agreed), with a max diff of 0 (Python's
    `max` with a NaN keeps the other figure) and no step to name."""
    for name, values in (("ref", ref), ("got", got)):
        torch.save({"w": torch.tensor(values), "none": None}, tmp_path / name)
    same, max_diff, differ = measure.compare_grads(str(tmp_path / "ref"), str(tmp_path / "got"))
    assert (same, max_diff, differ) == (exact, diff, [] if exact else ["w"])
    row = Row(strategy="offload", available=True, bit_exact=same, max_abs_diff=max_diff,
              grads_differ_steps=[])
    assert report._grads(row) == ("bit-exact" if exact else
                                  f"[bold red]DIFF[/] {diff:.2g}" if diff else
                                  "[bold red]DIFF[/] bits")


def test_memory_kept_between_steps_is_counted(e2e):
    # A 64 MiB arena pooled between steps like the runtime's staging arena: a baseline
    # taken with its warm-up pages resident would hide it (the peak was ~0 then).
    rows = e2e["rows"]
    row, none = rows["pooled-arena"], rows["none"]
    assert row.available, row.reason
    arena = ARENA_BYTES
    assert row.pool_released_bytes >= 0.9 * arena
    assert row.peak_rss_delta_bytes - none.peak_rss_delta_bytes >= 0.9 * arena
    # Its resident accounting (autograd's saved tensors) cannot see the arena: flagged.
    assert row.resident_check.startswith("RSS grew"), row.resident_check
    assert row.bit_exact is True


def test_crashed_worker_is_a_row_and_leaves_nothing(e2e):
    row = e2e["rows"]["crash"]
    assert row.available is False and row.error is True
    assert "killed by signal 9 (SIGKILL: out of memory, most likely)" in row.reason
    assert e2e["code"] == 1  # a failed strategy makes the exit status non-zero
    # The crash left a file in its NVMe directory; the parent removed it with the rest.
    assert os.listdir(e2e["dirs"]["nvme"]) == []
    assert e2e["new_workspaces"] == set()  # specs, results, logs, gradient files: all gone


def test_a_strategy_that_never_settles_is_timed_after_the_cap_and_said(e2e):
    from offload.bench.strategies import SETTLE_MAX_STEPS

    row = e2e["rows"]["never-settles"]
    assert row.available and len(row.step_times_s) == 2
    assert row.untimed_steps == 1 + SETTLE_MAX_STEPS  # --warmup 1, then the most it waits
    assert row.unsettled == "test only: never settles"
    assert (f"  never-settles: had not settled after {1 + SETTLE_MAX_STEPS} untimed steps "
            "(test only: never settles)") in "\n".join(report.footnotes(e2e["order"]))
    assert e2e["rows"]["none"].untimed_steps == 1 and e2e["rows"]["none"].unsettled is None


@pytest.mark.skipif(not _runtime_available(), reason="needs offload.activations()")
def test_auto_is_timed_once_its_trials_settle(tmp_path, nvme_dir, capsys):
    # Figures that make the plan move everything, as `offload` does: predicted alike, so
    # the plan's first steps are trials against offload (offload/schedule/trials.py); the
    # timed steps must come after them, all running the one strategy auto settled on.
    out = tmp_path / "rows.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OFFLOAD_MIN_BYTES", "0")
        mp.setenv("OFFLOAD_PROBE", "nvme_write_gbps=50,nvme_read_gbps=50,nvme_issue_s=1e-6,"
                                   "compute_gflops=1,dispatch_op_s=1e-3")
        code = main(TINY + ["--strategies", "auto", "--explain", "--nvme-dir", nvme_dir,
                            "--json", str(out)])
    assert code == 0
    auto = {r.strategy: r for r in rows_mod.from_json(out.read_text())}["auto"]
    assert auto.available, auto.reason
    assert "measured against the plan: offload" in auto.plan, auto.plan  # trials ran
    assert "trials still running" not in auto.plan, auto.plan
    assert auto.unsettled is None
    # warm-up, profile, then 2 rounds of the plan and at least offload
    assert auto.untimed_steps >= 1 + 1 + 2 * 2, auto.untimed_steps
    printed = capsys.readouterr().out
    assert f"  auto: timed after {auto.untimed_steps} untimed steps" in printed
    assert printed.count("auto plan:") == 1  # the plan's own first line, not a heading too


def test_plot_written(e2e):
    with open(e2e["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


ENC_DEC = """
import torch.nn as nn

class Layer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc, self.act = nn.Linear(d, d), nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x)) + x

class EncDec(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.ModuleList(Layer(16) for _ in range(2))
        self.dec = nn.ModuleList(Layer(16) for _ in range(3))
        self.head = nn.Sequential(nn.Linear(16, 8), nn.Tanh())

    def forward(self, x):
        for layer in [*self.enc, *self.dec]:
            x = layer(x)
        return self.head(x)

def build():
    return EncDec()
"""


def test_user_model_checkpoints_the_runtimes_blocks(tmp_path, nvme_dir, capsys):
    # Two stacks: policy="recompute" (offload/schedule/blocks.py) checkpoints both; the
    # bench's own detector used to take only the one with the most parameters (dec).
    (tmp_path / "mymodel.py").write_text(ENC_DEC)
    out = tmp_path / "rows.json"
    code = main(["--model", f"{tmp_path}/mymodel.py:build", "--input-shape", "16",
                 "--batch", "4", "--steps", "1", "--warmup", "1",
                 "--strategies", "checkpoint,recompute,ckpt+save_on_cpu",
                 "--nvme-dir", nvme_dir, "--json", str(out)])
    assert code == 0
    rows = {r.strategy: r for r in rows_mod.from_json(out.read_text())}
    assert rows["none"].tokens_per_step is None and rows["none"].samples_per_s > 0
    from offload.schedule.blocks import find_blocks
    from offload.bench.workload import block_names, load_factory

    model = load_factory(f"{tmp_path}/mymodel.py:build")()
    runtime = block_names(model, find_blocks(model))
    assert runtime == ["enc.0", "enc.1", "dec.0", "dec.1", "dec.2"]
    for name in ("checkpoint", "recompute", "ckpt+save_on_cpu"):
        row = rows[name]
        assert row.available and row.bit_exact is True, (name, row.reason)
        assert row.blocks == runtime, name
    printed = capsys.readouterr().out
    assert "GPT" not in printed
    assert "blocks (checkpointed by the checkpoint, recompute and ckpt+save_on_cpu rows; " \
           "policy=recompute's, offload/schedule/blocks.py): 5, enc.0 … dec.2" in printed
    # the build that produced the numbers: in the header and in every JSON row
    import offload
    from offload._build_info import summary

    info = offload.build_info()
    assert all(r.build == info for r in rows.values())
    assert printed.splitlines()[0] == summary(info)


def test_ctrl_c_after_some_runs_prints_and_writes_the_finished_ones(tmp_path, nvme_dir,
                                                                     monkeypatch, capsys):
    # Was: "interrupted" and nothing else, though two runs had finished and printed a line.
    from offload.bench import runner as runner_mod

    real_run, calls = runner_mod.WorkerRunner.run, []

    def run(self, spec, **kw):
        calls.append(spec.strategy)
        if len(calls) == 3:
            raise KeyboardInterrupt   # as if Ctrl-C came while the third worker ran
        return real_run(self, spec, **kw)

    monkeypatch.setattr(runner_mod.WorkerRunner, "run", run)
    before, out = _workspaces(), tmp_path / "rows.json"
    code = main(TINY + ["--strategies", "none,checkpoint,recompute", "--rounds", "2",
                        "--nvme-dir", nvme_dir, "--json", str(out)])
    assert code == 130
    assert calls == ["none", "checkpoint", "recompute"]
    rows = {r.strategy: r for r in rows_mod.from_json(out.read_text())}
    assert rows["none"].available and rows["none"].rounds == 1
    assert rows["checkpoint"].available and rows["checkpoint"].bit_exact is True
    assert rows["checkpoint"].rounds == 1
    assert not rows["recompute"].available
    assert rows["recompute"].reason == "interrupted before it ran"
    assert rows["recompute"].rounds == 0   # was 2, the rounds asked for
    captured = capsys.readouterr()
    assert "checkpoint" in captured.out and "interrupted before it ran" in captured.out
    assert "interrupted after 2 of 6 runs; the table holds the finished runs" in captured.err
    assert _workspaces() == before and os.listdir(nvme_dir) == []


def test_ctrl_c_during_max_batch_keeps_the_rows(tmp_path, nvme_dir, monkeypatch, capsys):
    # Review: every run had finished, and the table and --json were lost.
    from offload.bench import cli as cli_mod

    real_search, calls = maxbatch.search, []

    def search(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_search(*args, **kw)

    monkeypatch.setattr(cli_mod.maxbatch, "search", search)
    out = tmp_path / "rows.json"
    code = main(TINY + ["--steps", "1", "--strategies", "none,checkpoint", "--max-batch",
                        "--memory-limit", "3MiB", "--nvme-dir", nvme_dir, "--json", str(out)])
    assert code == 130
    rows = {r.strategy: r for r in rows_mod.from_json(out.read_text())}
    assert rows["none"].max_batch and rows["checkpoint"].max_batch is None
    assert rows["checkpoint"].available and rows["checkpoint"].bit_exact is True
    assert "interrupted during --max-batch (every run had finished)" in capsys.readouterr().err


def test_a_json_file_that_cannot_be_written_at_the_end_loses_no_row(tmp_path, nvme_dir,
                                                                     monkeypatch, capsys):
    """A --json path that passed the checks at the start but cannot be written at the end
    (a full disk, a directory made read-only meanwhile) ended a whole run in a traceback,
    the rows lost but for the printed table."""
    from offload.bench import report as report_mod

    def refuse(rows, path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(report_mod, "write_json", refuse)
    out = tmp_path / "rows.json"
    code = main(TINY + ["--steps", "1", "--strategies", "none", "--nvme-dir", nvme_dir,
                        "--json", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and not out.exists()
    line = next(x for x in err.splitlines() if "could not write --json" in x)
    assert "Permission denied" in line and "the rows are in " in line
    kept = line.split("the rows are in ")[1].strip()
    try:
        assert [r.strategy for r in rows_mod.from_json(open(kept).read())] == ["none"]
    finally:
        os.unlink(kept)


def test_ctrl_c_before_any_run_finished_prints_no_table(tmp_path, nvme_dir, monkeypatch,
                                                        capsys):
    from offload.bench import runner as runner_mod

    def run(self, spec, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner_mod.WorkerRunner, "run", run)
    before = _workspaces()
    assert main(TINY + ["--strategies", "none,checkpoint", "--nvme-dir", nvme_dir]) == 130
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "offload-bench: interrupted; temporary files removed" in captured.err
    assert _workspaces() == before and os.listdir(nvme_dir) == []


def test_gpt_given_twice_applies_both():
    """Before, argparse kept the last --gpt only: `--gpt hidden=32,layers=2 --gpt
    vocab_size=64` ran the default 512-wide, 8-layer model, saying nothing."""
    from offload.bench.cli import _resolve, build_parser

    parser = build_parser()
    args = parser.parse_args(["--device", "cpu", "--gpt", "hidden=32,layers=2,heads=2",
                              "--gpt", "vocab_size=64,layers=3"])
    assert _resolve(args, parser).model_label == "GPT h32 L3 heads2 vocab64"


def test_a_worker_started_after_its_parent_gave_up_exits_quietly(tmp_path):
    """Ctrl-C while the forkserver is starting the first worker (it imports torch for ~2 s):
    the parent removes its workspace, and the forkserver forks the worker after all.
    Before, it raised FileNotFoundError on its log file and printed the traceback into the
    user's terminal after offload-bench had said "interrupted"."""
    gone = tmp_path / "workspace"   # removed already
    script = ("from offload.bench.worker import child_entry\n"
              f"child_entry('{gone}/s.json', '{gone}/o.json', '{gone}/w.log', {{}})\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert (out.returncode, out.stderr) == (0, "")


def test_a_worker_whose_parent_is_gone_stops_itself():
    """A worker the forkserver forked after Ctrl-C ended the parent's wait for its pid
    (nobody knows it to stop it) ran its whole benchmark detached. Its parent, the
    forkserver, ends with offload-bench: the worker now notices and stops."""
    script = textwrap.dedent("""
        import os, time
        from offload.bench.worker import stop_when_orphaned
        r, w = os.pipe()
        if os.fork() == 0:            # the forkserver
            if os.fork() == 0:        # the worker (its output not this run's: a log)
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.dup2(null, 2)
                stop_when_orphaned(0.05)
                os.write(w, str(os.getpid()).encode())
                time.sleep(30)
                os._exit(3)
            time.sleep(0.3)
            os._exit(0)               # ends with the parent
        print(int(os.read(r, 32)))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    pid = int(out.stdout)

    def alive() -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive()


def test_ctrl_c_while_a_worker_starts_stops_nothing_that_did_not_start():
    from offload.bench import runner as runner_mod

    class Starting:   # interrupted before the forkserver said the worker's pid
        pid = exitcode = None

        def terminate(self):
            raise AssertionError("no process to stop")

    runner_mod._stop(Starting())


def test_ctrl_c_while_the_forkserver_imports_leaves_it_running(tmp_path):
    """Ctrl-C reaches the terminal's whole process group: the forkserver, still importing
    torch (it ignores SIGINT only after its imports), died printing a KeyboardInterrupt
    traceback of its own. It starts with SIGINT ignored now: it stays up, says nothing,
    and starts the worker. (A preload that sleeps holds it in its imports.)"""
    (tmp_path / "slow_preload.py").write_text("import time\ntime.sleep(3)\n")
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time
        sys.path.insert(0, {str(tmp_path)!r})
        from multiprocessing import forkserver
        from offload.bench import runner

        def interrupt():   # the server, once started, while it imports
            while forkserver._forkserver._forkserver_pid is None:
                time.sleep(0.01)
            time.sleep(0.5)
            os.kill(forkserver._forkserver._forkserver_pid, signal.SIGINT)
            print("sent", flush=True)
        threading.Thread(target=interrupt, daemon=True).start()
        ctx = runner._forkserver(("slow_preload",))
        worker = ctx.Process(target=os.getpid)
        worker.start()
        worker.join(60)
        print("worker exit", worker.exitcode)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "sent" in done.stdout and "worker exit 0" in done.stdout, \
        done.stdout + done.stderr
    assert "KeyboardInterrupt" not in done.stderr, done.stderr


def _bench_model_file(tmp_path, nvme_dir, source: str, strategies: str) -> int:
    """offload-bench on `source` (a module defining `build()`) for one small step: its code."""
    (tmp_path / "user_model.py").write_text(source)
    return main(["--model", f"{tmp_path}/user_model.py:build", "--input-shape", "16",
                 "--batch", "2", "--steps", "1", "--warmup", "1", "--strategies", strategies,
                 "--nvme-dir", nvme_dir])


def test_a_model_without_blocks_says_so(tmp_path, nvme_dir, capsys):
    code = _bench_model_file(tmp_path, nvme_dir, (
        "import torch.nn as nn\n"
        "def build():\n"
        "    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.Tanh())\n"),
        "checkpoint")
    assert code == 0
    assert "checkpoint: not available: found no blocks to checkpoint in the model" \
        in capsys.readouterr().out


_USER_MODELS = '''
import torch, torch.nn as nn
from layers import Stack   # a module beside this file, as `python user_models.py` finds it

class Outputs(dict):   # what a Hugging Face model returns: an OrderedDict of its fields
    pass

class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.stack = Stack()
    def forward(self, x):
        return Outputs(logits=self.stack(x), hidden=x)

class TokenLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.stack = nn.Embedding(50, 16), Stack()
    def forward(self, ids):
        return (self.stack(self.embed(ids)),)

class Words(nn.Module):
    def forward(self, x):
        return ("not", "a tensor")

def dict_out(): return DictOut()
def token_lm(): return TokenLM()
def words(): return Words()
'''


@pytest.mark.parametrize("factory, vocab, said", [
    ("dict_out", None, None),
    ("token_lm", 50, None),
    ("token_lm", None, "(--model '{file}:token_lm' ran on torch.randn floats; a model taking "
                       "token ids needs --input-vocab N)"),
    ("words", None, "--model '{file}:words': the model returned tuple whose first element is "
                    "str; the benchmark's loss needs a tensor"),
])
def test_user_models_of_other_outputs_and_inputs(factory, vocab, said, tmp_path):
    """A helper's finds: a Hugging Face model's ModelOutput failed with "'ImageClassifierOutput'
    object has no attribute 'float'", a model taking token ids could not be measured at all
    (torch's embedding error, nothing saying the input is randn), and a FILE.py importing a
    module beside it failed unless run from its directory."""
    from offload.bench.spec import RunSpec
    from offload.bench.workload import build_workload

    (tmp_path / "layers.py").write_text(
        "import torch.nn as nn\n"
        "class Stack(nn.Sequential):\n"
        "    def __init__(self):\n"
        "        super().__init__(*[nn.Linear(16, 16) for _ in range(2)])\n")
    (tmp_path / "user_models.py").write_text(_USER_MODELS)
    file = f"{tmp_path}/user_models.py"
    spec = RunSpec(strategy="none", batch=2, model=f"{file}:{factory}", input_shape=(4, 16),
                   input_vocab=vocab)
    workload = build_workload(spec)
    if said is None:
        loss = workload.loss()
        assert loss.shape == () and loss.requires_grad
        assert len(workload.blocks) == 2
    else:
        with pytest.raises((RuntimeError, TypeError)) as raised:
            workload.loss()
        assert said.format(file=file) in str(raised.value)


def test_input_vocab_is_checked_at_the_command_line(tmp_path, capsys):
    from offload.bench.cli import build_parser, _resolve

    (tmp_path / "m.py").write_text("import torch.nn as nn\ndef build(): return nn.Linear(4, 4)\n")
    parser = build_parser()
    for argv, said in ((["--input-vocab", "10"], "--input-vocab applies to --model only"),
                       (["--model", f"{tmp_path}/m.py:build", "--input-shape", "4",
                         "--input-vocab", "0"], "--input-vocab 0: the number of token ids")):
        with pytest.raises(SystemExit):
            _resolve(parser.parse_args(["--device", "cpu", *argv]), parser)
        assert said in capsys.readouterr().err


def test_the_baseline_keeps_a_store_on_a_ram_filesystem_open(nvme_dir):
    """Before the timed steps the worker drops what the runtime keeps between steps, so its
    arenas count again. It closed the NVMe store on a tmpfs --nvme-dir too, and the first
    timed step opened it again, reserving its size in RAM: 3.8 s of a 0.03 s step (165x
    `none` with --steps 1). A store on a disk still closes (its buffers count again)."""
    import warnings

    import offload
    from offload.bench.worker import _drop_runtime_pool
    from offload.tiers import nvme_space

    def store_after_release(directory):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the tmpfs warning
            with offload.activations(tiers="nvme", nvme_dir=directory, min_bytes=0,
                                     nvme_bytes="4MiB"):
                x = torch.randn(64, 64, requires_grad=True)
                x.sin().sum().backward()
        assert nvme_space.open_stores(), "the context kept no store for the next step"
        _drop_runtime_pool(f"{directory},")
        return bool(nvme_space.open_stores())

    with mounted("tmpfs", size_bytes=16 * MiB) as point:
        try:
            assert store_after_release(point)
        finally:
            offload.empty_cache()   # the mount must not stay busy
    assert not store_after_release(nvme_dir)


def test_a_run_where_every_row_ran_out_of_memory_fails(tmp_path, nvme_dir, capsys):
    """Before, it exited 0 with a table of "out of memory" rows: a script could not tell it
    from a measurement."""
    code = _bench_model_file(tmp_path, nvme_dir, (
        "import torch, torch.nn as nn\n"
        "class Huge(nn.Linear):\n"
        "    def forward(self, x):\n"
        "        raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 80 GiB')\n"
        "def build():\n"
        "    return Huge(16, 16)\n"), "offload-host")
    captured = capsys.readouterr()
    assert "out of memory at batch 2" in captured.out
    assert code == 1 and "offload-bench: nothing was measured (2 runs ran out of memory: a " \
        "smaller --batch, --seq or model fits more;" in captured.err


def test_a_saving_that_rounds_to_zero_shows_no_minus_sign():
    """A helper saw save_on_cpu's row read "-0%" (a tiny negative share formatted
    with +.0f)."""
    from offload.bench.report import _saved
    from offload.bench.rows import Row

    assert _saved(Row(strategy="save_on_cpu", memory_saved_pct=-0.3)) == "+0%"
    assert _saved(Row(strategy="offload-host", memory_saved_pct=62.6)) == "+63%"
    assert _saved(Row(strategy="offload-host", memory_saved_pct=-5.5)) == "-6%"


def test_a_noisy_baseline_is_said_under_the_table():
    """A helper's first run: `none` ran 8.53 to 18.02 s in one round on a loaded machine,
    and the table showed offload at 0.69x of it, faster than no offload, with no word of
    the spread."""
    from offload.bench.report import footnotes
    from offload.bench.rows import Row

    def none(lo, hi, rounds):
        return Row(strategy="none", available=True, step_s_min=lo, step_s_max=hi,
                   rounds=rounds)

    said = [line for line in footnotes([none(8.53, 18.02, 1)]) if "busy" in line]
    assert said == ["  none's steps ran 8.53 to 18 s: the machine was busy, and the ratios "
                    "against none are as uncertain (more --rounds, run in alternating order, "
                    "give medians)"]
    assert not [line for line in footnotes([none(8.5, 9.0, 1)]) if "busy" in line]
    said = [line for line in footnotes([none(8.53, 18.02, 3)]) if "busy" in line]
    assert said and said[0].endswith("the ratios against none are as uncertain as that spread")


def test_nothing_measured_says_what_kept_each_kind_of_row_from_it():
    """A helper's find: rows that all timed out ended with "every run ran out of memory
    ... a smaller --batch fits more", against the table's "raise --timeout-s"."""
    from offload.bench.cli import _why_nothing
    from offload.bench.rows import Row

    timed_out = Row(strategy="offload-nvme", error=True,
                    reason="failed: worker timed out after 1 s (raise --timeout-s)")
    oom = Row(strategy="none", reason="out of memory at batch 2")
    missing = Row(strategy="deepspeed", reason="deepspeed is not installed")
    killed = Row(strategy="none", error=True, reason="failed: worker killed by signal 9 "
                 "(SIGKILL: out of memory, most likely)")   # (the kernel's OOM killer)
    assert _why_nothing([killed]).startswith("1 run ran out of memory")
    assert _why_nothing([timed_out, timed_out]) == "2 runs timed out: raise --timeout-s"
    assert _why_nothing([oom, timed_out, missing]) == (
        "1 run ran out of memory: a smaller --batch, --seq or model fits more; 1 run timed "
        "out: raise --timeout-s; 1 run failed or not available here")


def test_max_batch_finds_the_edge(tmp_path, nvme_dir):
    out = tmp_path / "rows.json"
    code = main(TINY + ["--steps", "1", "--strategies", "none", "--max-batch",
                        "--memory-limit", "3MiB", "--nvme-dir", nvme_dir, "--json", str(out)])
    assert code == 0
    (row,) = rows_mod.from_json(out.read_text())
    limit = 3 << 20
    assert row.memory_limit_bytes == limit and row.max_batch_limited_by == "memory"
    probes = {p.batch: p for p in row.max_batch_probes}
    best = row.max_batch
    assert best > 2  # more than the base batch fits in 3 MiB at this size
    assert probes[best].fits and probes[best].resident_bytes <= limit
    assert probes[best + 1].fits is False and probes[best + 1].resident_bytes > limit
    assert row.max_batch_tokens_per_s > 0


# ---------------------------------------------------------------- --max-batch search logic
def _fake(per_sample: int, fail_at: int | None = None):
    calls = []

    def probe(batch):
        calls.append(batch)
        if fail_at is not None and batch >= fail_at:
            return RunResult(strategy="x", batch=batch, available=False, reason="boom")
        return RunResult(strategy="x", batch=batch, available=True,
                         resident_bytes=per_sample * batch, step_times_s=[0.1 * batch],
                         tokens_per_step=10 * batch, wall_s=0.0)

    return probe, calls


def _base(per_sample, batch=2):
    return RunResult(strategy="x", batch=batch, available=True,
                     resident_bytes=per_sample * batch, step_times_s=[0.2, 0.2],
                     tokens_per_step=10 * batch, wall_s=1.0)


@pytest.mark.parametrize("limit, expect", [(1000, 10), (1099, 10), (950, 9), (100, 1)])
def test_search_exact_edge(limit, expect):
    probe, calls = _fake(100)
    found = maxbatch.search(_base(100), probe, device_type="cpu", limit_bytes=limit, cap=64,
                            time_budget_s=1e9)
    assert found.max_batch == expect and found.max_batch_limited_by == "memory"
    assert len(calls) <= 4  # the linear prediction lands on the edge: few probes


def test_search_cap_time_and_nothing_fits():
    probe, _ = _fake(1)
    found = maxbatch.search(_base(1), probe, device_type="cpu", limit_bytes=10**9, cap=6,
                            time_budget_s=1e9)
    assert (found.max_batch, found.max_batch_limited_by) == (6, "cap")
    probe, calls = _fake(1)
    found = maxbatch.search(_base(1), probe, device_type="cpu", limit_bytes=10**9, cap=10**6,
                            time_budget_s=5.0)
    assert found.max_batch_limited_by == "time" and found.max_batch >= 2
    probe, _ = _fake(100)
    found = maxbatch.search(_base(100), probe, device_type="cpu", limit_bytes=50, cap=64,
                            time_budget_s=1e9)
    assert found.max_batch is None and "not even batch 1" in found.max_batch_limited_by


def test_search_tries_no_batch_above_the_cap_when_the_first_does_not_fit():
    """The main run's batch (4) does not fit: the search below it kept to the cap only
    while no upper bound was known, and tried batch 3 with a cap of 2."""
    probe, calls = _fake(100)
    found = maxbatch.search(_base(100, batch=4), probe, device_type="cpu", limit_bytes=350,
                            cap=2, time_budget_s=1e9)
    assert calls and max(calls) <= 2, calls
    assert (found.max_batch, found.max_batch_limited_by) == (2, "cap")


def test_search_stops_on_failed_probe():
    probe, _ = _fake(100, fail_at=5)
    found = maxbatch.search(_base(100), probe, device_type="cpu", limit_bytes=10_000, cap=64,
                            time_budget_s=1e9)
    assert found.max_batch >= 2 and "failed: boom" in found.max_batch_limited_by


# ---------------------------------------------------------------- pieces
def test_workspace_removed_on_exception(tmp_path):
    (tmp_path / "nvme").mkdir()
    with pytest.raises(KeyboardInterrupt):
        with Workspace([str(tmp_path / "nvme")], tmp_base=str(tmp_path)) as ws:
            open(os.path.join(ws.nvme_dirs[0], "x"), "w").close()
            open(os.path.join(ws.root, "grads.pt"), "w").close()
            raise KeyboardInterrupt
    assert sorted(os.listdir(tmp_path)) == ["nvme"] and os.listdir(tmp_path / "nvme") == []


def test_grad_checker_compares_late_reference(tmp_path):
    a, b, c = (str(tmp_path / n) for n in ("a.pt", "b.pt", "c.pt"))
    torch.save({"w": torch.ones(3), "u": None}, a)
    torch.save({"w": torch.ones(3), "u": None}, b)
    torch.save({"w": torch.tensor([1.0, 1.0, 1.5]), "u": None}, c)
    checker = GradChecker()
    checker.add("x", b)        # arrives before the reference: compared once it exists
    checker.add("none", a)
    checker.add("y", c)
    checker.close()
    assert checker.summary("x") == (True, 0.0, [], [])
    assert checker.summary("y") == (False, 0.5, ["w"], [])
    assert os.listdir(tmp_path) == []


def test_grad_checker_compares_every_step(tmp_path):
    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    good = measure.grad_hashes(model)
    model.bias.grad[1] = torch.nextafter(model.bias.grad[1], torch.tensor(9.0))
    bad = measure.grad_hashes(model)
    checker = GradChecker()
    checker.add("none", None, [good, good, good])
    checker.add("x", None, [good, bad, good])
    checker.add("y", None, [good, good, good])
    assert checker.summary("x") == (False, 0.0, ["bias"], [1])
    assert checker.summary("y") == (True, 0.0, [], [])
    # Same bytes in another shape is a different gradient.
    a, b = torch.nn.Module(), torch.nn.Module()
    a.w, b.w = torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(3, 2))
    a.w.grad, b.w.grad = torch.zeros(2, 3), torch.zeros(3, 2)
    assert measure.grad_hashes(a)["grads"]["w"] != measure.grad_hashes(b)["grads"]["w"]


def _row(strategy, rss, resident, **extra):
    return Row(strategy=strategy, available=True, peak_activation_source="process rss",
               peak_activation_bytes=rss, peak_rss_delta_bytes=rss, resident_bytes=resident,
               step_s_median=1.0, **extra)


def test_cross_check_flags_rss_the_accounting_misses():
    none = _row("none", 1000 * MiB, 800 * MiB)            # 200 MiB transient working set
    ok = _row("offload-nvme", 500 * MiB, 250 * MiB)       # same transient + noise
    bad = _row("offload-host", 900 * MiB, 400 * MiB)      # 300 MiB nothing accounts for
    rows = [none, ok, bad]
    rows_mod.add_relative(rows)
    assert none.resident_check.startswith("reference")
    assert ok.resident_check == "ok" and ok.rss_unexplained_bytes == 250 * MiB
    # Slack: max(32 MiB, 10% of none's 1000 MiB) = 100 MiB < 300 MiB over the transient.
    assert bad.resident_check.startswith("RSS grew 300 MiB more than resident bytes")
    lines = report.footnotes(rows)
    assert any(line.startswith("  ‡ offload-host: RSS grew") for line in lines)
    assert not any("offload-nvme: RSS" in line for line in lines)


def test_the_title_names_the_device_when_none_failed():
    failed = Row(strategy="none", available=False, device="cpu", model="m", batch=2,
                 dtype="fp32", steps=1, warmup=1, rounds=1)
    ran = Row(strategy="offload-host", available=True, device="cpu", device_name="x86_64",
              model="m", batch=2, dtype="fp32", steps=1, warmup=1, rounds=1)
    assert "cpu (x86_64);" in report.title([failed, ran])


def test_a_row_whose_tiers_were_full_says_so():
    """With OFFLOAD_NVME_BYTES=2MiB (or a nearly full disk) the offload-nvme row kept 41 MiB
    on the device and looked like offload doing nothing: the runtime's warning went to the
    worker's log, which is removed."""
    import offload

    stats = {**offload.Stats().as_dict(), "full_kept_bytes": 40 * MiB,
             "nvme_capacity_bytes": 2 * MiB, "host_capacity_bytes": 0}
    full = _row("offload-nvme", 100 * MiB, 40 * MiB, runtime_stats=stats)
    roomy = _row("offload-host", 100 * MiB, 0, runtime_stats=offload.Stats().as_dict())
    lines = report.footnotes([_row("none", 100 * MiB, 90 * MiB), full, roomy])
    said = [line for line in lines if "tiers were full" in line]
    assert said == ["  offload-nvme: its tiers were full: 40 MiB of a step's saves stayed "
                    "where they were (room: nvme 2 MiB; OFFLOAD_HOST_BYTES / "
                    "OFFLOAD_NVME_BYTES, or the disk's free space), so its memory figures "
                    "are not those of moving everything"], lines


def test_buffered_nvme_marked():
    none = _row("none", 1000 * MiB, 800 * MiB)
    buffered = _row("offload-nvme", 300 * MiB, 100 * MiB, nvme_direct=False, nvme_in_ram=True,
                    nvme_fs_types=["xfs"])
    rows = [none, buffered]
    rows_mod.add_relative(rows)
    lines = report.footnotes(rows)
    assert any(line.startswith("  † offload-nvme: buffered NVMe I/O (O_DIRECT refused)")
               for line in lines)
    assert report._mem_cell("300 MiB", buffered) == "300 MiB†"
    assert report._mem_cell("300 MiB", none) == "300 MiB"


@pytest.mark.skipif(not _runtime_available(), reason="needs offload.activations()")
def test_buffered_nvme_dir_flagged_end_to_end(tmp_path, capsys):
    # tmpfs: whether or not it takes O_DIRECT (Linux >= 6.6 does), the bytes stay in shmem,
    # RAM that RSS does not count. The row must say so, in --json and in the table.
    out = tmp_path / "rows.json"
    with mounted("tmpfs", size_bytes=256 * MiB) as point, pytest.MonkeyPatch.context() as mp:
        mp.setenv("OFFLOAD_MIN_BYTES", "0")
        mp.setenv("OFFLOAD_NVME_BYTES", "64MiB")
        code = main(TINY + ["--steps", "1", "--strategies", "offload-nvme",
                            "--nvme-dir", point, "--json", str(out)])
        assert os.listdir(point) == []
    assert code == 0
    row = {r.strategy: r for r in rows_mod.from_json(out.read_text())}["offload-nvme"]
    assert row.available, row.reason
    assert row.nvme_fs_types == ["tmpfs"] and row.nvme_in_ram is True
    out = capsys.readouterr().out
    assert "† offload-nvme: " in out and "which RSS does not count" in out
    assert any(line.startswith("│ offload-nvme") and "†" in line for line in out.splitlines())


# ---------------------------------------------------------------- argument errors
@pytest.mark.parametrize("argv, message", [
    (["--strategies", "none,offlaod-nvme"],
     "--strategies: unknown strategy 'offlaod-nvme' (choose from: none, checkpoint,"),
    (["--memory-limit", "2 gigs", "--max-batch"], "--memory-limit '2 gigs': unknown unit"),
    (["--memory-limit", "lots", "--max-batch"], "--memory-limit 'lots': not a size"),
    # Were: ignored, and the whole default benchmark ran (minutes).
    (["--memory-limit", "2GiB"], "--memory-limit applies to --max-batch only (add --max-batch)"),
    (["--max-batch-cap", "4"], "--max-batch-cap applies to --max-batch only"),
    (["--batch", "4", "--max-batch", "--max-batch-cap", "2", "--memory-limit", "1GiB"],
     "--max-batch-cap 2: below the batch of the main run (4)"),
    (["--max-batch-time-s", "60"], "--max-batch-time-s applies to --max-batch only"),
    (["--max-batch", "--memory-limit", "2GiB", "--max-batch-time-s", "-1"],
     "--max-batch-time-s -1: must be more than 0 seconds"),
    # Was: accepted, the auto row "not available" and a zero exit.
    (["--budget", "lots"], "--budget 'lots': not a size"),
    (["--budget", "0.3"], '--budget \'0.3\': a size in bytes must be a whole number (a share '
                          'is a percentage: "30%")'),
    (["--max-batch"], "--max-batch on CPU needs --memory-limit (e.g. --memory-limit 2GiB)"),
    (["--model", "x:y"], "--model 'x:y' needs --input-shape"),
    (["--model", "no_such_module_zz:build", "--input-shape", "4"],
     "--model 'no_such_module_zz:build': cannot import 'no_such_module_zz'"),
    (["--model", "nocolon", "--input-shape", "4"], "expected MODULE:FACTORY"),
    (["--input-shape", "3,4"], "--input-shape applies to --model only"),
    (["--gpt", "hiden=3"], "--gpt 'hiden=3': expected KEY=VALUE with KEY one of"),
    (["--gpt", "hidden=100,heads=3"], "--gpt: GPTConfig: hidden=100 is not divisible by heads=3"),
    (["--steps", "0"], "--steps 0: must be at least 1"),
    # Were: a ZeroDivisionError, or a model that cannot run, after the parent's checks.
    (["--gpt", "heads=0"], "--gpt: GPTConfig: heads=0 must be a whole number of at least 1"),
    (["--gpt", "heads=-1"], "--gpt: GPTConfig: heads=-1 must be a whole number of at least 1"),
    (["--gpt", "hidden=0"], "--gpt: GPTConfig: hidden=0 must be a whole number of at least 1"),
    (["--gpt", "vocab_size=0"], "--gpt: GPTConfig: vocab_size=0 must be a whole number"),
    (["--gpt", "seq_len=0"], "--gpt: GPTConfig: seq_len=0 must be a whole number"),
    (["--gpt", "dropout=2"], "--gpt: GPTConfig: dropout=2.0 must be a probability from 0 to 1"),
    (["--gpt", "dropout=-1"], "--gpt: GPTConfig: dropout=-1.0 must be a probability"),
    # Were: accepted (a worker killed at once; 0 warm-up timed one-time setup).
    (["--timeout-s", "0"], "--timeout-s 0: must be more than 0 seconds"),
    (["--timeout-s", "-5"], "--timeout-s -5: must be more than 0 seconds"),
    (["--warmup", "0"], "--warmup 0: must be at least 1 (the first step pays one-time setup"),
    # Was: accepted and measured by no row.
    (["--strategies", "offload-host", "--budget", "30%"],
     "--budget applies to the auto row only (add auto to --strategies: --strategies "
     "none,offload-host,auto)"),
    # Was: accepted by the CLI, then the auto row "not available" with a zero exit.
    (["--budget=150%"], "--budget '150%': 150% is over 100% (give at most 100%"),
    # The runtime's own checks of the directory (offload.config), not a traceback from
    # making the workspace there.
    # The whole fix: the bench has no tiers to drop 'nvme' from (it said "or drop 'nvme'
    # from tiers=", the runtime's fix).
    (["--nvme-dir", "/no/such/dir"], "--nvme-dir '/no/such/dir': '/no/such/dir' does not "
                                     "exist (point it at a writable directory on a local "
                                     "SSD)\n"),
    (["--nvme-dir", "/proc"], "--nvme-dir '/proc': '/proc' is on a file system that reports "
                              "no size"),
    (["--nvme-dir", "/sys"], "--nvme-dir '/sys': '/sys' is on a file system that reports no "
                             "size"),
    # The runtime's OFFLOAD_NVME_DIR rules (offload.config): no unknown placeholder kept.
    (["--nvme-dir", "/var/tmp/{rnak}"], "--nvme-dir '/var/tmp/{rnak}': bad placeholder in "
                                        "'/var/tmp/{rnak}'"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "tpu"],
     "--device"),
    (["--json", "/no/such/dir/rows.json"], "--json '/no/such/dir/rows.json': the directory"),
    # Were: the whole run, then a traceback writing the file (and a rows.json.part left).
    (["--json", tempfile.gettempdir()], f"--json {tempfile.gettempdir()!r}: "
                                        f"{tempfile.gettempdir()!r} is a directory; name a "
                                        "file in it"),
    (["--json", "/proc/rows.json"], "--json '/proc/rows.json': cannot create a file in "
                                    "'/proc'"),
    (["--plot", "plot.txt"], "--plot 'plot.txt': matplotlib writes no '.txt' files (use "
                             ".png, .svg or .pdf"),
    (["--plot", "plot"], "--plot 'plot': no extension to tell matplotlib the format"),
    # Test-only strategies are not shipped: only a --plugin registers them.
    (["--strategies", "none,corrupt"], "--strategies: unknown strategy 'corrupt' (choose from: "
                                       "none, checkpoint, recompute, ckpt+save_on_cpu,"),
    (["--plugin", "no_such_plugin_zz"], "--plugin 'no_such_plugin_zz': cannot import "
                                        "'no_such_plugin_zz': ModuleNotFoundError"),
    (["--hf", "gtp2"], "--hf 'gtp2': 'gtp2' is not a transformers model type with a causal LM "
                       "(e.g. gpt2, llama, mistral, qwen2"),
    (["--hf", "/no/such/config.json"], "--hf '/no/such/config.json': no such file"),
    (["--hf", "gpt2", "--model", "x:y"], "--model and --hf each name the model: give one"),
    (["--hf", "gpt2", "--gpt", "dropout=0.2"], "--gpt dropout: a --hf model's dropout is its "
                                               "config's"),
    (["--hf", "llama", "--gpt", "hidden=96,heads=5"], "--gpt: GPTConfig: hidden=96 is not "
                                                      "divisible by heads=5"),
])
def test_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_nvme_dir_from_env(monkeypatch, capsys):
    monkeypatch.setenv("OFFLOAD_NVME_DIR", "/no/such/env/dir")
    with pytest.raises(SystemExit):
        main(["--strategies", "none"])
    assert ("OFFLOAD_NVME_DIR='/no/such/env/dir': '/no/such/env/dir' does not exist"
            in capsys.readouterr().err)


@pytest.mark.parametrize("name, value, message", [
    ("OFFLOAD_HOST_BYTES", "abc", "OFFLOAD_HOST_BYTES='abc': not a size"),
    ("OFFLOAD_IO_WORKERS", "0", "OFFLOAD_IO_WORKERS='0': must be at least 1"),
    # Was: every offload row ran with offload off and said "bit-exact", 0 B moved.
    ("OFFLOAD_ENABLED", "0", "OFFLOAD_ENABLED='0' turns offload off, so the offload-nvme, "
                             "auto row(s) would measure plain autograd"),
])
def test_offload_settings_are_checked_before_the_run(name, value, message, monkeypatch,
                                                     nvme_dir, capsys):
    # Were: every offload row "not available" (or measuring nothing) and a zero exit.
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        main(TINY + ["--strategies", "offload-nvme,auto", "--nvme-dir", nvme_dir])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    # Rows that do not run the runtime do not read its settings.
    from offload.bench.cli import _resolve, build_parser

    parser = build_parser()
    _resolve(parser.parse_args(TINY + ["--strategies", "checkpoint", "--nvme-dir", nvme_dir]),
             parser)


def test_a_misspelled_variable_is_said_in_the_parent(monkeypatch, nvme_dir, caplog):
    # Was: said only in the worker's log, which is deleted with the workspace.
    from offload.bench.cli import _resolve, build_parser
    from offload.config import forget_warnings

    monkeypatch.setenv("OFFLOAD_TIRES", "nvme")
    forget_warnings()  # said once per process: maybe already, by another test
    parser = build_parser()
    with caplog.at_level(logging.WARNING, logger="offload"):
        _resolve(parser.parse_args(TINY + ["--strategies", "offload-host", "--nvme-dir",
                                           nvme_dir]), parser)
    assert any("OFFLOAD_TIRES='nvme' is not a variable offload knows" in r.getMessage()
               for r in caplog.records)


def test_nvme_dir_placeholders_expand(monkeypatch, tmp_path, capsys):
    (tmp_path / "3").mkdir()
    monkeypatch.setenv("RANK", "3")
    from offload.bench.cli import _nvme_bases

    assert _nvme_bases(f"{tmp_path}/{{rank}}", None) == [f"{tmp_path}/3"]


def test_a_ram_nvme_dir_warning_names_the_capacity_set(caplog):
    """The RAM file system warning of the --nvme-dir check names OFFLOAD_NVME_BYTES's
    capacity, as the runtime's does (it said the default 50%: the check read no variable)."""
    import logging
    from offload import config as config_mod
    from offload.bench.cli import _nvme_bases

    config_mod.forget_warnings()
    with mounted("tmpfs") as point, pytest.MonkeyPatch.context() as mp, \
            caplog.at_level(logging.WARNING, logger="offload"):
        mp.setenv("OFFLOAD_NVME_BYTES", "8MiB")
        assert _nvme_bases(point, None) == [point]
    assert "the nvme tier reserves its capacity (8 MiB) there" in caplog.text, caplog.text


def test_explain_says_why_or_prints_plan(nvme_dir, capsys):
    code = main(TINY + ["--steps", "1", "--strategies", "none", "--explain",
                        "--nvme-dir", nvme_dir])
    out = capsys.readouterr().out
    assert code == 0
    assert "auto plan:" in out and "block Block x2" in out and "figures:" in out
    assert out.count("auto plan:") == 1  # the plan's own first line, no heading above it


def test_explain_heads_a_plan_only_when_it_has_no_heading():
    row = Row(strategy="auto", available=True, plan="auto plan: kept 0 B\n  profile: ...")
    assert report.explain_text([row]) == row.plan
    row.plan = "kept 0 B"
    assert report.explain_text([row]) == "auto plan:\nkept 0 B"


def test_hf_directory_without_config_says_so(tmp_path, capsys):
    pytest.importorskip("transformers")
    with pytest.raises(SystemExit) as exc:
        main(["--hf", str(tmp_path)])
    assert exc.value.code == 2
    assert (f"--hf {str(tmp_path)!r}: the directory has no config.json (save one there with "
            "config.save_pretrained(DIR)") in capsys.readouterr().err


def test_help_gives_each_default_batch():
    from offload.bench.cli import CPU_DEFAULT_BATCH, MODEL_DEFAULT_BATCH, build_parser

    text = " ".join(build_parser().format_help().split())
    assert (f"batch size (default: {CPU_DEFAULT_BATCH} on CPU, gpt_for_machine's on CUDA; "
            f"{MODEL_DEFAULT_BATCH} with --model)") in text


def test_a_reference_that_varies_across_rounds_is_called_out():
    # Round 2 of `none` is compared against round 1; when it differs, the bit-exact check has
    # a floor on this device and the footnotes say so (seen on an H200: attention backward).
    checker = GradChecker()
    hashes = {"algo": "crc", "grads": {"w": 1}}
    checker.add("none", None, [hashes, hashes])
    checker.add("none", None, [hashes, {"algo": "crc", "grads": {"w": 2}}])
    checker.add("offload-host", None, [hashes, {"algo": "crc", "grads": {"w": 3}}])
    none = _row("none", 1000 * MiB, 800 * MiB)
    host = _row("offload-host", 500 * MiB, 100 * MiB)
    for row in (none, host):
        exact, diff, names, steps = checker.summary(row.strategy)
        row.bit_exact, row.max_abs_diff, row.grads_differ, row.grads_differ_steps = \
            exact, diff, names, steps
    assert none.bit_exact is False and none.grads_differ_steps == [1]
    lines = report.footnotes([none, host])
    assert any(line.startswith("  none differs from its own first round") for line in lines)
    assert not any("own first round" in line for line in report.footnotes([host]))


def test_an_op_without_a_deterministic_kernel_falls_back_to_warn_only():
    from offload.bench import worker

    class Flaky:
        calls = 0

        def step(self, wl, nvme_dir, budget):
            self.calls += 1
            if not torch.is_deterministic_algorithms_warn_only_enabled():
                raise RuntimeError("index_add_cuda_ does not have a deterministic "
                                   "implementation, but you set 'torch.use_deterministic_"
                                   "algorithms(True)'.\nmore text")
            return "ok"

    class Spec:
        nvme_dir, budget = None, None

    resets, result = [], RunResult(strategy="flaky", batch=1)
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        torch.use_deterministic_algorithms(True)
        flaky = Flaky()
        assert worker._step(flaky, None, Spec, result, lambda: resets.append(1)) == "ok"
        assert flaky.calls == 2 and resets == [1]
        assert result.nondeterministic_op.startswith("index_add_cuda_ does not have")
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        # Other errors are not swallowed.
        with pytest.raises(RuntimeError, match="boom"):
            worker._step(type("S", (), {"step": lambda *a: (_ for _ in ()).throw(
                RuntimeError("boom"))})(), None, Spec, result, lambda: None)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_blocks_footnote_names_only_the_rows_that_ran():
    none = _row("none", 1000 * MiB, 800 * MiB, blocks=["h.0", "h.1"])
    recompute = _row("recompute", 500 * MiB, 100 * MiB, blocks=["h.0", "h.1"])
    lines = [line for line in report.footnotes([none, recompute]) if "blocks (" in line]
    assert lines == ["  blocks (checkpointed by the recompute row; policy=recompute's, "
                     "offload/schedule/blocks.py): 2, h.0, h.1"]


def test_header_is_one_line_above_the_table():
    from rich.console import Console

    rows = [_row("none", 1000 * MiB, 800 * MiB, model="GPT h64 L2", batch=3, dtype="fp32",
                 device="cpu", device_name="x86_64 (2 CPUs, 2 torch threads)", steps=3,
                 warmup=1, rounds=2, step_s_min=1.0, step_s_max=1.0)]
    console = Console(width=60, record=True, file=io.StringIO())
    report.print_table(rows, console)
    first = console.export_text().splitlines()[0]
    # Not wrapped to the table's width mid-phrase (nor padded with spaces) in a file.
    assert first == report.title(rows), first


def test_cpu_nvme_rows_without_torch_thp_get_the_hint():
    none = _row("none", 1000 * MiB, 800 * MiB, device="cpu", torch_thp=False)
    nvme = _row("offload-nvme", 500 * MiB, 100 * MiB, device="cpu", nvme_bytes=800 * MiB,
                torch_thp=False)
    rows = [none, nvme]
    rows_mod.add_relative(rows)
    hint = [line for line in report.footnotes(rows) if "THP_MEM_ALLOC_ENABLE=1" in line]
    assert len(hint) == 1 and hint[0].startswith("  offload-nvme: ran without")
    nvme.torch_thp = True
    assert not [line for line in report.footnotes(rows) if "THP_MEM_ALLOC_ENABLE" in line]


# ---------------------------------------------------------------- strategies, JSON schema
def test_help_lists_no_test_only_strategy():
    from offload.bench import strategies
    from offload.bench.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    for name in PUBLIC_STRATEGIES:
        assert f"{name}: " in text, name
    for name in TEST_STRATEGIES:
        assert name not in text, name
    # Not shipped at all: only a plugin registers them (tests/bench_test_strategies.py).
    shipped = " ".join(vars(strategies))
    assert not any(n in shipped for n in ("Corrupt", "PooledArena", "Crash"))


def test_register_refuses_a_builtin_name():
    from offload.bench.strategies import NoneStrategy, register

    class Impostor(NoneStrategy):
        name = "recompute"

    with pytest.raises(ValueError, match=r"register\('recompute'\): a built-in strategy has "
                                         "this name"):
        register(Impostor())


def test_json_has_one_versioned_schema():
    row = _row("none", 1000 * MiB, 800 * MiB, blocks=["h.0"])
    row.max_batch_probes = [maxbatch.Probe(batch=4, fits=True, resident_bytes=1,
                                           cuda_peak_bytes=None, peak_rss_delta_bytes=2,
                                           step_s=0.5, reason=None)]
    text = rows_mod.to_json([row])
    doc = json.loads(text)
    assert doc["schema"] == "offload-bench.rows" and doc["schema_version"] == 1
    assert list(doc["rows"][0]) == list(ROW_FIELDS)
    assert rows_mod.from_json(text) == [row]
    with pytest.raises(ValueError, match="schema_version 0: this version reads 1"):
        rows_mod.from_json(json.dumps({**doc, "schema_version": 0}))
    with pytest.raises(ValueError, match="not an offload-bench --json document"):
        rows_mod.from_json(json.dumps(doc["rows"]))  # the list the old --json wrote


def test_json_names_an_infinite_figure_as_a_string():
    """A gradient missing on one side makes max_abs_diff infinite: `--json` wrote
    `Infinity`, which is not JSON (JSON.parse refuses it, jq reads 1.8e308)."""
    row = _row("offload", 1000 * MiB, 800 * MiB)
    row.bit_exact, row.max_abs_diff, row.grads_differ = False, float("inf"), ["w"]
    row.runtime_stats = {"d2h_gbps": float("inf"), "host_capacity_source": "50% of /",
                         "shape": (1, float("-inf"))}
    row.max_batch_probes = [maxbatch.Probe(batch=4, fits=False, resident_bytes=None,
                                           cuda_peak_bytes=None, peak_rss_delta_bytes=None,
                                           step_s=float("inf"), reason="timed out")]
    text = rows_mod.to_json([row])
    json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert json.loads(text)["rows"][0]["max_abs_diff"] == "inf"
    back, = rows_mod.from_json(text)
    assert back.max_abs_diff == back.runtime_stats["d2h_gbps"] == float("inf")
    assert back.max_batch_probes == row.max_batch_probes
    assert back.runtime_stats["host_capacity_source"] == "50% of /"
    assert back.runtime_stats["shape"] == [1, float("-inf")]   # a tuple: a list, as in JSON


def test_json_that_cannot_be_written_leaves_no_part_file(tmp_path):
    target = tmp_path / "rows.json"
    target.mkdir()  # became a directory after the CLI's check
    with pytest.raises(OSError):
        report.write_json([_row("none", 1000 * MiB, 800 * MiB)], str(target))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux only")
def test_peak_anonymous_rss_is_the_peak_since_the_reset():
    # In a child: the reset would move this process's ru_maxrss under other tests' feet.
    script = textwrap.dedent("""
        import torch
        from offload.bench.measure import _status_bytes, peak_anon_rss_bytes, reset_peak_rss
        big = torch.ones(256 << 20, dtype=torch.uint8)   # 256 MiB touched, then unmapped
        del big
        before = peak_anon_rss_bytes()
        assert reset_peak_rss()
        start = peak_anon_rss_bytes()
        x = torch.ones(64 << 20, dtype=torch.uint8)
        grown = peak_anon_rss_bytes()
        hwm = lambda: _status_bytes()["VmHWM"]
        hwm_before_file = hwm()
        with tempfile.TemporaryFile(dir=sys.argv[1]) as f:   # 64 MiB of file pages mapped
            f.write(b"\1" * (64 << 20))
            f.flush()
            with mmap.mmap(f.fileno(), 64 << 20, prot=mmap.PROT_READ) as m:
                touched = sum(m[i] for i in range(0, 64 << 20, 4096))
                print(before, start, grown, peak_anon_rss_bytes(), hwm() - hwm_before_file)
    """)
    script = "import mmap, sys, tempfile\n" + script
    out = subprocess.run([sys.executable, "-c", script, tempfile.gettempdir()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, start, grown, with_file, hwm_file = map(int, out.stdout.split())
    mib = 1 << 20
    assert before - start >= 240 * mib           # the freed 256 MiB left the peak
    assert 60 * mib <= grown - start <= 72 * mib  # the 64 MiB since the reset, no more
    assert hwm_file >= 56 * mib                  # the file's pages count in the kernel's peak
    assert abs(with_file - grown) <= 4 * mib     # ... and not in the anonymous one


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_built_in_gpt_starts_near_a_uniform_guess(seed):
    # GPT-2's initialisation: the first loss is about ln(vocab_size), as in a real run. It
    # was 40-157 with torch's N(0, 1) embeddings tied to the head.
    import math

    from offload.bench.models import GPT, GPTConfig

    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=1024, hidden=128, layers=2, heads=4, seq_len=64)
    model = GPT(cfg)
    idx, targets = model.example_batch(2)
    with torch.no_grad():
        loss = model.loss(idx, targets).item()
    assert abs(loss - math.log(cfg.vocab_size)) < 0.5, loss
