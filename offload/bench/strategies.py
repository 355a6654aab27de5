"""The strategies the benchmark compares: what each does around one training step.

Each strategy runs in a fresh worker process. ``unavailable_reason()`` is a cheap check the
parent makes first (no process is started for a strategy that cannot run); the worker can
still find a strategy unavailable (raise :class:`Unavailable`, or the runtime raises
``ConfigError`` / ``ExtensionUnavailable``), which also makes a "not available" row.

``resident`` says how the worker accounts resident activation bytes for the strategy:
``"counted"`` (storages autograd saves, counted by a hook in an untimed pass), ``"recompute"``
(what stays between forward and backward plus the largest block's recomputed set),
``"stats"`` (the runtime's ``peak_resident_bytes``), ``"stats+block"`` (that plus the largest
block's recomputed set, which the runtime's hooks do not see) or ``None`` (not known: peers
on a GPU).

The rows that checkpoint (``checkpoint``, ``ckpt+save_on_cpu``, and ``recompute`` through the
runtime) all work on the blocks ``policy="recompute"`` picks: offload/schedule/blocks.py.

More strategies can be registered (:func:`register`) by a module named with
``offload-bench --plugin``; the tests register their test-only ones that way
(tests/bench_test_strategies.py), so the shipped CLI has none.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from offload.bench.workload import Workload, checkpointed, load_module

__all__ = ["Strategy", "StepOutcome", "Unavailable", "PUBLIC_STRATEGIES", "SETTLE_MAX_STEPS",
           "auto_unsettled", "register", "get", "names", "load_plugins", "plugins"]

# Untimed steps a strategy may take to settle (Strategy.unsettled) beyond its warm-up before
# its steps are timed anyway (the row then says so). auto's trials take at most 6 steps (2
# rounds of the plan and up to two whole-block strategies: offload/schedule/trials.py); room
# for a re-profile and its trials besides.
SETTLE_MAX_STEPS = 20


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
    extra_warmup: int = 0  # untimed steps it needs beyond --warmup

    def unavailable_reason(self, device: torch.device, nvme_dir: str | None) -> str | None:
        """Why this strategy cannot run on `device` (cheap; called in the parent), or None."""
        return None

    def resident(self, device: torch.device) -> str | None:
        return "counted"

    def unsettled(self, outcome: StepOutcome | None) -> str | None:
        """Why the next step would not yet run what this strategy runs from then on (auto:
        trial steps still to run), or None. The worker runs untimed steps until it is None,
        at most SETTLE_MAX_STEPS; `outcome` is the latest step's (None before the first)."""
        return None

    def step(self, wl: Workload, nvme_dir: str | None, budget: str | None) -> StepOutcome:
        """One forward + backward of `wl` under this strategy."""
        raise NotImplementedError


class NoneStrategy(Strategy):
    name = "none"
    description = "plain autograd: every saved activation stays in device memory"

    def step(self, wl, nvme_dir, budget):
        wl.loss().backward()
        return StepOutcome()


def _need_blocks(wl: Workload) -> None:
    if not wl.blocks:
        raise Unavailable("found no blocks to checkpoint in the model (blocks are the members "
                          "of an nn.ModuleList / nn.Sequential of one layer class: "
                          "offload/schedule/blocks.py)")


class Checkpoint(Strategy):
    name = "checkpoint"
    description = ("torch.utils.checkpoint (non-reentrant) around every block; block inputs "
                   "stay in device memory")

    def resident(self, device):
        return "recompute"

    def step(self, wl, nvme_dir, budget):
        _need_blocks(wl)
        with checkpointed(wl.blocks):
            loss = wl.loss()
        loss.backward()
        return StepOutcome()


