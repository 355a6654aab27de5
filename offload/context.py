"""`offload.activations()`: the context manager around one training step.

    with offload.activations() as ctx:          # settings from OFFLOAD_* env vars
        loss = model(batch).loss
        loss.backward()
    print(ctx.stats.as_dict())

Construction parses and validates every setting (ConfigError before the first forward;
nothing touches the disk). `__enter__` resolves capacities, opens the tiers and installs the
hooks. `__exit__` removes the hooks wherever they are on torch's stack (hook_stack.py);
the step ends as soon as no saved tensor needs its tiers, at a defined point (NOTE [End of
step] in step.py). When the block raises, everything is freed (slab files, arena space,
hooks) and the original exception propagates unchanged.
"""
from __future__ import annotations

import collections.abc
import logging
import threading
import weakref
from typing import Any

import torch

from . import process
from .config import Config
from . import context_copies
from .context_copies import CopiedAsNew
from .errors import ConfigError, OffloadError, short_repr
from .known_failures import INSIDE_ALLOW_MUTATION, explain_known_failures
from .runtime import hook_stack
from .runtime.hooks import OffloadHooks
from .runtime.no_offload import no_offload
from .runtime.prefetch import new_prefetcher
from .runtime.round_trip import RoundTripPlan, plan_for
from .runtime.step import Step, StepView, close_tiers, finish_pending, steps_alive
from .runtime.tensor_meta import ParamStorages
from .schedule.generators import sweep_lost_modes
from .schedule.session import Session, refreshed, start_session
from .tiers import open_tiers
from .tiers.base import Tier
from .util.gpu_support import may_see_cuda_tensors, require_gpu_paths
from .util.stats import Stats
from .util.trace import TraceRecorder

__all__ = ["activations", "ActivationOffload", "no_offload", "empty_cache"]

log = logging.getLogger("offload")


def activations(*positional: Any, model: torch.nn.Module | None = None, blocks: Any = None,
                **settings: Any) -> "ActivationOffload":
    """Offload the activations autograd saves inside the block to host RAM / NVMe.

    Args:
        model: The model being trained (optional). Its parameters and buffers are recognised
            exactly; without it parameters still are (`nn.Parameter`s, frozen ones included,
            leaves that require grad, and views of them), while buffers such as BatchNorm's
            running statistics are treated like activations (moved only above
            OFFLOAD_MIN_BYTES). `recompute` and `auto` find its repeated blocks
            (offload/schedule/blocks.py).
        blocks: The blocks `recompute` / `auto` work on, instead of the detected ones: a
            module or a list of modules (a ModuleList or ModuleDict stands for its members),
            or a predicate `f(module) -> bool` over `model`'s submodules.
        **settings: Override the OFFLOAD_* environment variables; same names in lower case
            without the prefix: enabled, tiers, nvme_dir, host_bytes, nvme_bytes, min_bytes,
            policy, budget, strict, log, log_ranks, prefetch_bytes, io_workers, nvme_checksum,
            staging_bytes, cpu_heap, nvme_max_bw, probe, trace. `enabled=False` makes the
            context do nothing at all (no hook, no tier; the other settings are parsed but
            not checked against the machine): one flag to compare with and without.

    Returns:
        The context manager; `__enter__` returns it, and `.stats` is readable inside and after
        the block (up to date when read).

    Raises:
        ConfigError: a setting is invalid (names the variable, the value and what to do),
            `recompute` finds no block to checkpoint, or torch can use a GPU but offload's
            GPU paths cannot (names the cause and the fix).

    Example:
        >>> with offload.activations(tiers="nvme", nvme_dir="/mnt/nvme") as ctx:
        ...     model(x).sum().backward()
        >>> ctx.stats.nvme_bytes
    """
    if positional:   # `activations(model)`, the first thing many try
        what = "a model" if isinstance(positional[0], torch.nn.Module) else \
            f"a {type(positional[0]).__name__}"
        raise ConfigError(f"offload.activations() takes keyword arguments only; it was given "
                          f"{what} as a positional argument (pass model=model, and settings "
                          f"by name: tiers=..., policy=...)")
    return ActivationOffload(Config.from_env(**settings), model=model, blocks=blocks)


