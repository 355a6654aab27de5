"""The probe: cache per machine / device / directory, refresh, overrides, the file lock,
OFFLOAD_NVME_MAX_BW, and the real measurements (small)."""
from __future__ import annotations

import json
import multiprocessing
import os
import tempfile

import pytest
import torch

import offload
from offload.config import Config
from offload.errors import ConfigError
from offload.schedule import measure, probe
from offload.util.figures import ProbeSetting
from offload.schedule.probe_cli import main as probe_main, pcie_gbps

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


class FakeMeasure:
    """Counts measurements; returns figures that say which call made them."""

    def __init__(self):
        self.calls = []

    def __call__(self, groups, device, dirs, workers):
        self.calls.append(list(groups))
        n = len(self.calls)
        figures = {"compute": {"compute_gflops": 100.0 * n, "dispatch_op_s": 1e-5},
                   "nvme": {"nvme_write_gbps": 1.0 * n, "nvme_read_gbps": 2.0 * n,
                            "nvme_issue_s": 1e-5},
                   "pcie": {"d2h_gbps": 50.0, "h2d_gbps": 50.0, "d2h_small_gbps": 40.0,
                            "copy_issue_s": 5e-5}}
        return {g: figures[g] for g in groups}


def _config(nvme_dir=None, **kw):
    if nvme_dir:
        kw.update(tiers="nvme", nvme_dir=nvme_dir)
    return Config.from_env(env={}, **kw)


def test_measures_once_then_reads_the_cache(tmp_path):
    fake = FakeMeasure()
    cfg = _config(str(tmp_path))
    first = probe.figures_for(cfg, CPU, measure_fn=fake)
    second = probe.figures_for(cfg, CPU, measure_fn=fake)
    assert fake.calls == [["compute", "nvme"]]
    assert first == second and first.nvme_write_gbps == 1.0
    assert first.sources["nvme_write_gbps"] == "measured"
    assert second.sources["nvme_write_gbps"].startswith("cached")
    assert first.d2h_gbps is None  # no PCIe on a CPU run


def test_refresh_measures_again_and_updates_the_cache(tmp_path):
    fake = FakeMeasure()
    probe.figures_for(_config(str(tmp_path)), CPU, measure_fn=fake)
    fresh = probe.figures_for(_config(str(tmp_path), probe="refresh"), CPU, measure_fn=fake)
    again = probe.figures_for(_config(str(tmp_path)), CPU, measure_fn=fake)
    assert len(fake.calls) == 2
    assert fresh.nvme_write_gbps == again.nvme_write_gbps == 2.0


def test_cache_is_per_file_system_and_per_workers(tmp_path):
    fake = FakeMeasure()
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    other = tempfile.mkdtemp(dir="/dev/shm")  # another file system (tmpfs)
    try:
        assert os.stat(other).st_dev != os.stat(a).st_dev
        probe.figures_for(_config(str(a)), CPU, measure_fn=fake)
        probe.figures_for(_config(str(b)), CPU, measure_fn=fake)  # same disk: cached
        probe.figures_for(_config(other), CPU, measure_fn=fake)   # another one
        probe.figures_for(_config(str(a), io_workers=8), CPU, measure_fn=fake)  # other engine
        assert fake.calls == [["compute", "nvme"], ["nvme"], ["nvme"]]
    finally:
        os.rmdir(other)


def test_no_nvme_tier_measures_no_disk():
    fake = FakeMeasure()
    figures = probe.figures_for(_config(), CPU, measure_fn=fake)
    assert fake.calls == [["compute"]] and figures.nvme_write_gbps is None


def test_overrides_win_and_skip_measuring(tmp_path):
    fake = FakeMeasure()
    cfg = _config(str(tmp_path), probe="compute_gflops=50,dispatch_op_s=2e-5,"
                                       "nvme_write_gbps=0.3,nvme_read_gbps=0.2,nvme_issue_s=1e-5")
    figures = probe.figures_for(cfg, CPU, measure_fn=fake)
    assert fake.calls == []
    assert figures.nvme_write_gbps == 0.3 and figures.sources["nvme_read_gbps"] == "OFFLOAD_PROBE"
    # A partial override measures the rest of the group's figures, and the override wins.
    partial = probe.figures_for(_config(str(tmp_path), probe={"nvme_write_gbps": 0.3}), CPU,
                                measure_fn=fake)
    assert fake.calls == [["compute", "nvme"]]
    assert partial.nvme_write_gbps == 0.3 and partial.nvme_read_gbps == 2.0


