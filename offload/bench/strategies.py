"""The strategies the benchmark compares: what each does around one training step.

Each strategy runs in a fresh worker process. ``unavailable_reason()`` is a cheap check the
parent makes first (no process is started for a strategy that cannot run); the worker can
still find a strategy unavailable (raise :class:`Unavailable`, or the runtime raises
``ConfigError`` / ``ExtensionUnavailable``), which also makes a "not available" row.

``resident`` says how the worker accounts resident activation bytes for the strategy:
``"counted"`` (storages autograd saves, counted by a hook in an untimed pass), ``"recompute"``
(what stays between forward and backward plus the largest block's recomputed set),
``"stats"`` (the runtime's ``peak_resident_bytes``) or ``None`` (not known: peers on a GPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from offload.bench.workload import Workload

__all__ = ["Strategy", "Unavailable", "STRATEGIES", "PUBLIC_STRATEGIES", "get"]


class Unavailable(Exception):
    """The strategy cannot run here; the message says why (it becomes the row's reason)."""


@dataclass
class StepOutcome:
    stats: dict[str, Any] | None = None  # offload.activations stats of this step
    ctx: Any = None                      # the runtime context (for --explain)
    nvme_direct: bool | None = None      # the NVMe store used O_DIRECT (None: no store seen)


class Strategy:
    name: str = ""
    description: str = ""
    hidden: bool = False   # test-only strategies: accepted by --strategies, never listed
    extra_warmup: int = 0  # untimed steps it needs beyond --warmup

    def unavailable_reason(self, device: torch.device, nvme_dir: str | None) -> str | None:
        """Why this strategy cannot run on `device` (cheap; called in the parent), or None."""
        return None

    def resident(self, device: torch.device) -> str | None:
        return "counted"

    def step(self, wl: Workload, nvme_dir: str | None, budget: str | None) -> StepOutcome:
        """One forward + backward of `wl` under this strategy."""
        raise NotImplementedError


class NoneStrategy(Strategy):
    name = "none"
    description = "plain autograd: every saved activation stays in device memory"

    def step(self, wl, nvme_dir, budget):
        wl.loss().backward()
        return StepOutcome()


def _nudge_one_grad(model: torch.nn.Module) -> None:
    for p in model.parameters():
        if p.grad is not None and p.grad.numel():
            flat = p.grad.view(-1)
            flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype,
                                                            device=flat.device))
            return


class Corrupt(NoneStrategy):
    """Test-only: `none` with one gradient element moved by one ulp after backward.

    Exists so a test can prove the gradient check catches the smallest possible difference.
    """

    name = "corrupt"
    description = "test only: none, then one gradient element nudged by one ulp"
    hidden = True

    def step(self, wl, nvme_dir, budget):
        outcome = super().step(wl, nvme_dir, budget)
        _nudge_one_grad(wl.model)
        return outcome


class CorruptEarly(NoneStrategy):
    """Test-only: like `corrupt`, but only in the second step the worker runs (the first
    timed one with --warmup 1); the last step is clean, so only a check of every step sees it.
    """

    name = "corrupt-early"
    description = "test only: none, one gradient element nudged in the 2nd step only"
    hidden = True

    def __init__(self):
        self._calls = 0  # one worker process per run: counts this run's steps

    def step(self, wl, nvme_dir, budget):
        outcome = super().step(wl, nvme_dir, budget)
        self._calls += 1
        if self._calls == 2:
            _nudge_one_grad(wl.model)
        return outcome


class PooledArena(NoneStrategy):
    """Test-only: `none` plus what the runtime's NVMe tier does on CPU: a staging arena taken
    from offload/tiers/pool.py, its pages touched, handed back for the next step.

    Exists so a test can prove the RSS peak counts memory kept between steps (the baseline
    after the warm-up must not swallow it).
    """

    name = "pooled-arena"
    description = "test only: none + a 64 MiB pooled arena touched every step"
    hidden = True
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
    """Test-only: the worker process dies (SIGKILL) in its first step, leaving debris behind
    for the parent to clean up and report."""

    name = "crash"
    description = "test only: the worker is killed mid-step"
    hidden = True

    def step(self, wl, nvme_dir, budget):
        import os
        import signal

        for d in filter(None, (nvme_dir or "").split(",")):
            open(os.path.join(d, "debris"), "wb").close()  # what a crashed runtime could leave
        os.kill(os.getpid(), signal.SIGKILL)


class Recompute(Strategy):
    name = "recompute"
    description = "torch.utils.checkpoint around every block (non-reentrant)"

    def resident(self, device):
        return "recompute"

    def step(self, wl, nvme_dir, budget):
        if not wl.blocks:
            raise Unavailable("found no blocks to checkpoint in the model (it needs an "
                              "nn.ModuleList or nn.Sequential of layers)")
        wl.loss(recompute=True).backward()
        return StepOutcome()