class ActivationOffload(CopiedAsNew):
    """One offload context; reusable for several steps (`with ctx:` each step)."""

    def __init__(self, config: Config, model: torch.nn.Module | None = None,
                 blocks: Any = None) -> None:
        if isinstance(blocks, collections.abc.Iterator):
            blocks = list(blocks)   # a generator: read once, kept for copies
        self._fresh(config, model, blocks)
        self._session()   # settings checked, blocks found: now, not at the first step

    def _fresh(self, config: Config, model: torch.nn.Module | None, blocks: Any) -> None:
        self._memo: dict | None = None   # a deep copy's, until its first use (`__deepcopy__`)
        self.config = config
        self._model = model   # the `model` property's
        self._blocks = blocks                # as given: what a copy is built with
        self._step: Step | None = None       # the latest block's (offload/runtime/step.py)
        self._steps: weakref.WeakSet[Step] = weakref.WeakSet()  # every one not yet freed
        self._hook_thread: int | None = None   # the thread its hooks are on, while active
        self._round_trip = RoundTripPlan()  # learned across this context's steps (no model=)
        self._schedule: Session | None = None   # `_session()`

    def _session(self) -> Session:
        """recompute / auto: the blocks and the plan (offload/schedule/session.py); a
        disabled context looks for no block and wraps nothing. Started, its settings and
        model checked on this machine, when the context is built; a copy's at its first
        use, its model complete by then (`__reduce__`)."""
        schedule = self._schedule
        if schedule is None:
            self._from_memo()
            self._memo = None
            model = self._model   # found in the memo now (not the property: a step's cost)
            # OFFLOAD_LOG=ERROR quiets the checks' warnings; a disabled context does nothing
            # at all. Only when a level is given: OFFLOAD_LOG_RANKS alone waits for entry.
            if self.config.enabled and self.config.log is not None:
                self.config.apply_log_level()
            _check(self.config, model)
            schedule = self._schedule = start_session(self.config, model, self._blocks) \
                if self.config.enabled else Session(self.config)
        return schedule

    @property
    def plan(self):
        """`auto`'s plan (None before its profile step ends, or under other policies);
        `print(ctx.plan)` explains every decision."""
        return self._session().plan

    # The latest step's state, as the public API and tests read it.
    @property
    def stats(self) -> Stats:
        """The latest step's figures, up to date when read (inside the block too)."""
        step = self._step
        if step is None:
            return Stats()
        step.fold()
        return step.stats

    @property
    def tiers(self) -> dict[str, Tier]:
        return self._step.tiers if self._step is not None else {}

    @property
    def _hooks(self) -> OffloadHooks | None:
        return self._step.hooks if self._step is not None else None

    @property
    def active(self) -> bool:
        return self._hook_thread is not None

    def __repr__(self) -> str:
        config = self.config
        if not config.enabled:
            return "<offload.activations disabled>"
        where = ",".join(config.tiers) + (f" nvme_dir={','.join(config.nvme_dir)}"
                                          if "nvme" in config.tiers else "")
        model = f" model={type(self.model).__name__}" if self.model is not None else ""
        return (f"<offload.activations policy={config.policy} tiers={where}{model}"
                f"{' active' if self.active else ''}>")

    # ---------------------------------------------------------------- enter / exit
    def __enter__(self) -> "ActivationOffload":
        # A KeyboardInterrupt may land between any two lines here: everything this enter
        # claimed or installed is inside a `try` that gives it back, or the context would
        # stay active (or its hooks installed) for good.
        claimed = False
        try:
            with _CLAIM:   # one enter at a time: two threads may not both pass the check
                if self.active:
                    raise _already_active(self._hook_thread)
                claimed = True   # (set first: nobody else can claim it while we hold _CLAIM)
                self._hook_thread = _ENTERING
            return self._enter()
        except BaseException:
            if claimed:
                if isinstance(self._hook_thread, int):   # landed after `_enter` installed all
                    self._finish_interrupted_exit(self._step, self._hook_thread)
                self._hook_thread = None
            raise

    def _enter(self) -> "ActivationOffload":
        if not self.config.enabled:  # OFFLOAD_ENABLED=0: install and open nothing
            self._hook_thread = _DISABLED
            return self
        if torch.autograd.graph._allow_mutation_on_saved_tensors_enabled:
            raise OffloadError(INSIDE_ALLOW_MUTATION)
        finish_pending()  # steps whose graphs died since (NOTE [End of step], point 3)
        sweep_lost_modes()  # generators.py NOTE [Modes and Ctrl-C]
        schedule = self._session()
        model = self._model   # a copy's is found by now (`_session`)
        if schedule.watch is not None:   # blocks added since they were found? (not active)
            schedule = self._schedule = refreshed(schedule, self.config, model, self._blocks)
        config = self.config
        config.apply_log_level()
        stats = Stats()
        alive = steps_alive()
        if alive:
            stats.steps_alive_at_entry = alive
        if config.trace is not None:
            stats.trace = TraceRecorder()
        round_trip = None
        if config.policy == "offload":
            round_trip = plan_for(model, (config.tiers, config.min_bytes)) \
                or self._round_trip
        step = Step(config, stats, round_trip)
        step.tiers = tiers = open_tiers(config, stats, step.copy_streams) \
            if config.policy != "keep" else {}
        try:
            params = ParamStorages()
            if model is not None:
                params.add_module(model)
            prefetcher = new_prefetcher(config.prefetch_bytes, stats)
            step.hooks = OffloadHooks(schedule.placement(round_trip), tiers, step.ledger,
                                      prefetcher, params, config.strict, config.min_bytes,
                                      step.timeline, schedule.clock)
            schedule.enter(StepView(step.hooks, {name: tier.capacity_bytes
                                                 for name, tier in tiers.items()},
                                    prefetcher, step.start_s))
            step.after_finish.append(schedule.step_done)
            previous, self._step = self._step, step
            self._hook_thread = hook_stack.install(step.hooks)
            self._steps.add(step)
        except BaseException:
            if self._step is step:
                self._step = previous
            hook_stack.discard(step.hooks)   # pushed before the interrupt, maybe
            self._hook_thread = _ENTERING    # nothing installed: __enter__ only unclaims
            schedule.exit()
            close_tiers(tiers, stats, reuse=False)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        try:
            return self._exit(exc_type, exc)
        except BaseException:
            if isinstance(self._hook_thread, int):   # NOTE [An interrupted exit]
                self._finish_interrupted_exit(self._step, self._hook_thread)
            raise

    def _exit(self, exc_type, exc) -> bool:
        if self._hook_thread is None:
            error = OffloadError("offload.activations(): exited while not active (exited "
                                 "twice, or never entered)")
            if exc_type is None:
                raise error
            log.error("%s", error)   # said, not raised: never mask the user's exception
            return False
        if self._hook_thread is _DISABLED:
            self._hook_thread = None
            return False
        step = self._step
        entered = self._hook_thread
        # On another thread the hooks cannot be taken off the entering thread's stack: they
        # retire there (hook_stack.py), the step ends as usual, and OffloadError says why.
        on_its_thread = hook_stack.remove(step.hooks, entered)
        self._schedule.exit()  # blocks run as they are again (backward recomputes unwrapped)
        self._hook_thread = None   # last: until here, an interrupt finishes the exit
        if exc_type is not None:
            step.exit_s = step.start_s  # no step time for a failed block
            explain_known_failures(exc)
            if not on_its_thread:   # said, not raised: never mask the user's exception
                log.error("%s", hook_stack.exited_on_another_thread(entered))
            _free_failed_step(step, exc)
            return False  # re-raise the original exception
        # From OFFLOAD_LOG_RANKS only (logs.py). A step whose backward runs after the block
        # says it when that backward ends (step.py `finish`).
        try:
            ended = step.exited()
        except BaseException:   # a Ctrl-C while the step ends: freed as after an exception
            _free_failed_step(step)
            raise
        if ended and log.isEnabledFor(logging.INFO):
            log.info("offload: %s", step.stats.summary())
        if not on_its_thread:
            raise hook_stack.exited_on_another_thread(entered)
        return False

    def _finish_interrupted_exit(self, step: Step, entered: int) -> None:
        """NOTE [An interrupted exit] A KeyboardInterrupt (Ctrl-C) may land between any two
        lines of `__exit__`. Before this, one that landed while it took the hooks off or
        unwrapped the blocks left the context active for good ("already active" at every
        later entry), its hooks on the thread (plain steps packed into the ended step) and
        blocks wrapped. Whatever the exit had not done yet is done here: the hooks retire
        and come off this thread's stack (else its next save or entry takes them off:
        hook_stack `top`), the context is inactive, the blocks' unwrapping finishes (it
        resumes where it stopped: blocks.py `BlockWrappers.__exit__`), and the step is freed
        as after an exception, since the block did not end normally. An exit is over once the
        context is inactive (what raises after that is the exit's own error). Not covered:
        an interrupt on `__exit__`'s first line, before its `try` (as in torch's
        `saved_tensors_hooks`), or a second one inside this cleanup."""
        step.hooks.retire()
        if threading.get_ident() == entered:
            hook_stack.discard(step.hooks)
        self._hook_thread = None
        self._schedule.exit()
        step.exit_s = step.start_s
        _free_failed_step(step)

    def close(self) -> None:
        """Free the tiers of every step of this context now, even if saved tensors still
        refer to them, and drop the stores / arenas kept for the next step
        (`empty_cache()`)."""
        for step in list(self._steps):
            step.abort()
        self._steps = weakref.WeakSet()
        empty_cache()


