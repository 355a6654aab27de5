"""The scheduler's process-wide state, and the `reset()` of each module that keeps some
(what a process-wide reset calls: fork handling, tests): per-model plan caches
(plan_cache.py), blocks told "no block ran" once (session_base.py), what each block's
buffers did (buffers.py, kept in util/per_model.py)."""
from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from schedule_models import small_gpt

import offload
import offload.process
from offload.schedule import buffers, session_base

FAST = "compute_gflops=100,dispatch_op_s=1e-6,nvme_write_gbps=100,nvme_read_gbps=100,nvme_issue_s=1e-6"


@pytest.fixture(autouse=True)
def _setup(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_process_reset_forgets_every_models_plans(nvme_dir):
    """A model's plans outlive its contexts (util/per_model.py); after offload.process.reset()
    its next context warms up and profiles again (no plan), as a fresh process would."""
    model, loss_fn = small_gpt(layers=2, hidden=32, dropout=0.0)
    settings = dict(policy="auto", tiers="nvme", nvme_dir=nvme_dir, min_bytes=0, probe=FAST)

    def step():
        with offload.activations(model=model, **settings) as ctx:
            loss_fn().backward()
        return ctx

    step()                            # warm-up
    assert step().plan is not None    # profiled: planned, kept for the next context
    assert step().plan is not None
    offload.process.reset()
    assert step().plan is None        # warm-up again
    assert step().plan is not None


def test_buffers_reset_makes_the_next_call_find_the_modules_again():
    """A block's modules holding buffers live in the one per-model registry: the process
    reset forgets them, and they die with the block."""
    block = torch.nn.BatchNorm1d(4)
    found = buffers._modules_of(block)
    assert buffers._modules_of(block) is found            # kept between calls
    offload.process.reset()
    assert buffers._modules_of(block) is not found        # found again
    alive = weakref.ref(block)
    del block
    gc.collect()
    assert alive() is None   # the registry does not keep the block (its own buffers) alive


def test_said_once_is_said_again_after_reset(caplog):
    blocks = [torch.nn.Linear(2, 2)]
    with caplog.at_level(logging.INFO, logger="offload"):
        for _ in range(2):
            session_base.say_unrun_once(blocks, "recompute", "nothing recomputed")
        session_base.reset()
        session_base.say_unrun_once(blocks, "recompute", "nothing recomputed")
    assert sum("no block ran through offload" in r.getMessage() for r in caplog.records) == 2
