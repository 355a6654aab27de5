"""benchmarks/gpu_check.sh, the first thing run on a lent GPU, checked on the CPU: it fits
its budget with room for a rerun, its header's cost table is the one its steps run under,
the cuda tests it selects include the check of our declarations against the toolkit
headers, and it ends with exactly one VERDICT line naming what did not pass (run here with
a stand-in Python that plays each step)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
DEVICE_ALLOWANCE_S = 15 * 60   # a lent machine's time per session, start-up included


def _text() -> str:
    with open(SCRIPT) as f:
        return f.read()


def _steps() -> dict[str, int]:
    """Step name -> limit, as the script calls `step NAME LIMIT ...`."""
    return {m[1]: int(m[2]) for m in re.finditer(r"^\s*step (\w+) (\d+) ", _text(), re.M)}


def test_the_steps_fit_the_budget_twice_in_a_device_allowance():
    text = _text()
    budget = int(re.search(r'BUDGET_S="\$\{GPU_CHECK_BUDGET_S:-(\d+)\}"', text)[1])
    limits = _steps()
    assert set(limits) == {"build", "pytest", "bandwidth", "smoke", "probe", "pareto", "bench",
                           "hook_cost"}
    assert sum(limits.values()) <= budget <= 360, (limits, budget)
    assert 2 * budget <= DEVICE_ALLOWANCE_S - 3 * 60   # two runs after a few minutes' start-up
    # The header's table states each step's estimate and the limit it really runs under.
    table = {m[1]: (int(m[2]), int(m[3]))
             for m in re.finditer(r"^#   (\w+)\s+(\d+)\s+(\d+)\s", text, re.M)}
    assert {name: limit for name, (_, limit) in table.items() if name != "total"} == limits
    assert table["total"] == (sum(e for n, (e, _) in table.items() if n != "total"), budget)
    assert all(est < limit for est, limit in table.values())


def test_the_cuda_tests_it_runs_include_the_header_declaration_check():
    marker = re.search(r'pytest -m "([^"]+)"', _text())[1]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", marker, os.path.join(ROOT, "tests", "test_cuda_dlopen.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "test_our_declarations_match_the_toolkit_headers" in proc.stdout, proc.stdout


@pytest.mark.skipif(not os.path.exists("/bin/bash"), reason="needs bash")
def test_one_verdict_line_last_naming_the_steps_that_did_not_pass(tmp_path):
    # A stand-in Python: the Pareto run fails, the cuda tests report one skipped, all else passes.
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    "case \"$*\" in\n"
                    "  *gpu_pareto*) echo 'pareto broke'; exit 3 ;;\n"
                    "  *pytest*) echo '40 passed, 1 skipped in 9.9s' ;;\n"
                    "  *) [[ $1 == - ]] && cat >/dev/null; echo ok ;;\n"
                    "esac\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=str(fake), GPU_CHECK_SKIP="build")
    proc = subprocess.run(["bash", SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    verdicts = [line for line in lines if "VERDICT" in line]
    assert verdicts == [lines[-1]], lines[-12:]
    assert lines[-1] == ("VERDICT: FAIL  steps not passed: build(skip) pareto(3) | cuda tests "
                         "1 skipped (reasons in pytest.log)")
    summary = (out / "summary.txt").read_text().strip().splitlines()
    assert summary[-1] == lines[-1]
    assert "hook_cost" in "\n".join(summary)   # run, or said to be absent: never silent
