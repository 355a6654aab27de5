"""The scheduler's side of one `offload.activations()` context: policies `recompute` and
`auto` (the context calls `enter`, `exit` and `step_done`; `keep` and `offload` need none).

`recompute`: every block (offload/schedule/blocks.py) runs under non-reentrant
`torch.utils.checkpoint`; what the outer hooks see (block inputs, tensors outside blocks)
goes to OFFLOAD_TIERS like under `offload`. Buffers stay exact across the re-run
(offload/schedule/buffers.py); under torch.compile blocks run as compiled (blocks.py NOTE
[Wrapping], rule 3).

`auto`: a state that outlives the context (one per model and settings, like the offload
policy's BouncePlan) goes through
  0. warm-up: the first training step runs like `offload` (blocks as they are, every
     eligible storage moved): first calls of kernels and first touches of memory would
     make a profile of it read several times the steady step;
  1. profile: the first step of each shape class after it does the same and records
     (profile.py); at its end the probe's figures and the profile make the class's plan
     (plan.py), logged in one INFO line;
  2. planned steps: blocks run as they are or with per-op recompute (recompute.py); every
     storage the hooks see gets the plan's keep / host / nvme (`SchedulePlacement.decide`,
     the single decision point);
  3. re-plan: a block called with other shapes than its class's plan (the shapes changed
     within a step) finishes that step safely (it and the blocks after it checkpointed,
     inputs moved) and the class profiles again at its next step (logged).
Only training steps count (step.py NOTE [Training step]): an eval block, a graph kept past
its step or a compiling step neither profiles, nor warms up, nor books a trial.

NOTE [Shape classes] A step's shape class is the signature (shapes, dtypes) of its first
block call; each class gets its own plan, kept across steps (the MAX_PLANS most recently
run), so a run whose lengths vary (unpadded batches) profiles each length once and plans
from then on. Until the first block call the class is not known: the storages saved before
it follow the plan of the latest step's class where their size is the one planned for, else
move (memory-safe), and are recorded in case this step turns out to profile. A block the
profiled step did not run (layer drop) uses the decisions of the nearest profiled block of
its type (`Plan.stand_in`), with what that one keeps moved instead (memory-safe). A step in
which no block ran through us (a torch.compile'd model: blocks.py NOTE [Wrapping], rule 3)
is its own class, planned keep / host / nvme per saved tensor with nothing recomputed
(said once, and in `ctx.plan`).

NOTE [Trials]. A plan is a prediction. When a whole-block strategy (plan.py PURE:
`offload`, `checkpoint`) is predicted within TRIAL_MARGIN of it (`Plan.trials`), the planned steps
start with TRIAL_ROUNDS rounds that run the plan and each such strategy in turn, and the
steps after run whichever had the fastest step (best of its rounds; a pure strategy must
beat the plan by TRIAL_WIN, so noise does not flip it). The measured seconds and the
choice are in `ctx.plan` (`mode`, `measured`; one INFO line). Every candidate is bit-exact
and keeps no more than the plan, so a trial step costs time at most, never memory or
correctness. A re-plan measures again. Steps are timed on the device's clock
(offload/schedule/clock.py): on CUDA the host's is launch time.
"""
from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch

from ..config import Config
from ..errors import ConfigError
from ..runtime.no_offload import no_offload_active
from ..runtime.placement import Placement
from .blocks import BlockWrappers, block_type_key, find_blocks, ours_innermost
from .clock import clock_for
from .placement import SchedulePlacement
from .profile import BlockProfiler, Profile, signature
from .plan import PURE, TRIAL_MARGIN
from .recompute import block_inputs, checkpoint_block

__all__ = ["Session", "start_session", "SchedulePlacement", "MAX_PLANS"]

log = logging.getLogger("offload")

MAX_PLANS = 32   # shape classes whose plans are kept (NOTE [Shape classes])

_NO_BLOCK = None          # the shape class of a step in which no block ran through us
_UNKNOWN = ("unknown",)   # this step's class before its first block call