class CheckpointSaveOnCpu(Strategy):
    """What Hugging Face's `gradient_checkpointing_kwargs={"offload": True}` (transformers >=
    5.17, `activation_checkpointing_enable(offload=True)`) does: each checkpoint call under
    `save_on_cpu(pin_memory=True)`, so the block inputs go to pinned host RAM with a
    synchronous copy on the compute stream and come back the same way in backward."""

    name = "ckpt+save_on_cpu"
    description = ("checkpoint every block under torch's save_on_cpu(pin_memory=True): "
                   "Hugging Face's offload flag (synchronous copies)")

    def resident(self, device):
        # On CPU save_on_cpu keeps the tensors themselves: what stays is checkpoint's set.
        return "recompute" if device.type == "cpu" else None

    def step(self, wl, nvme_dir, budget):
        _need_blocks(wl)
        # Pinned memory needs an accelerator: on a CPU-only torch, pin_memory=True raises
        # (as Hugging Face's flag does there), and the host is the device anyway.
        with checkpointed(wl.blocks, save_on_cpu_pin_memory=wl.device.type == "cuda"):
            loss = wl.loss()
        loss.backward()
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
        # auto's first step warms up (--warmup covers it), its second profiles: untimed too;
        # its trial steps after that are waited out (unsettled).
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
        # Our hooks see what stays between forward and backward; a block being recomputed
        # saves its own set inside checkpoint, where no outer hook looks.
        return "stats+block" if self.policy == "recompute" else "stats"

    def unsettled(self, outcome):
        if self.policy != "auto":
            return None
        return auto_unsettled(outcome.ctx if outcome is not None else None)

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


def auto_unsettled(ctx: Any) -> str | None:
    """Why the next step of an `auto` context would not run the strategy it settled on, or
    None: no plan yet (warm-up and profile steps), or trial steps still to run
    (offload/schedule/trials.py NOTE [Trials]). Reads the public `ctx.plan`."""
    plan = getattr(ctx, "plan", None)
    if plan is None:
        return "no plan yet"
    if not plan.settled:
        return "trial steps still to run: " + ", ".join(plan.pending)
    return None


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


_BUILTIN: list[Strategy] = [
    NoneStrategy(),
    Checkpoint(),
    Offload("recompute", "recompute", "offload.activations(policy=recompute): checkpoint every "
            "block, its inputs to the tiers (host on a GPU, nvme on CPU) and prefetched back: "
            "unsloth's approach", "nvme", "host"),
    CheckpointSaveOnCpu(),
    Offload("offload-host", "offload", "offload.activations(tiers=host): pinned RAM "
            "(on CPU host IS the device: measures the hooks' cost)", "host", "host"),
    Offload("offload-nvme", "offload", "offload.activations(tiers=nvme): every activation "
            "to the NVMe directory and back", "nvme", "nvme"),
    Offload("auto", "auto", "offload.activations(policy=auto): the scheduler picks keep / "
            "host / nvme / recompute per tensor", "nvme", "host,nvme"),
    SaveOnCpu(),
    TorchTune(),
]

# What `offload-bench` runs by default and lists in --help.
PUBLIC_STRATEGIES: list[str] = [s.name for s in _BUILTIN]
_REGISTRY: dict[str, Strategy] = {s.name: s for s in _BUILTIN}


def register(strategy: Strategy) -> Strategy:
    """Make `strategy` runnable by name (``--strategies NAME``); returns it.

    Called by a plugin module at import (``offload-bench --plugin MODULE``), which the
    parent and every worker run. Registering a name again replaces the earlier strategy.

    Raises:
        ValueError: the name is empty or is one of the built-in strategies.
    """
    if not strategy.name:
        raise ValueError(f"register({strategy!r}): the strategy has no name")
    if strategy.name in PUBLIC_STRATEGIES:
        raise ValueError(f"register({strategy.name!r}): a built-in strategy has this name "
                         f"(built-in: {', '.join(PUBLIC_STRATEGIES)}); choose another")
    _REGISTRY[strategy.name] = strategy
    return strategy


def names() -> list[str]:
    """Every runnable strategy: the built-in ones, then those plugins registered."""
    return list(_REGISTRY)


def get(name: str) -> Strategy:
    """The strategy called `name`.

    Raises:
        KeyError: no such strategy (the message lists the known ones).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r} (choose from: {', '.join(names())})") \
            from None


def load_plugins(specs: list[str] | tuple[str, ...]) -> None:
    """Run each plugin (``package.module`` or ``path/to/file.py``) so that it registers its
    strategies; a module imported before runs again (see :func:`plugins`).

    Raises:
        ValueError: a plugin cannot be imported (the message names it and why).
    """
    for spec in specs:
        load_module(spec, what=f"--plugin {spec!r}", fresh=True)


@contextlib.contextmanager
def plugins(specs: list[str] | tuple[str, ...]) -> Iterator[None]:
    """The plugins' strategies are registered inside, and gone after: one benchmark's
    ``--plugin`` does not change what the next one in this process accepts."""
    saved = dict(_REGISTRY)
    try:
        load_plugins(specs)
        yield
    finally:
        _REGISTRY.clear()
        _REGISTRY.update(saved)
