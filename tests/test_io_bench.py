"""io_bench end to end at a tiny size: the JSON has the documented shape, the engine's
figures are real numbers, and nothing is left in the directory."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("with_fio", [False, True])
def test_io_bench_small_run(nvme_dir, tmp_path, with_fio):
    if with_fio and shutil.which("fio") is None:
        pytest.skip("fio is not installed")
    out = tmp_path / "io.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "io_bench.py"), "--dir", nvme_dir,
           "--size", "8MiB", "--trace-size", "8MiB", "--iodepth", "4", "--rounds", "1",
           "--json", str(out)]
    if not with_fio:
        cmd.append("--no-fio")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert set(result) >= {"engine", "fio", "deepspeed", "trace"}
    for key in ("write_gbps", "read_gbps"):
        assert result["engine"][key] > 0
        if with_fio:
            assert result["fio"][key] > 0
    if not with_fio:
        assert result["fio"] is None
    assert "engine" in done.stdout   # the printed table


@pytest.mark.parametrize("args,message", [
    (["--size", "lots"], "argument --size: size 'lots': not a size"),
    (["--size", "8MiB"], "--size must be at least --block-size x --iodepth"),
    (["--rounds", "0"], "--rounds must be at least 1"),
])
def test_io_bench_rejects_bad_arguments(nvme_dir, args, message):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "io_bench.py"),
                           "--dir", nvme_dir, *args], capture_output=True, text=True)
    assert done.returncode == 2
    assert message in done.stderr
