"""Policy `auto`: the steps of one context, each run on its shape class's plan.

A plan cache that outlives the context (plan_cache.py: one per model and settings, like the
offload policy's RoundTripPlan) goes through
  0. warm-up: the first training step runs like `offload` (blocks as they are, every
     eligible storage moved): first calls of kernels and first touches of memory would
     make a profile of it read several times the steady step;
  1. profile: the first step of each shape class after it does the same and records
     (profile.py); at its end the probe's figures and the profile make the class's plan
     (search.py), logged in one INFO line;
  2. planned steps: blocks run as they are or with per-op recompute (recompute.py); every
     storage the hooks see gets the plan's keep / host / nvme (`SchedulePlacement.decide`,
     the single decision point, reading the step's `StepChoice`); the first ones may be
     trial steps (trials.py NOTE [Trials]);
  3. re-plan: a block called with other shapes than its class's plan (the shapes changed
     within a step) finishes that step safely (it and the blocks after it checkpointed,
     inputs moved) and the class profiles again at its next step (logged).
Only training steps count (step.py NOTE [Training step]): an eval block, a graph kept past
its step or a compiling step neither profiles, nor warms up, nor books a trial.

The shape classes: plan_cache.py NOTE [Shape classes].
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from ..config import Config
from ..runtime.no_offload import no_offload_active
from ..runtime.placement import Placement
from ..runtime.tensor_meta import storage_of
from .blocks import (BlockWrappers, block_type_key, compiled_block, lone_layer_hint,
                     ours_innermost)
from ..util.clock import clock_for
from .constants import SHAPE_REPROFILES, TRIAL_MARGIN
from .costs import PlanParams
from .placement import SchedulePlacement, StepChoice
from .plan_cache import NO_BLOCK, UNTRAINED_SAID, ClassPlan, PlanCache, describe_class
from .probe import figures_for
from .profile import BlockProfiler, Profile, signature, step_times
from .arguments import flatten_call
from .recompute import block_inputs, checkpoint_block, run_block, runs_as_is
from . import collectives
from .reruns import ReRuns
from .search import make_plan
from .session_base import UNRUN, Session, holds_cache, say_unrun_once
from .trials import PURE, refused_by_checkpoint

__all__ = ["AutoSession"]

log = logging.getLogger("offload")

_UNKNOWN = ("unknown",)   # this step's class before its first block call


class AutoSession(Session):
    def __init__(self, config: Config, state: PlanCache, blocks: list,
                 model: torch.nn.Module | None = None) -> None:
        super().__init__(config)
        self.state = state
        self.blocks = blocks
        self._what_to_pass = ("pass model= or blocks=" if model is None else
                              (not blocks and lone_layer_hint(model)) or "pass blocks=")
        self.types = [block_type_key(b) for b in blocks]
        self.opaque = [compiled_block(b) for b in blocks]
        self.choice = StepChoice()   # what this step runs (the placement reads it)
        self._entry: ClassPlan | None = None   # the class plan this step runs
        self._placement: SchedulePlacement | None = None
        self._wrappers: BlockWrappers | None = None
        self._hooks = None
        self._start_s = 0.0
        self._fallback: str | None = None
        self._said_extra = False   # plan.py NOTE [More calls than profiled], said once
        self._reruns = ReRuns(state, blocks, self.types, self.opaque)
        self._ran_as_is: set[int] = set()   # blocks the profile ran as is (Plan.ran_as_is)
        self._capacity: dict[str, int] = {}
        self.key = _UNKNOWN      # this step's shape class (plan_cache NOTE [Shape classes])
        self._profiling = False
        # The compute device: the model's (CPU without parameters to tell).
        owners = ([model] if model is not None else []) + list(blocks)
        first = next((p for m in owners for p in m.parameters()), None)
        self._device = first.device if first is not None else torch.device("cpu")
        self._clock = clock_for(self._device.type)
        self._t0: Any = None
        # id(a step's Stats) -> (class plan, its choice) until it reports (NOTE [Trials])
        self._trial_of: dict[int, tuple[ClassPlan | None, StepChoice]] = {}

    @property
    def plan(self) -> ClassPlan | None:
        return self.state.plan

    def placement(self, round_trip) -> Placement:
        self.choice = StepChoice()
        self._placement = SchedulePlacement(self.config, self.choice)
        return self._placement

    def _saved_so_far(self) -> int:
        """The step's saved bytes so far, small saves included (what a profile's regions
        tell their small saves by: SchedulePlacement.note_small)."""
        self._hooks.ledger.fold()
        return self._hooks.stats.saved_bytes

    def _set_class(self, key, profiling: bool) -> None:
        self.key, self._profiling = key, profiling
        # Record every storage in a profile, and while the class is not known (the step may
        # turn out to profile).
        self.choice.recording = profiling or key is _UNKNOWN

    @property
    def clock(self):
        """What the step marks its backward's start on (the device's clock on CUDA)."""
        return self._clock

    def enter(self, view) -> None:
        self._reruns.many_ranks = collectives.many_ranks()   # (the group may start late)
        self._profile_again(self._reruns.refused_pending())   # (the latest step's `key`)
        self._hooks, self._start_s, self._readahead = view.hooks, view.start_s, view.readahead
        self._placement.saved_so_far = self._saved_so_far
        self._placement.follow(view.hooks.ledger)   # its micro-batches
        self._t0 = self._clock.mark(view.start_s)
        self._fallback = None
        self._shape_miss = False
        self._ran_as_is.clear()
        self.choice.profiler = None
        self._set_class(_UNKNOWN, False)
        # Tiers are open now (closed again before step_done): note what they may hold.
        self._capacity = dict(view.capacities)
        state = self.state
        self._use(state.plan)   # until the first block call tells the class
        if not state.warm:
            BlockProfiler.prime()  # the warm-up step pays for it
            if not self.blocks:
                log.info("offload: auto found no repeated blocks (%s); planning keep / "
                         "host / nvme for every saved tensor, no recompute",
                         self._what_to_pass)
        if not self.blocks:
            self._choose(NO_BLOCK)
        self._wrappers = BlockWrappers(self.blocks, self._run)   # known before any is set
        self._wrappers.__enter__()

    def exit(self) -> None:
        if self._wrappers is not None:
            self._wrappers.__exit__(None, None, None)
            self._wrappers = None

    def _use(self, entry: ClassPlan | None) -> None:
        self._entry = entry
        choice = self.choice
        choice.plan = None if entry is None else entry.plan
        choice.mode = "plan" if entry is None else entry.trial_steps.running  # NOTE [Trials]
        self._trial_of[id(self._hooks.stats)] = (entry, choice)
        if choice.mode == "plan" and entry is not None:
            self._readahead.raise_budget(entry.plan.readahead_bytes)  # Plan.readahead_bytes

    def _choose(self, key) -> None:
        """The step's class is known: run its plan, or profile it (after the warm-up)."""
        entry = self.state.plans.get(key)
        self._use(entry)
        self._set_class(key, entry is None and self.state.warm)
        if self._profiling and key is not NO_BLOCK:
            self.choice.profiler = BlockProfiler(self._device.type,
                                                 min_bytes=self.config.min_bytes)
        if not self.choice.recording:
            self._placement.items.clear()

    def _run(self, index: int, forward, args: tuple, kwargs: dict):
        hooks, placement, choice = self._hooks, self._placement, self.choice
        if not ours_innermost(hooks.pack) or no_offload_active():  # blocks NOTE [Whose block]
            return forward(*args, **kwargs)
        sig = signature(args, kwargs)
        if self.key is _UNKNOWN:
            self._choose((self.types[index], sig))   # plan_cache NOTE [Shape classes]
        plan = choice.plan
        stand_in = index if plan is None else plan.stand_in(index, self.types[index])
        flat = flatten_call(args, kwargs)   # once for the inputs and checkpoint_block
        block = self.blocks[index]
        if runs_as_is(block, flat[0]):   # recompute.py NOTE [Calls that run as is]
            if choice.profiler is not None:
                self._ran_as_is.add(index)
            return forward(*args, **kwargs)
        tensors = block_inputs(args, kwargs, flat[0])
        storages = [storage_of(a) for a in tensors]   # (None: a sparse input)
        inputs = {id(s): i for i, s in reversed(list(enumerate(storages))) if s is not None}
        small_inputs = 0
        if choice.recording:   # (placement.py note_small)
            sizes = {id(s): s.nbytes() for s in storages if s is not None}
            small_inputs = sum(n for n in sizes.values() if n < self.config.min_bytes)
        placement.enter_region(("block", index), inputs, stand_in, small_inputs)
        try:
            if choice.profiler is not None:
                out = choice.profiler.run(index, self.types[index], type(block).__name__,
                                          forward, args, kwargs, hooks, self.opaque[index])
                placement.note_outputs(flatten_call((out,), {})[0])
                placement.note_inputs(index, tensors)   # placement.py NOTE [Inputs only ...]
                return out
            if plan is None or index in self.state.as_is:   # the warm-up step (module doc,
                return forward(*args, **kwargs)   # 0); plan_cache NOTE [Blocks run alike ...]
            if self._fallback is None and index in plan.ran_as_is:   # unfrozen since
                self._fall_back(f"block {index} ran as is in the profiled step (it needed no "
                                "gradient) and needs one now")
            if self._fallback is None and (stand_in is None
                                           or sig not in plan.signatures.get(stand_in, ())):
                self._fall_back(f"block {index} was called with other shapes than planned for"
                                if stand_in is not None else f"block {index} (a "
                                f"{type(block).__name__}) is of a type the profiled step did "
                                "not run", shape_miss=True)
            if holds_cache(args, kwargs, self.blocks):
                return forward(*args, **kwargs)
            watch = self._reruns.context_fn(index, self._on_collective)
            whole = functools.partial(checkpoint_block, forward, args, kwargs, watch, block,
                                      flat, checked=True)   # the block recomputed whole
            if placement.beyond_profile and choice.mode != "offload":   # plan.py NOTE [More
                # calls than profiled]; the `offload` trial moves everything already
                self._say_extra(block, plan.visits[("block", index)])
                return whole()
            if choice.mode == "checkpoint":
                if index in plan.checkpoint_keeps and self._fallback is None:
                    return forward(*args, **kwargs)
                choice.checkpointed = True   # (a step that raised drops it: NOTE [Trials])
                return whole()
            bp = plan.block_plan(stand_in)
            if self._fallback is not None or bp is None:
                return whole()
            if choice.mode == "offload" or not bp.per_op:
                return forward(*args, **kwargs)
            if self.opaque[index]:   # compiled: recomputed whole (profile.WHOLE_BLOCK)
                return whole()
            store = placement.op_decisions(plan, bp, stand_in, stand_in != index)
            return run_block(forward, args, kwargs, store, hooks, placement, block,
                             bp.positions, flat, self._changed_later(self.types[stand_in]),
                             checked=True, watch=watch)
        finally:
            placement.enter_region(("after", index))

    def _profile_again(self, reason: str | None) -> None:
        """The class of this context's latest step profiles again, saying `reason`."""
        if reason and self.key in self.state.plans:
            with self.state.lock:
                self.state.profile_again(self.key, reason)

    def _on_collective(self, reason: str) -> None:
        """A block called a collective its profile did not see (reruns.py): it and the
        blocks after it run checkpointed this step, and the class profiles again."""
        self._fallback = self._fallback or reason

    def _say_extra(self, block, profiled: int) -> None:
        """Said once per context (plan.py NOTE [More calls than profiled])."""
        if not self._said_extra:
            self._said_extra = True
            log.info("offload: auto: a %s was called more times in a step than in the "
                     "profiled one (%d): its extra calls run checkpointed, their inputs moved",
                     type(block).__name__, profiled)

    def _changed_later(self, type_key):
        """What a block's re-run tells of a stored output that was changed in place after the
        profile (stored_ops.py Rule 1; it ran that op again): the class profiles again at its
        next step, and no later plan stores that op of this block type."""
        def changed(op_id: tuple) -> None:
            with self.state.lock:
                self.state.changed_ops.add((type_key, op_id))
            if self._fallback is None:
                self._fallback = "an op output the plan stored was changed in place later"
        return changed

    def step_done(self, report) -> None:
        entry, choice = self._trial_of.pop(id(report.stats), (None, None))
        if report.failed and entry is not None and choice.checkpointed \
                and refused_by_checkpoint(report.error):   # trials.py NOTE [Trials]
            with self.state.lock:
                entry.trial_steps.drop(choice.mode, known=report.error is not None)
            return
        if report.failed:   # reruns.py NOTE [A re-run refused]
            reason = self._reruns.failed(report.error)
            if self._hooks is not None and report.stats is self._hooks.stats:
                self._profile_again(reason)
            else:   # an earlier step's: `key` is another's; said at the next entry
                self._reruns.unsaid = self._reruns.unsaid or reason
        if self.state.untrained(report.training):   # why ctx.plan stays None
            log.info("offload: auto has not planned: its last %d steps were not training "
                     "steps (a forward and its own backward inside the context: not an eval "
                     "block, not a graph kept alive with retain_graph past the step, not a "
                     "step torch.compile compiled in); ctx.plan stays None until one runs",
                     UNTRAINED_SAID)
        if self._hooks is None or report.stats is not self._hooks.stats:
            # NOTE [Steps alive at once] Another step of this context was entered before this
            # one ended (one entry per micro-batch, the backwards after all the forwards):
            # what the session holds of a step (its class, profiler, placement, clock) is
            # that later step's now. This one is not learned from; the later one is.
            log.debug("offload: auto: a later step entered before this one ended; not "
                      "profiled or timed")
            return
        state = self.state
        if not report.training:   # step.py NOTE [Training step]
            if self._profiling or self.key is _UNKNOWN:
                log.debug("offload: auto: not a training step; not profiled or timed")
            return
        ran, mode = self._entry, self.choice.mode
        if self.key is _UNKNOWN:   # no block ran through us (plan_cache NOTE [Shape classes])
            self._choose(NO_BLOCK)
        key = self.key
        if self._fallback is not None:
            with state.lock:
                if self._shape_miss and key in state.plans:
                    keep = state.shape_misses.get(key, 0) >= SHAPE_REPROFILES
                    state.shape_misses[key] = state.shape_misses.get(key, 0) + 1
                    if keep:
                        state.ran(key)   # still in use: not the least recently run
                        return
                state.profile_again(key, self._fallback)
            return
        if not state.warm:
            state.warm = True
            return
        if self._profiling:
            self._make_plan(key, report)
            return
        entry = state.plans.get(key)
        if entry is None or entry is not ran:
            return
        if self._placement is not None and self._placement.unplanned:
            log.debug("offload: auto: %d saved storages were not in the plan (moved)",
                      self._placement.unplanned)
        over = mode == "plan" and state.kept_more_than_planned(
            key, report.stats.peak_resident_bytes, entry.plan)
        if over:
            log.info("offload: auto: %s; its shape class profiles again", over)
            return
        trials = entry.trial_steps
        with state.lock:
            state.ran(key)
            if state.shape_misses.get(key, 0) < SHAPE_REPROFILES:
                state.shape_misses.pop(key, None)   # its plan held this step's calls
            trials.completed(mode)
            settled = trials.pending and trials.done(
                mode, self._clock.seconds(self._t0, self._clock.mark(report.end_s)))
        if settled:
            log.info("offload: auto: measured step %s; running %s", ", ".join(
                f"{m} {seconds:.3g} s" for m, seconds in trials.means().items()),
                "the plan" if trials.mode == "plan" else f"{trials.mode} ({PURE[trials.mode]})")

    def _fall_back(self, reason: str, shape_miss: bool = False) -> None:
        """This step runs its blocks from here on checkpointed, and its class profiles
        again, unless it keeps its plan through calls of other shapes
        (`PlanCache.keeps_plan`)."""
        self._fallback, self._shape_miss = reason, shape_miss
        if not (shape_miss and self.state.keeps_plan(self.key)):
            log.info("offload: auto: %s; it and the blocks after it run checkpointed this "
                     "step, and its shape class profiles again", reason)

    def _make_plan(self, key, report) -> None:
        profile = self._profile(report)
        if profile is None:
            return
        for b in profile.blocks if self.state.changed_ops else ():   # (_changed_later)
            for op in b.ops:
                if (b.type_key, op.op_id) in self.state.changed_ops:
                    op.not_storable = op.not_storable or "changed in place in a later step"
        self.state.learn_as_is(profile.blocks)   # plan_cache NOTE [Blocks run alike ...]
        unrun = key is NO_BLOCK and bool(self.blocks)
        notes = (f"{UNRUN}: planned keep / host / nvme per saved tensor, nothing "
                 "recomputed",) if unrun else ()
        plan = make_plan(profile, figures_for(self.config, profile.device),
                         PlanParams.of(self.config, profile, self._capacity), notes)
        if unrun:
            say_unrun_once(self.blocks, "auto", "planning keep / host / nvme per saved "
                           "tensor, nothing recomputed")
        state = self.state
        with state.lock:
            reason = state.reasons.pop(key, None) or (
                "first profile" if not state.plans else f"new class: {describe_class(key)}")
            entry = state.install(key, plan)
            state.profile = profile
        log.info("offload: auto plan (%s): %s", reason, entry.summary())
        if plan.trials:
            log.info("offload: auto: measuring the plan against %s (predicted within %.0f%%)",
                     ", ".join(plan.trials), 100 * TRIAL_MARGIN)

    def _profile(self, report) -> Profile | None:
        profiler, self.choice.profiler = self.choice.profiler, None
        self._placement.note_small()   # what the step saved after its last block
        blocks = profiler.finish() if profiler is not None else []
        # The profiler's own Python, not the model's (host time: the device does not wait)
        overhead_s = profiler.overhead_s if profiler is not None else 0.0
        items = self._placement.items
        times = step_times(items, report, self._clock, self._t0, self._start_s, overhead_s)
        if times is None:
            log.info("offload: auto: the profiled step ran no backward inside the context's "
                     "lifetime; profiling again next step")
            return None
        items = [*items, *self._placement.unsaved_records(blocks)]   # unsaved_outputs.py
        # Blocks no call of which the step profiled (a frozen block called on a tensor that
        # needs grad too, a discriminator on generated data, was profiled: not one of them)
        unprofiled = frozenset(self._ran_as_is - {b.index for b in blocks})
        for b in blocks:   # reruns.py: the plan must not count on re-running those
            b.learned_as_is = b.index in self.state.as_is
        return Profile(self._device, *times, report.stats.saved_bytes, blocks, items,
                       dict(self._placement.visits), unprofiled)

