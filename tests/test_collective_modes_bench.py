"""benchmarks/collective_modes.py end to end at a tiny size: one row of real positive
figures, and a bad size refused naming the option."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "collective_modes.py")


def test_collective_modes_small_run():
    done = subprocess.run([sys.executable, SCRIPT, "--hidden", "64", "--layers", "2",
                           "--seq-len", "16", "--rounds", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| checkpoint")]
    assert len(rows) == 1 and all(float(cell) > 0 for cell in rows[0]), done.stdout


def test_collective_modes_refuses_a_size_that_is_not_positive():
    done = subprocess.run([sys.executable, SCRIPT, "--layers", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--layers must be positive" in done.stderr