def test_nvme_max_bw_caps_the_figures(tmp_path):
    fake = FakeMeasure()
    figures = probe.figures_for(_config(str(tmp_path), nvme_max_bw="500MB"), CPU,
                                measure_fn=fake)
    assert figures.nvme_write_gbps == figures.nvme_read_gbps == 0.5
    assert figures.sources["nvme_write_gbps"] == "OFFLOAD_NVME_MAX_BW"
    # The disk's own speed stays in the cache: without the cap it is back.
    assert probe.figures_for(_config(str(tmp_path)), CPU, measure_fn=fake).nvme_write_gbps == 1.0


def test_a_cache_from_another_probe_version_is_measured_again(tmp_path, cache_home):
    fake = FakeMeasure()
    probe.figures_for(_config(), CPU, measure_fn=fake)
    path = probe.cache_path()
    with open(path) as f:
        data = json.load(f)
    data["version"] = probe.PROBE_VERSION + 1
    with open(path, "w") as f:
        json.dump(data, f)
    probe.figures_for(_config(), CPU, measure_fn=fake)
    assert len(fake.calls) == 2


def test_an_unwritable_cache_dir_still_gives_figures(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file where a directory must be
    fake = FakeMeasure()
    figures = probe.figures_for(_config(), CPU, measure_fn=fake)
    assert figures.compute_gflops == 100.0
    assert "cannot use the probe cache" in caplog.text


def _rank(cache_home: str, marker_dir: str, rank: int) -> None:
    os.environ["XDG_CACHE_HOME"] = cache_home

    def slow_measure(groups, device, dirs, workers):
        import time

        open(os.path.join(marker_dir, f"measured-{rank}"), "w").close()
        time.sleep(0.3)  # long enough for the other ranks to be waiting on the lock
        return {"compute": {"compute_gflops": float(rank), "dispatch_op_s": 1e-5}}

    figures = probe.figures_for(Config.from_env(env={}), CPU, measure_fn=slow_measure)
    with open(os.path.join(marker_dir, f"result-{rank}"), "w") as f:
        f.write(str(figures.compute_gflops))


def test_ranks_of_one_host_measure_once(tmp_path, cache_home):
    markers = tmp_path / "markers"
    markers.mkdir()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(str(cache_home), str(markers), r))
             for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    names = sorted(os.listdir(markers))
    assert len([n for n in names if n.startswith("measured")]) == 1
    results = {open(markers / n).read() for n in names if n.startswith("result")}
    assert len(results) == 1  # every rank plans with the one measurement


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("raw, message", [
    ("fast", "neither 'cached', 'refresh' nor name=value"),
    ("nvme_write=1", "unknown figure 'nvme_write' .did you mean 'nvme_write_gbps'"),
    ("nvme_write_gbps=quick", "is not a number"),
    ("nvme_write_gbps=0", "must be a positive"),
])
def test_probe_setting_errors(raw, message):
    with pytest.raises(ConfigError, match=message) as err:
        Config.from_env(env={"OFFLOAD_PROBE": raw})
    assert "OFFLOAD_PROBE=" in str(err.value)


def test_probe_setting_parses():
    assert Config.from_env(env={}).probe == ProbeSetting()
    assert Config.from_env(env={"OFFLOAD_PROBE": "refresh"}).probe.refresh
    cfg = Config.from_env(env={}, probe="nvme_read_gbps=0.25")
    assert cfg.probe.overrides == {"nvme_read_gbps": 0.25}


@pytest.mark.parametrize("raw, nbytes", [("200MB", 200_000_000), ("200MB/s", 200_000_000),
                                         ("1GiB", 1 << 30), ("0", 0)])
def test_nvme_max_bw_parses(raw, nbytes):
    assert Config.from_env(env={"OFFLOAD_NVME_MAX_BW": raw}).nvme_max_bw == nbytes


def test_nvme_max_bw_error_names_the_variable():
    with pytest.raises(ConfigError, match=r"OFFLOAD_NVME_MAX_BW='fast': .*bytes per second"):
        Config.from_env(env={"OFFLOAD_NVME_MAX_BW": "fast"})
    # Was accepted: a step's reads then waited for hours, in backward.
    with pytest.raises(ConfigError, match=r"OFFLOAD_NVME_MAX_BW='1B': is under 1 MB per "
                       r"second \(give a cap such as \"200MB\", or 0 for none\)"):
        Config.from_env(env={"OFFLOAD_NVME_MAX_BW": "1B"})


