"""Deep graphs (runtime/deep_graphs.py NOTE [Deep graphs]): the warning before torch's stack
overflow, and the fix it gives."""
from __future__ import annotations

import logging
import re
import resource
import subprocess
import sys
import textwrap
import threading

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


@pytest.mark.skipif(not torch.__version__.startswith("2.13."),
                    reason="the node objects' lifetime was checked on torch 2.13 only (a "
                           "44,000-op chain with grad_fn read dies there)")
@pytest.mark.parametrize("inference", [False, True])
def test_the_probe_finds_that_torch_213_keeps_node_objects(monkeypatch, inference):
    monkeypatch.setattr(deep_graphs, "_keeps_node_objects", None)
    with torch.inference_mode(inference):     # asked from anywhere: the same answer
        assert deep_graphs.torch_keeps_node_objects() is True


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
    # the chain's 300 nodes (and the sum's, counted when the warning comes at the exit)
    assert re.search(r"made 30[012] autograd nodes", message), message
    assert "ulimit -s 262144" in message and "RLIMIT_STACK" in message


def test_the_warning_comes_at_the_backwards_start_before_the_graph_can_be_freed(
        fresh, caplog, monkeypatch):
    monkeypatch.setattr(deep_graphs, "_keeps_node_objects", True)
    caplog.set_level(logging.WARNING, logger="offload")
    x = torch.randn(16, requires_grad=True)
    with offload.activations(tiers="host", min_bytes=0):
        chain(x, 300).sum().backward()           # the graph is freed here, in the block
        assert len(warnings_of(caplog)) == 1


def test_a_backward_on_another_thread_counts_the_forwards_nodes(fresh, caplog, monkeypatch):
    # Autograd's device threads run a CUDA backward, and every thread counts its own nodes:
    # the count must come from the node being run, not from the thread that runs it.
    monkeypatch.setattr(deep_graphs, "_keeps_node_objects", True)
    caplog.set_level(logging.WARNING, logger="offload")
    x = torch.randn(16, requires_grad=True)
    with offload.activations(tiers="host", min_bytes=0):
        loss = chain(x, 300).sum()
        worker = threading.Thread(target=loss.backward)
        worker.start()
        worker.join()
        assert len(warnings_of(caplog)) == 1
    del loss


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
        resource.setrlimit(resource.RLIMIT_STACK, (256 << 20, hard))   # the warning's fix
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
    _, hard = resource.getrlimit(resource.RLIMIT_STACK)
    if hard != resource.RLIM_INFINITY and hard < 256 << 20:
        pytest.skip(f"the hard stack limit ({hard >> 20} MiB) leaves no room to raise it")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "freed torch.Size([64])" in done.stdout
