"""benchmarks/pipeline_bench.py end to end at a tiny size (every variant, gradients
bit-identical), and what it refuses before running anything: an unknown variant ran plain
autograd under that name and reported "bit-identical", a bad setting or a failed run
showed only the launcher's CalledProcessError."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "pipeline_bench.py")
TINY = ["--hidden", "64", "--layers", "2", "--heads", "2", "--seq", "16", "--batch", "2",
        "--steps", "1", "--rounds", "1"]


def _run(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_every_variant_runs_with_gradients_bit_identical(tmp_path):
    done = _run(*TINY, "--nvme-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1].strip() for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| variant")]
    assert rows == ["none", "recompute", "offload-nvme", "auto"], done.stdout
    assert "gradients: bit-identical" in done.stdout, done.stdout
    assert os.listdir(tmp_path) == []   # each run's directory removed


@pytest.mark.parametrize("args, says", [
    (["--variants", "none,checkpoint,offload"],
     "'checkpoint', 'offload' are not among none, recompute, offload-nvme, auto "
     "(offload-bench's checkpoint is recompute here"),
    (["--variants", "nonee"], "'nonee' is not among"),
    (["--variants", "none,none"], "a variant is named twice"),
    (["--variants", "auto", "--budget", "abc"], "--budget: budget='abc': not a size"),
    (["--nvme-max-bw", "fast"], "--nvme-max-bw: nvme_max_bw='fast': not a size"),
    (["--variants", "none", "--nvme-dir", "/nonexistent"],
     "--nvme-dir '/nonexistent': not a directory"),
])
def test_bad_arguments_are_refused_naming_the_option(args, says, tmp_path):
    if "--nvme-dir" not in args:
        args = [*args, "--nvme-dir", str(tmp_path)]
    done = _run(*args, timeout=120)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_a_bad_offload_variable_is_refused_before_any_run(tmp_path):
    done = _run("--variants", "auto", "--nvme-dir", str(tmp_path),
                env={"OFFLOAD_IO_WORKERS": "abc"}, timeout=120)
    assert done.returncode == 2 and "OFFLOAD_IO_WORKERS='abc'" in done.stderr, done.stderr


def test_a_failed_run_shows_its_own_error(tmp_path):
    done = _run(*TINY, "--heads", "3", "--variants", "none", "--nvme-dir", str(tmp_path))
    assert done.returncode == 1, done.stderr
    assert "hidden=64 is not divisible by heads=3" in done.stderr, done.stderr
    assert "the none run (round 1) failed" in done.stderr and \
        "CalledProcessError" not in done.stderr, done.stderr
    assert os.listdir(tmp_path) == []