def test_nvme_max_bw_reaches_the_engine(nvme_dir):
    model = torch.nn.Linear(64, 64)
    x = torch.randn(512, 64, requires_grad=True)
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, nvme_max_bw="300MB",
                             min_bytes=0) as ctx:
        loss = model(x).relu().sum()
        store = ctx.tiers["nvme"]._store
        assert store.throttle_bytes_per_s == 300_000_000
        loss.backward()
    assert ctx.stats.nvme_bytes > 0
    offload.ActivationOffload.close(ctx)


# ---------------------------------------------------------------- real measurements
def test_real_measurements_are_positive_and_leave_the_users_random_numbers_alone(
        nvme_dir, monkeypatch):
    """`auto` measures inside the user's step the first time it plans on a machine. Before,
    the operands came from the default generator, so every random number after that step
    (dropout masks, data order) differed from plain training."""
    from offload._ext import load_core

    monkeypatch.setattr(measure, "NVME_PROBE_BYTES", 32 << 20)
    rng = torch.get_rng_state()
    figures = measure.compute_figures(CPU)
    assert figures["compute_gflops"] > 0 and figures["dispatch_op_s"] >= 0
    disk = measure.nvme_figures((nvme_dir,), 2, load_core())
    assert disk["nvme_write_gbps"] > 0 and disk["nvme_read_gbps"] > 0
    assert disk["nvme_issue_s"] > 0  # (the fixture checks nothing stays on disk)
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.cuda
def test_pcie_measurement_on_a_gpu():
    from offload._ext import load_core

    rng = torch.cuda.get_rng_state()
    figures = measure.pcie_figures(torch.device("cuda"), load_core())
    assert figures["d2h_gbps"] > 1 and figures["h2d_gbps"] > 1 and figures["copy_issue_s"] > 0
    figures = measure.compute_figures(torch.device("cuda"))
    assert torch.equal(torch.cuda.get_rng_state(), rng)   # the user's random numbers


