"""Test-only strategies for offload-bench, registered as a plugin
(`offload-bench --plugin tests/bench_test_strategies.py`): they exist so tests can prove the
benchmark's own checks work, and are no part of the shipped CLI.

- `corrupt`: `none`, then one gradient element moved by one ulp (the gradient check must
  catch the smallest possible difference).
- `corrupt-early`: the same in the second step only (only a check of every step sees it).
- `pooled-arena`: `none` plus a staging arena pooled between steps like the runtime's (the
  RSS peak must count memory kept between steps).
- `crash`: the worker is killed mid-step (the parent must report it and clean up).
- `never-settles`: `none` that always says it has not settled (the worker must stop waiting
  for it after SETTLE_MAX_STEPS untimed steps, and the row must say so).
"""
from __future__ import annotations

import os
import signal

import torch

from offload.bench.strategies import NoneStrategy, register


def _nudge_one_grad(model: torch.nn.Module) -> None:
    for p in model.parameters():
        if p.grad is not None and p.grad.numel():
            flat = p.grad.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype,
                                                            device=flat.device))
            return


class Corrupt(NoneStrategy):
    name = "corrupt"
    description = "test only: none, then one gradient element nudged by one ulp"

    def step(self, wl, nvme_dir, budget):
        outcome = super().step(wl, nvme_dir, budget)
        _nudge_one_grad(wl.model)
        return outcome


class CorruptEarly(NoneStrategy):
    name = "corrupt-early"
    description = "test only: none, one gradient element nudged in the 2nd step only"

    def __init__(self):
        self._calls = 0  # one worker process per run: counts this run's steps

    def step(self, wl, nvme_dir, budget):
        outcome = super().step(wl, nvme_dir, budget)
        self._calls += 1
        if self._calls == 2:
            _nudge_one_grad(wl.model)
        return outcome


class PooledArena(NoneStrategy):
    """`none` plus what the runtime's NVMe tier does on CPU: a staging arena taken from
    offload/tiers/pool.py, its pages touched, handed back for the next step."""

    name = "pooled-arena"
    description = "test only: none + a 64 MiB pooled arena touched every step"
    ARENA_BYTES = 64 << 20

    def unavailable_reason(self, device, nvme_dir):
        from offload._ext import core_unavailable_reason

        return core_unavailable_reason()

    def step(self, wl, nvme_dir, budget):
        from offload._ext import load_core
        from offload.tiers import pool

        core = load_core()
        arena = pool.take("nvme-staging", ("bench-test", self.ARENA_BYTES),
                          lambda: core.HostArena(self.ARENA_BYTES, pinned=False))
        block = arena.allocate(self.ARENA_BYTES)
        torch.frombuffer(block, dtype=torch.uint8).fill_(1)  # touch every page
        del block
        outcome = super().step(wl, nvme_dir, budget)
        pool.give_back("nvme-staging", ("bench-test", self.ARENA_BYTES), arena)
        return outcome


class Crash(NoneStrategy):
    """The worker process dies (SIGKILL) in its first step, leaving debris behind for the
    parent to clean up and report."""

    name = "crash"
    description = "test only: the worker is killed mid-step"

    def step(self, wl, nvme_dir, budget):
        for d in filter(None, (nvme_dir or "").split(",")):
            open(os.path.join(d, "debris"), "wb").close()  # what a crashed runtime could leave
        os.kill(os.getpid(), signal.SIGKILL)


class NeverSettles(NoneStrategy):
    name = "never-settles"
    description = "test only: none, never settled"

    def unsettled(self, outcome):
        return "test only: never settles"


for _strategy in (Corrupt(), CorruptEarly(), PooledArena(), Crash(), NeverSettles()):
    register(_strategy)