class Session:
    """`keep` / `offload`: nothing to do."""

    plan = None

    def placement(self, bounce) -> Placement:
        return Placement(self.config, bounce)

    def __init__(self, config: Config) -> None:
        self.config = config

    def enter(self, hooks, start_s: float) -> None:
        pass

    def exit(self) -> None:
        pass

    def step_done(self, stats, hooks, end_s: float, training: bool = True) -> None:
        pass


def start_session(config: Config, model: torch.nn.Module | None, blocks: Any) -> Session:
    """The session for `config.policy`; raises ConfigError when `recompute` finds no block."""
    if config.policy == "recompute":
        found = find_blocks(model, blocks)
        if not found:
            what = "model=" if model is None and blocks is None else "the model"
            raise ConfigError(
                f"{config.where('policy')}: found no blocks to checkpoint in {what} (blocks are "
                "the members of an nn.ModuleList / nn.Sequential of one layer class); pass "
                "model=, or blocks=[...] / blocks=lambda m: isinstance(m, MyLayer)")
        return RecomputeSession(config, found)
    if config.policy == "auto":
        found = find_blocks(model, blocks)
        return AutoSession(config, _auto_state(model, config, found), found, model)
    return Session(config)


def _holds_cache(args: tuple, kwargs: dict, session: Session) -> bool:
    """Whether a block call got a key/value cache object (Hugging Face `Cache`): the forward
    appends to it, so a recompute would replay against a changed cache. Such a call runs as
    is (warned once): recompute needs a block that is a function of its inputs, as
    torch.utils.checkpoint does."""
    for value in (*args, *kwargs.values()):
        if value is not None and type(value).__name__.endswith("Cache") \
                and hasattr(value, "update"):
            if not getattr(session, "_warned_cache", False):
                session._warned_cache = True
                log.warning("offload: a block got a %s (use_cache=True): it runs as is, not "
                            "recomputed; pass use_cache=False when training",
                            type(value).__name__)
            return True
    return False


# Blocks whose "no block ran through offload" was said once (first block of the list).
_said_unrun: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()

_UNRUN = ("no block ran through offload in a training step (a torch.compile'd model runs its "
          "blocks inside the compiled graph, as it compiles without offload; blocks the model "
          "checkpoints itself are its own)")


def _say_unrun_once(blocks: list, policy: str, consequence: str) -> None:
    if blocks and blocks[0] not in _said_unrun:
        _said_unrun.add(blocks[0])
        log.info("offload: %s: %s; %s", policy, _UNRUN, consequence)


class RecomputeSession(Session):
    def __init__(self, config: Config, blocks: list) -> None:
        super().__init__(config)
        self.blocks = blocks
        self._wrappers: BlockWrappers | None = None
        self._ran = 0

    def placement(self, bounce) -> Placement:
        return Placement(self.config, bounce, moves=True)

    def enter(self, hooks, start_s: float) -> None:
        pack = hooks.pack
        self._ran = 0

        def run(index, forward, args, kwargs):
            if not ours_innermost(pack) or no_offload_active():  # blocks NOTE [Whose block]
                return forward(*args, **kwargs)
            if _holds_cache(args, kwargs, self):
                return forward(*args, **kwargs)
            self._ran += 1
            return checkpoint_block(forward, args, kwargs, block=self.blocks[index])

        self._wrappers = BlockWrappers(self.blocks, run).__enter__()

    def exit(self) -> None:
        if self._wrappers is not None:
            self._wrappers.__exit__(None, None, None)
            self._wrappers = None

    def step_done(self, stats, hooks, end_s: float, training: bool = True) -> None:
        if training and not self._ran:
            _say_unrun_once(self.blocks, "recompute", "what the step saved went to "
                            "OFFLOAD_TIERS and nothing was recomputed")


