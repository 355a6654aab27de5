"""Deep graphs (runtime/deep_graphs.py NOTE [Deep graphs]): the warning before torch's stack
overflow, and the fix it gives."""
from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch

import offload
from offload.runtime import deep_graphs


def chain(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = x.sin()          # saves its input: the chain of saves the note describes
    return x


@pytest.fixture
def fresh(monkeypatch):
    """A process that has not warned yet, with a small threshold (no deep graph needed)."""
    monkeypatch.setattr(deep_graphs, "_warned", False)
    monkeypatch.setattr(deep_graphs, "DEEP_GRAPH_NODES", 200)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "autograd nodes" in r.getMessage()]


def test_the_probe_tells_whether_a_read_grad_fn_stays_with_its_node():
    y = torch.zeros(1, requires_grad=True) * 2
    y.grad_fn
    kept = sys.getrefcount(y.grad_fn) > 1
    assert deep_graphs.torch_keeps_node_objects() is kept


@pytest.mark.parametrize("min_bytes", [0, None])   # stored saves, and small ones only
def test_a_deep_step_warns_once_with_the_fix(fresh, caplog, monkeypatch, min_bytes):
    monkeypatch.setattr(deep_graphs, "_keeps_node_objects", True)
    caplog.set_level(logging.WARNING, logger="offload")
    kwargs = {"tiers": "host"} if min_bytes is None else {"tiers": "host", "min_bytes": 0}
    for _ in range(2):
        x = torch.randn(16, requires_grad=True)
        with offload.activations(**kwargs):
            loss = chain(x, 300).sum()
            loss.backward()
        del loss
    (message,) = warnings_of(caplog)                   # once per process
    assert "made 301 autograd nodes" in message or "made 302 autograd nodes" in message
    assert "ulimit -s unlimited" in message and "RLIMIT_STACK" in message


def test_no_warning_below_the_threshold_or_on_a_torch_that_frees_iteratively(
        fresh, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="offload")
    monkeypatch.setattr(deep_graphs, "_keeps_node_objects", True)
    x = torch.randn(16, requires_grad=True)
    with offload.activations(tiers="host", min_bytes=0):
        chain(x, 100).sum().backward()                 # 101 nodes: below 200
    monkeypatch.setattr(deep_graphs, "_keeps_node_objects", False)
    with offload.activations(tiers="host", min_bytes=0):
        chain(x, 300).sum().backward()                 # deep, but torch frees it in a loop
    assert warnings_of(caplog) == []


def test_the_fix_the_warning_gives_lets_a_deep_chain_be_freed(tmp_path):
    # 60,000 nodes overflow the default 8 MiB stack on this torch when offload has read
    # their grad_fn; with the limit raised the step runs and the graph is freed.
    script = textwrap.dedent("""
        import resource, torch, offload
        soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
        resource.setrlimit(resource.RLIMIT_STACK, (hard, hard))
        torch.set_num_threads(1)
        x = torch.randn(64, requires_grad=True)
        y = x
        with offload.activations(tiers="host", min_bytes=0):
            for _ in range(60_000):
                y = y.sin()
            y.sum().backward()
            del y
        print("freed", x.grad.shape)
    """)
    _, hard = __import__("resource").getrlimit(__import__("resource").RLIMIT_STACK)
    if hard != __import__("resource").RLIM_INFINITY and hard < 256 << 20:
        pytest.skip(f"the hard stack limit ({hard >> 20} MiB) leaves no room to raise it")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "freed torch.Size([64])" in done.stdout
