"""benchmarks/buffer_copies.py end to end at a tiny size: one row per model, every time a
real positive figure, and a bad size refused naming the option."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "buffer_copies.py")


def test_buffer_copies_small_run():
    done = subprocess.run([sys.executable, SCRIPT, "--buffer-mib", "0.25", "--rounds", "1",
                           "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| model")]
    assert [row[0].strip() for row in rows] == ["batchnorm", "static buffer",
                                                "static attribute"]
    for row in rows:
        assert all(float(cell) > 0 for cell in row[1:]), row


def test_buffer_copies_refuses_a_size_that_is_not_positive():
    done = subprocess.run([sys.executable, SCRIPT, "--buffer-mib", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--buffer-mib must be positive" in done.stderr