# ---------------------------------------------------------------------------- auto
class _AutoState:
    """What `auto` carries from one step to the next: a plan per shape class."""

    def __init__(self) -> None:
        self.plans: OrderedDict = OrderedDict()   # class -> Plan, least recently run first
        self.profile = None  # the latest profile (re-plan it with other figures)
        self.warm = False    # a training step ran: from now on a class without plan profiles
        self.last = _NO_BLOCK  # the class of the latest step that ran or made a plan
        self.reasons: dict = {}  # class -> why it profiles again (in its plan's log line)
        self.lock = threading.Lock()

    @property
    def plan(self):
        """The plan of the latest step's class (`ctx.plan`)."""
        return self.plans.get(self.last)

    @plan.setter
    def plan(self, plan) -> None:
        self.plans[self.last] = plan

    def ran(self, key) -> None:
        """`key`'s plan ran (or was made) now; keep the MAX_PLANS most recent."""
        self.last = key
        if key in self.plans:
            self.plans.move_to_end(key)
        while len(self.plans) > MAX_PLANS:
            self.plans.popitem(last=False)


_states: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
_states_lock = threading.Lock()


def _auto_state(model, config: Config, blocks: list) -> _AutoState:
    key = (config.tiers, config.min_bytes, str(config.budget), config.nvme_max_bw,
           str(config.probe), tuple(id(b) for b in blocks), config.host_bytes,
           config.nvme_bytes, config.staging_bytes)
    if model is None:
        return _AutoState()  # the context keeps its own (reuse the context object)
    with _states_lock:
        return _states.setdefault(model, {}).setdefault(key, _AutoState())


def _compiled(block: torch.nn.Module) -> bool:
    """A block that is a torch.compile'd module of its own (or whose forward is compiled):
    its ops run inside compiled code our dispatch modes cannot see into."""
    frames = sys.modules.get("torch._dynamo.eval_frame")
    if frames is not None and isinstance(block, frames.OptimizedModule):
        return True
    return getattr(block.forward, "_torchdynamo_orig_callable", None) is not None


def _shapes(key) -> str:
    """A shape class for a log line: its first tensor argument's shape."""
    for sig in (key or ((),))[0]:
        if sig is not None:
            return f"block input {tuple(sig[0])}"
    return "other block inputs"


