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


def test_pareto_script_sets_a_deterministic_cublas_workspace_before_cuda_starts(tmp_path):
    """Strict deterministic kernels make torch refuse every cuBLAS GEMM unless
    CUBLAS_WORKSPACE_CONFIG names a fixed workspace: the script, run on its own (not by
    offload-bench's runner, which sets it for its workers), must set it before CUDA starts.
    The model's construction, the first thing that touches the device, is where it looks."""
    probe = """
import os, sys, torch
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
import gpu_pareto

class Seen(Exception):
    pass

def first_cuda_work(*args, **kwargs):
    print(os.environ.get("CUBLAS_WORKSPACE_CONFIG"), torch.are_deterministic_algorithms_enabled(),
          torch.is_deterministic_algorithms_warn_only_enabled())
    raise Seen

gpu_pareto.LlamaStyle = first_cuda_work
torch.cuda.is_available = lambda: True   # past the no-GPU check, on a machine without one
try:
    gpu_pareto.main(["--device", "cuda"])
except Seen:
    pass
"""
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    run = subprocess.run([sys.executable, "-c", probe, ROOT], capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [":4096:8", "True", "False"]

    run = subprocess.run([sys.executable, "-c", probe, ROOT], capture_output=True, text=True,
                         timeout=120, env=dict(env, CUBLAS_WORKSPACE_CONFIG=":0:0"))
    assert run.returncode == 1 and run.stdout == ""
    assert "CUBLAS_WORKSPACE_CONFIG=':0:0' is not deterministic; unset it or use one of " \
           ":4096:8, :16:8" in run.stderr