def test_probe_command_prints_figures_and_ceilings(nvme_dir, capsys, monkeypatch):
    monkeypatch.setenv("OFFLOAD_PROBE", "compute_gflops=50,dispatch_op_s=2e-6,"
                                        "nvme_write_gbps=1.5,nvme_read_gbps=1,nvme_issue_s=3e-6")
    assert probe_main(["--device", "cpu", "--nvme-dir", nvme_dir]) == 0
    out = capsys.readouterr().out
    assert "nvme_write_gbps  1.5 GB/s" in out and "OFFLOAD_PROBE" in out
    assert "GB free" in out and "host RAM" in out
    assert "nvme: not measured" not in out
    monkeypatch.delenv("OFFLOAD_NVME_DIR", raising=False)
    assert probe_main(["--device", "cpu"]) == 0   # was: the nvme rows gone, unexplained
    assert "nvme: not measured (no --nvme-dir, no OFFLOAD_NVME_DIR)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    # Was: 0 taken as "not given" while -3 was refused.
    (["--io-workers", "0"], "--io-workers 0: must be at least 1"),
    (["--io-workers", "-3"], "--io-workers -3: must be at least 1"),
    # Was: "io_workers=100000:", the keyword's name, which this command has not.
    (["--io-workers", "100000"], "--io-workers 100000: is more than the engine's"),
    (["--json", ""], "--json '': an empty path"),
    # Were: the figures measured, then a traceback writing the file.
    (["--json", "/no/such/dir/figures.json"], "--json '/no/such/dir/figures.json': the "
                                              "directory '/no/such/dir' does not exist"),
    (["--json", tempfile.gettempdir()], f"--json {tempfile.gettempdir()!r}: "
                                        f"{tempfile.gettempdir()!r} is a directory"),
    # Were: "nvme_dir='/no/such'" and the runtime's "or drop 'nvme' from tiers=" (the probe
    # has no tiers option; it measures the disk because a directory was given).
    (["--nvme-dir", "/no/such"], "--nvme-dir '/no/such': '/no/such' does not exist (point it "
                                 "at a writable directory on a local SSD, or leave out "
                                 "--nvme-dir)"),
    (["--nvme-dir", "/x/{rnak}"], "--nvme-dir '/x/{rnak}': bad placeholder"),
    # Were: a RuntimeError traceback measuring a device the probe has no figures for.
    (["--device", "meta"], "--device 'meta': only cpu and cuda are supported"),
    ({"OFFLOAD_NVME_DIR": "/no/such"}, "OFFLOAD_NVME_DIR='/no/such': '/no/such' does not exist "
                                       "(point it at a writable directory on a local SSD, or "
                                       "unset OFFLOAD_NVME_DIR to measure no disk)"),
])
def test_probe_command_argument_errors(argv, message, capsys, monkeypatch):
    if isinstance(argv, dict):   # the environment's
        for name, value in argv.items():
            monkeypatch.setenv(name, value)
        argv = []
    with pytest.raises(SystemExit) as exc:
        probe_main(["--device", "cpu"] + argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_probe_json_is_replaced_whole_and_ctrl_c_is_said(tmp_path, capsys, monkeypatch):
    """--json goes through the atomic writer (a reader never sees half a file; it was a
    plain open()); Ctrl-C while measuring exits 130 with a line, not a traceback."""
    from offload.schedule import probe

    monkeypatch.setenv("OFFLOAD_PROBE", "compute_gflops=50,dispatch_op_s=2e-6")
    monkeypatch.delenv("OFFLOAD_NVME_DIR", raising=False)
    out = tmp_path / "figures.json"
    out.write_text("old")
    written = []
    import offload.util.output_files as output_files
    write_output_file = output_files.write_output_file

    def spy(path, write):
        written.append(path)
        return write_output_file(path, write)
    monkeypatch.setattr(output_files, "write_output_file", spy)
    assert probe_main(["--device", "cpu", "--json", str(out)]) == 0
    assert written == [str(out)]
    assert json.loads(out.read_text())["figures"]["compute_gflops"] == 50
    assert os.listdir(tmp_path) == ["figures.json"]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(probe, "figures_for", interrupted)
    capsys.readouterr()
    assert probe_main(["--device", "cpu"]) == 130
    assert capsys.readouterr().err == "offload-probe: interrupted\n"


@pytest.mark.parametrize("env", [{"OFFLOAD_POLICY": "keep"}, {"OFFLOAD_ENABLED": "0"}])
def test_probe_checks_its_nvme_dir_whatever_the_policy(env, capsys, monkeypatch):
    # Review: validate() skips the directories under keep or disabled, and the probe then
    # failed with a traceback measuring a directory that does not exist.
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        probe_main(["--device", "cpu", "--nvme-dir", "/no/such"])
    assert exc.value.code == 2
    assert "--nvme-dir '/no/such': '/no/such' does not exist" in capsys.readouterr().err


def test_pcie_theoretical_rates():
    assert pcie_gbps(5, 16) == pytest.approx(63.0, abs=0.1)
    assert pcie_gbps(4, 16) == pytest.approx(31.5, abs=0.1)
    assert pcie_gbps(3, 8) == pytest.approx(7.88, abs=0.01)
    assert pcie_gbps(2, 16) == pytest.approx(8.0)
    assert pcie_gbps(9, 16) is None


def test_a_fuller_disk_is_measured_with_fewer_bytes_or_said_once_what_to_do(
        capsys, caplog, monkeypatch):
    """The probe reserved 264 MiB whatever the disk had left after the nvme tier's own
    reservation (half the free space by default): on a disk with less, `auto` logged a
    traceback at every step and never planned, and `offload-probe` ended in a traceback.
    Now it measures with half the room left (measure.py `_probe_bytes`); with too little
    room, it says once what to give instead, and the CLI says it in one line."""
    import logging

    from mounts import mounted

    from offload._ext import load_core

    offload.empty_cache()
    try:
        with mounted("tmpfs", size_bytes=48 << 20) as roomy:
            disk = measure.nvme_figures((roomy,), 2, load_core())
            assert disk["nvme_write_gbps"] > 0 and os.listdir(roomy) == []
        with mounted("tmpfs", size_bytes=12 << 20) as full:
            with pytest.raises(offload.errors.StorageError,
                               match=f"cannot measure the NVMe directory {full}.*OFFLOAD_PROBE"):
                measure.nvme_figures((full,), 2, load_core())
            with pytest.raises(SystemExit) as exit_:
                probe_main(["--device", "cpu", "--nvme-dir", full])
            assert exit_.value.code == 2
            assert "cannot measure the NVMe directory" in capsys.readouterr().err
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 1))
            ctx = offload.activations(model=model, policy="auto", tiers="nvme", nvme_dir=full,
                                      nvme_bytes="4MiB", min_bytes=0)
            with caplog.at_level(logging.WARNING, logger="offload"):
                for _ in range(4):
                    with ctx:
                        model(torch.randn(8, 16)).sum().backward()
            said = [r for r in caplog.records if "could not plan" in r.getMessage()]
            assert len(said) == 1 and said[0].exc_info is None, said
            assert "OFFLOAD_PROBE" in said[0].getMessage()
            ctx.close()
    finally:
        offload.empty_cache()
