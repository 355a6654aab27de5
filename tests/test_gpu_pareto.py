"""benchmarks/gpu_pareto.py runs (tiny, on CPU) and every row is bit-exact: the script the
lent GPU runs must not be the first place it runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


def test_pareto_script_smoke(tmp_path):
    out = tmp_path / "pareto.json"
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), OFFLOAD_MIN_BYTES="0",
               OMP_NUM_THREADS="1",  # a tiny model: two spinning threads only slow it down
               OFFLOAD_PROBE="compute_gflops=100,dispatch_op_s=1e-6")
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_pareto.py"), "--device", "cpu",
         "--hidden", "64", "--layers", "2", "--heads", "4", "--seq", "32", "--vocab", "97",
         "--steps", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["strategy"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"none", "recompute", "offload-host", "auto-50", "auto-30", "auto-15",
                         "sac-matmul"}
    assert all(r["bit_exact"] for r in rows.values()), {k: r["bit_exact"] for k, r in rows.items()}
    assert "| auto-15 |" in run.stdout and "auto plan at budget 15%" in run.stdout