def _check(config: Config, model: torch.nn.Module | None) -> None:
    """What a context's settings and model need of this machine, checked before a step."""
    config.validate()
    if model is not None and not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model={short_repr(model)}: not a torch.nn.Module (pass the model "
                          "object you train, or leave model= out)")
    if config.enabled and "nvme" in config.tiers and config.policy != "keep":
        from ._ext import load_core

        load_core()  # ExtensionUnavailable (with the reason) now, not mid-step
    if config.policy != "keep" and config.tiers and may_see_cuda_tensors(model):
        # Pinned arenas, side-stream copies and chained NVMe I/O: a missing piece is a
        # ConfigError now, not an error in the middle of the first forward.
        require_gpu_paths(f"offload.activations(tiers={','.join(config.tiers)!r})")


def _already_active(holder) -> OffloadError:
    here = threading.get_ident()
    if holder is _ENTERING or (isinstance(holder, int) and holder != here):
        return OffloadError("offload.activations(): this context is active on another thread; "
                            "a context belongs to one thread at a time (saved-tensor hooks "
                            "are per thread): build one context per thread")
    return OffloadError("offload.activations(): this context is already active (entered "
                        "and not exited yet); exit it before entering it again, as each step "
                        "does (`with ctx:` per step), or nest a different context")


# Pickles made before context_copies.py name a copy's constructor here.
_copied_context = context_copies._copied_context

# `_hook_thread` of an entered context that installed nothing (enabled=False).
_DISABLED = object()
# `_hook_thread` while one thread enters: the context counts as active for every other.
_ENTERING = object()
# Held while a context checks that it is not active and claims itself (microseconds): one
# for all contexts, so a context holds no lock of its own (it can be copied or pickled).
_CLAIM = threading.Lock()


def _free_failed_step(step: Step, error: BaseException | None = None) -> None:
    """Free a step whose block raised `error` (or whose exit was interrupted) at once; its
    report carries the error (step.py StepReport)."""
    try:
        step.abort(error=error)
        empty_cache()  # an exception may end the run: keep no slab file or arena open
    except Exception:  # never mask the user's exception
        log.exception("offload: error while freeing the step after an exception")


def empty_cache() -> None:
    """Close the NVMe stores (their slab files) and the arenas kept for the next step now.

    Like `torch.cuda.empty_cache()`: nothing in use is touched. A store a live context still
    uses stays open and closes when that context is done with it.
    """
    process.empty_cache()
