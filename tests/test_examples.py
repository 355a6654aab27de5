"""Every script in examples/ runs, at a small size on CPU, as a user would start it (python
or torchrun with 2 gloo ranks), with `--check`: it trains again without offload and exits
non-zero unless the weights are bit-identical. With OFFLOAD_LOG=INFO the per-step lines
show that bytes really went to NVMe (else the comparison proves nothing), and under
torchrun that they come from rank 0 only, naming it. Each rank's NVMe directory must be
empty afterwards (the `nvme_dir` fixture checks it).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from offload._ext import core_available

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SMALL = ["--steps", "2", "--hidden", "64", "--layers", "2", "--seq-len", "64"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]

# script -> (launcher, extra arguments, packages it needs)
RUNS = {
    "plain_loop.py": ([sys.executable], [], ()),
    "checkpoint_offload.py": ([sys.executable], [], ()),
    "ddp_torchrun.py": (TORCHRUN, ["--tiers", "nvme", "--nvme-dir", "{nvme_dir}/{{rank}}"], ()),
    "fsdp2.py": (TORCHRUN, ["--tiers", "nvme", "--nvme-dir", "{nvme_dir}/{{rank}}"], ()),
    "hf_trainer.py": ([sys.executable], ["--vocab", "128"], ("transformers",)),
    "accelerate_loop.py": ([sys.executable], ["--vocab", "128"], ("transformers", "accelerate")),
    "lightning_callback.py": ([sys.executable], [], ("pytorch_lightning",)),
    # LoRA on a tiny Llama: with the base frozen autograd saves only the norms' and
    # activations' inputs, under OFFLOAD_MIN_BYTES at SMALL's batch; 16 x 128 tokens move.
    "trl_sft.py": ([sys.executable], ["--batch", "16", "--seq-len", "128"],
                   ("transformers", "trl", "peft", "datasets")),
}

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not core_available(), reason="offload._C unavailable")]


def test_every_example_is_run():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize("script", sorted(RUNS))
def test_example_runs_bit_exact(script, nvme_dir):
    launcher, extra, needs = RUNS[script]
    for package in needs:
        pytest.importorskip(package, reason=f"{script} needs {package}, which is not installed")
    cmd = launcher + [str(EXAMPLES / script), "--check"] + SMALL \
        + [a.format(nvme_dir=nvme_dir) for a in extra]
    env = {**os.environ, "OFFLOAD_NVME_DIR": nvme_dir, "PYTHONPATH": str(ROOT),
           "OFFLOAD_LOG": "INFO"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-4000:]}"
    ranks = 2 if launcher is TORCHRUN else 1
    assert out.count("bit-exact") == ranks, out[-4000:]
    assert "DIFFERENT" not in out
    # The per-step INFO line: "offload: saved 0.005 GiB (kept 0.001, host 0.000, nvme 0.004)"
    steps = re.findall(r"offload( \[rank \d+\])?: saved .*?, nvme ([\d.]+)\)", out)
    assert steps and all(float(nvme) > 0 for _, nvme in steps), out[-4000:]
    assert {rank for rank, _ in steps} == ({" [rank 0]"} if ranks > 1 else {""}), out[-4000:]


@pytest.mark.parametrize("script", ["ddp_torchrun.py", "fsdp2.py"])
def test_distributed_example_removes_the_parent_it_made(script, nvme_dir):
    # As its default /var/tmp/offload-ddp/{rank} does: the ranks make the parent too, and
    # once the last one is done nothing is left of it (was: the empty parent stayed).
    parent = os.path.join(nvme_dir, "made-here")
    cmd = TORCHRUN + [str(EXAMPLES / script)] + SMALL + ["--tiers", "nvme", "--nvme-dir",
                                                         parent + "/{rank}"]
    env = {k: v for k, v in os.environ.items() if k != "OFFLOAD_NVME_DIR"}
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert not os.path.exists(parent)


def test_checkpoint_every_must_be_at_least_one():
    # Was: a ZeroDivisionError in the first forward.
    proc = subprocess.run([sys.executable, str(EXAMPLES / "checkpoint_offload.py"),
                           "--checkpoint-every", "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: --checkpoint-every 0: must be at least 1" in proc.stderr