class AutoSession(Session):
    def __init__(self, config: Config, state: _AutoState, blocks: list,
                 model: torch.nn.Module | None = None) -> None:
        super().__init__(config)
        self.state = state
        self.blocks = blocks
        self.types = [block_type_key(b) for b in blocks]
        self.opaque = [_compiled(b) for b in blocks]
        self.profiler: BlockProfiler | None = None
        self._placement: SchedulePlacement | None = None
        self._wrappers: BlockWrappers | None = None
        self._hooks = None
        self._start_s = 0.0
        self._fallback: str | None = None
        self._capacity: dict[str, int] = {}
        self.key = _UNKNOWN      # this step's shape class (NOTE [Shape classes])
        self.current = None      # the plan this step runs (None: warm-up or profile)
        self._profiling = False
        self.mode = "plan"   # what this step runs: the plan or a PURE strategy (Trials)
        # The compute device: the model's (CPU without parameters to tell).
        owners = ([model] if model is not None else []) + list(blocks)
        first = next((p for m in owners for p in m.parameters()), None)
        self._device = first.device if first is not None else torch.device("cpu")
        self._clock = clock_for(self._device.type)
        self._t0: Any = None
        self._t_backward: Any = None

    @property
    def plan(self):
        return self.state.plan

    @property
    def recording(self) -> bool:
        """Whether the placement records every storage: a profile, or a step whose class
        is not known yet (it may turn out to profile)."""
        return self._profiling or self.key is _UNKNOWN

    def placement(self, bounce) -> Placement:
        self._placement = SchedulePlacement(self.config, self)
        return self._placement

    def enter(self, hooks, start_s: float) -> None:
        self._hooks, self._start_s = hooks, start_s
        self._t0, self._t_backward = self._clock.mark(start_s), None
        hooks.on_first_unpack = self._backward_starts
        self._fallback = None
        self.profiler, self._profiling, self.key = None, False, _UNKNOWN
        # Tiers are open now (closed again before step_done): note what they may hold.
        self._capacity = {name: tier.capacity_bytes for name, tier in hooks.tiers.items()}
        state = self.state
        self._use(state.plan)   # until the first block call tells the class
        if not state.warm:
            BlockProfiler.prime()  # the warm-up step pays for it
            if not self.blocks:
                log.info("offload: auto found no repeated blocks (pass model= or blocks=); "
                         "planning keep / host / nvme for every saved tensor, no recompute")
        if not self.blocks:
            self._choose(_NO_BLOCK)
        self._wrappers = BlockWrappers(self.blocks, self._run).__enter__()

    def exit(self) -> None:
        if self._wrappers is not None:
            self._wrappers.__exit__(None, None, None)
            self._wrappers = None

    def _backward_starts(self) -> None:
        self._t_backward = self._clock.mark(self._hooks.first_unpack_s)

    def _use(self, plan) -> None:
        self.current = plan
        self.mode = "plan" if plan is None else plan.running   # NOTE [Trials]
        prefetcher = self._hooks.prefetcher
        if self.mode == "plan" and plan is not None \
                and plan.readahead_bytes > prefetcher.budget_bytes:
            prefetcher.budget_bytes = plan.readahead_bytes  # see Plan.readahead_bytes

    def _choose(self, key) -> None:
        """The step's class is known: run its plan, or profile it (after the warm-up)."""
        self.key = key
        plan = self.state.plans.get(key)
        if plan is not None:
            self._use(plan)
        else:
            self._use(None)
            self._profiling = self.state.warm
            if self._profiling and key is not _NO_BLOCK:
                self.profiler = BlockProfiler(self._device.type)
        if not self.recording:
            self._placement.items.clear()

    def _run(self, index: int, forward, args: tuple, kwargs: dict):
        hooks, placement = self._hooks, self._placement
        if not ours_innermost(hooks.pack) or no_offload_active():  # blocks NOTE [Whose block]
            return forward(*args, **kwargs)
        sig = signature(args, kwargs)
        if self.key is _UNKNOWN:
            self._choose(sig)
        plan = self.current
        stand_in = index if plan is None else plan.stand_in(index, self.types[index])
        inputs = {id(a.untyped_storage()): i
                  for i, a in reversed(list(enumerate(block_inputs(args, kwargs))))}
        placement.enter_region(("block", index), inputs, stand_in)
        block = self.blocks[index]
        try:
            if self.profiler is not None:
                return self.profiler.run(index, self.types[index], type(block).__name__,
                                         forward, args, kwargs, hooks, self.opaque[index])
            if plan is None:  # the warm-up step (session doc, 0)
                return forward(*args, **kwargs)
            if self._fallback is None and (stand_in is None
                                           or plan.signatures.get(stand_in) != sig):
                self._fallback = (f"block {index} was called with other shapes than planned "
                                  "for")
                log.info("offload: auto: %s; it and the blocks after it run checkpointed "
                         "this step, and its shape class profiles again", self._fallback)
            if _holds_cache(args, kwargs, self):
                return forward(*args, **kwargs)
            if self.mode == "checkpoint":
                if index in plan.checkpoint_keeps and self._fallback is None:
                    return forward(*args, **kwargs)
                return checkpoint_block(forward, args, kwargs, block=block)
            bp = plan.block_plan(stand_in)
            if self._fallback is not None or bp is None:
                return checkpoint_block(forward, args, kwargs, block=block)
            if self.mode == "offload" or not bp.per_op:
                return forward(*args, **kwargs)
            from .recompute import run_block

            targets = plan.op_targets
            rset = bp.recompute
            moved = stand_in != index

            def store(op_id):
                if op_id in rset:
                    return None
                name = targets.get((stand_in, op_id))
                return None if name is None else placement.target(name, moved)

            return run_block(forward, args, kwargs, store, hooks, placement, block,
                             bp.positions)
        finally:
            placement.enter_region(("after", index))

    def step_done(self, stats, hooks, end_s: float, training: bool = True) -> None:
        hooks.on_first_unpack = None
        state = self.state
        if not training:   # step.py NOTE [Training step]
            if self._profiling or self.key is _UNKNOWN:
                log.debug("offload: auto: not a training step; not profiled or timed")
            return
        ran, mode = self.current, self.mode
        if self.key is _UNKNOWN:   # no block ran through us (NOTE [Shape classes])
            self._choose(_NO_BLOCK)
        key = self.key
        if self._fallback is not None:
            with state.lock:
                state.plans.pop(key, None)
                state.reasons[key] = self._fallback
            return
        if not state.warm:
            state.warm = True
            return
        if self._profiling:
            self._make_plan(key, stats, hooks, end_s)
            return
        plan = state.plans.get(key)
        if plan is None or plan is not ran:
            return
        if self._placement is not None and self._placement.unplanned:
            log.debug("offload: auto: %d saved storages were not in the plan (moved)",
                      self._placement.unplanned)
        with state.lock:
            state.ran(key)
            settled = plan.pending and plan.trial_done(
                mode, self._clock.seconds(self._t0, self._clock.mark(end_s)))
        if settled:
            log.info("offload: auto: measured step %s; running %s", ", ".join(
                f"{m} {min(t):.3g} s" for m, t in plan.measured.items()),
                "the plan" if plan.mode == "plan" else f"{plan.mode} ({PURE[plan.mode]})")

    def _make_plan(self, key, stats, hooks, end_s: float) -> None:
        profile = self._profile(stats, hooks, end_s)
        if profile is None:
            return
        from .plan import make_plan
        from .probe import figures_for

        figures = figures_for(self.config, profile.device)
        plan = make_plan(profile, figures, self._params(profile))
        if key is _NO_BLOCK and self.blocks:
            plan.notes.append(f"{_UNRUN}: planned keep / host / nvme per saved tensor, "
                              "nothing recomputed")
            _say_unrun_once(self.blocks, "auto", "planning keep / host / nvme per saved "
                            "tensor, nothing recomputed")
        state = self.state
        with state.lock:
            reason = state.reasons.pop(key, None) or (
                "first profile" if not state.plans else f"new shapes: {_shapes(key)}")
            state.plans[key] = plan
            state.profile = profile
            state.ran(key)
        log.info("offload: auto plan (%s): %s", reason, plan.summary())
        if plan.trials:
            log.info("offload: auto: measuring the plan against %s (predicted within %.0f%%)",
                     ", ".join(plan.trials), 100 * TRIAL_MARGIN)

    def _profile(self, stats, hooks, end_s: float) -> Profile | None:
        profiler, self.profiler = self.profiler, None
        blocks = profiler.finish() if profiler is not None else []
        # The profiler's own Python, not the model's (host time: the device does not wait)
        overhead_s = profiler.overhead_s if profiler is not None else 0.0
        items = self._placement.items
        timing = {t[0]: t for t in hooks.timeline.rows()}
        for it in items:
            t = timing.get(it.hooks_key)
            if t is not None:
                it.pack_s = t[2] - self._start_s
                it.unpack_s = None if t[3] is None else t[3] - self._start_s
        clock = self._clock
        if self._t_backward is None:
            log.info("offload: auto: the profiled step ran no backward inside the context's "
                     "lifetime; profiling again next step")
            return None
        forward_s = clock.seconds(self._t0, self._t_backward)
        backward_s = clock.seconds(self._t_backward, clock.mark(end_s))
        if not clock.device:
            forward_s -= overhead_s
        forward_s = max(forward_s - stats.stall_forward_s, 1e-6)
        backward_s = max(backward_s - stats.stall_backward_s, 1e-6)
        return Profile(self._device, forward_s, backward_s, stats.saved_bytes, blocks, items)

    def _params(self, profile: Profile):
        from .plan import PlanParams

        config = self.config
        budget = 0 if config.budget is None else config.budget.resolve(profile.saved_bytes)
        cpu = profile.device.type == "cpu"
        tiers = tuple(t for t in config.tiers if not (cpu and t == "host"))
        capacity = {t: self._capacity[t] for t in tiers if t in self._capacity}
        return PlanParams(budget_bytes=budget, tiers=tiers, capacity_bytes=capacity,
                          device_type=profile.device.type, staging_bytes=config.staging_bytes)