def _runtime_reason() -> str | None:
    try:
        import offload
    except Exception as exc:  # a half-built package can fail in many ways; report it
        return f"the offload runtime does not import ({type(exc).__name__}: {exc})"
    if not hasattr(offload, "activations"):
        return "offload.activations() is not implemented yet (runtime not installed)"
    return None


class Offload(Strategy):
    """`offload.activations(policy=..., tiers=...)` around forward and backward."""

    def __init__(self, name: str, policy: str, description: str,
                 cpu_tiers: str, cuda_tiers: str):
        self.name, self.policy, self.description = name, policy, description
        self._tiers = {"cpu": cpu_tiers, "cuda": cuda_tiers}
        # auto's first step warms up (--warmup covers it), its second profiles: untimed too.
        self.extra_warmup = 1 if policy == "auto" else 0

    def tiers(self, device: torch.device) -> str:
        return self._tiers["cuda" if device.type == "cuda" else "cpu"]

    def kwargs(self, device, nvme_dir, budget, model=None) -> dict[str, Any]:
        tiers = self.tiers(device)
        kw: dict[str, Any] = {"tiers": tiers, "policy": self.policy, "model": model}
        if "nvme" in tiers:
            kw["nvme_dir"] = nvme_dir
        if budget is not None and self.policy == "auto":
            kw["budget"] = budget
        return kw

    def resident(self, device):
        return "stats"

    def unavailable_reason(self, device, nvme_dir):
        reason = _runtime_reason()
        if reason or self.policy != "auto":
            return reason
        # `auto` is the policy that lands last: ask the runtime itself whether it exists yet.
        import offload
        from offload.errors import OffloadError

        try:
            offload.activations(**self.kwargs(device, nvme_dir, None))
        except OffloadError as exc:
            return str(exc)
        return None

    def step(self, wl, nvme_dir, budget):
        import offload

        with offload.activations(**self.kwargs(wl.device, nvme_dir, budget, wl.model)) as ctx:
            loss = wl.loss()
            direct = _store_direct(ctx)  # the tiers close when backward is done
            loss.backward()
        return StepOutcome(stats=ctx.stats.as_dict(), ctx=ctx, nvme_direct=direct)


def _store_direct(ctx: Any) -> bool | None:
    """Whether the runtime's NVMe store does O_DIRECT I/O (None: no nvme tier open).

    Buffered I/O (tmpfs, or a file system that refused O_DIRECT) parks the written bytes in
    the page cache / shmem, which is RAM that RSS does not show. The runtime exposes the
    store's `direct` only on its tier object, so this reads it there, defensively.
    """
    tier = (getattr(ctx, "tiers", None) or {}).get("nvme")
    store = getattr(tier, "_store", None)
    direct = getattr(store, "direct", None)
    return None if direct is None else bool(direct)


class SaveOnCpu(Strategy):
    name = "save_on_cpu"
    description = "torch.autograd.graph.save_on_cpu (pinned on CUDA); on CPU it moves nothing"

    def resident(self, device):
        # On CPU the "copies" are the tensors themselves; on a GPU only the allocator knows.
        return "counted" if device.type == "cpu" else None

    def step(self, wl, nvme_dir, budget):
        with torch.autograd.graph.save_on_cpu(pin_memory=wl.device.type == "cuda"):
            loss = wl.loss()
        loss.backward()
        return StepOutcome()


class TorchTune(Strategy):
    name = "torchtune"
    description = "torchtune.training.OffloadActivations (CUDA streams; GPU only)"

    def resident(self, device):
        return None

    def unavailable_reason(self, device, nvme_dir):
        if device.type != "cuda":
            return f"needs a CUDA GPU (device is {device.type})"
        try:
            from torchtune.training import OffloadActivations  # noqa: F401
        except Exception as exc:
            return (f"torchtune is not importable ({type(exc).__name__}: {exc}); "
                    "pip install torchtune")
        return None

    def step(self, wl, nvme_dir, budget):
        from torchtune.training import OffloadActivations

        with OffloadActivations():
            loss = wl.loss()
        loss.backward()
        return StepOutcome()


_ALL: list[Strategy] = [
    NoneStrategy(),
    Recompute(),
    Offload("offload-host", "offload", "offload.activations(tiers=host): pinned RAM "
            "(on CPU host IS the device: measures the hooks' cost)", "host", "host"),
    Offload("offload-nvme", "offload", "offload.activations(tiers=nvme): every activation "
            "to the NVMe directory and back", "nvme", "nvme"),
    Offload("auto", "auto", "offload.activations(policy=auto): the scheduler picks keep / "
            "host / nvme / recompute per tensor", "nvme", "host,nvme"),
    SaveOnCpu(),
    TorchTune(),
    Corrupt(),
    CorruptEarly(),
    PooledArena(),
    Crash(),
]

STRATEGIES: dict[str, Strategy] = {s.name: s for s in _ALL}
PUBLIC_STRATEGIES: list[str] = [s.name for s in _ALL if not s.hidden]


def get(name: str) -> Strategy:
    return STRATEGIES[name]
