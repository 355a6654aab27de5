"""The scheduler's side of one `offload.activations()` context: policies `recompute` and
`auto` (the context calls `enter`, `exit` and `step_done`; `keep` and `offload` need none).

`recompute`: every block (offload/schedule/blocks.py) runs under non-reentrant
`torch.utils.checkpoint`; what the outer hooks see (block inputs, tensors outside blocks)
goes to OFFLOAD_TIERS like under `offload`.

`auto`: a state that outlives the context (one per model and settings, like the offload
policy's BouncePlan) goes through
  0. warm-up: the first step runs like `offload` (blocks as they are, every eligible
     storage moved): first calls of kernels and first touches of memory would make a
     profile of it read several times the steady step;
  1. profile: the next step does the same and records (profile.py); at its end the
     probe's figures and the profile make the plan (plan.py), logged in one INFO line;
  2. planned steps: blocks run as they are or with per-op recompute (recompute.py); every
     storage the hooks see gets the plan's keep / host / nvme (`SchedulePlacement.decide`,
     the single decision point);
  3. re-plan: a block called with other shapes than planned finishes that step safely
     (checkpointed, inputs moved; it is also the new shapes' warm-up) and the next step
     profiles again (logged).

NOTE [Trials]. A plan is a prediction. When a whole-block strategy (plan.py PURE:
`offload`, `checkpoint`) is predicted within TRIAL_MARGIN of it (`Plan.trials`), the planned steps
start with TRIAL_ROUNDS rounds that run the plan and each such strategy in turn, and the
steps after run whichever had the fastest step (best of its rounds; a pure strategy must
beat the plan by TRIAL_WIN, so noise does not flip it). The measured seconds and the
choice are in `ctx.plan` (`mode`, `measured`; one INFO line). Every candidate is bit-exact
and keeps no more than the plan, so a trial step costs time at most, never memory or
correctness. A re-plan measures again.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import Any

import torch

from ..config import Config
from ..errors import ConfigError
from ..hooks import no_offload_active
from ..placement import Decision, Placement, TensorInfo
from .blocks import BlockWrappers, block_type_key, find_blocks, ours_innermost
from .profile import BlockProfiler, ItemRecord, Profile, signature
from .plan import PURE, TRIAL_MARGIN
from .recompute import block_inputs, checkpoint_block

__all__ = ["Session", "start_session", "SchedulePlacement"]

log = logging.getLogger("offload")


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

    def step_done(self, stats, hooks, end_s: float) -> None:
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


class RecomputeSession(Session):
    def __init__(self, config: Config, blocks: list) -> None:
        super().__init__(config)
        self.blocks = blocks
        self._wrappers: BlockWrappers | None = None

    def placement(self, bounce) -> Placement:
        return Placement(self.config, bounce, moves=True)

    def enter(self, hooks, start_s: float) -> None:
        pack = hooks.pack

        def run(index, forward, args, kwargs):
            if not ours_innermost(pack) or no_offload_active():  # blocks NOTE [Whose block]
                return forward(*args, **kwargs)
            if _holds_cache(args, kwargs, self):
                return forward(*args, **kwargs)
            return checkpoint_block(forward, args, kwargs)

        self._wrappers = BlockWrappers(self.blocks, run).__enter__()

    def exit(self) -> None:
        if self._wrappers is not None:
            self._wrappers.__exit__(None, None, None)
            self._wrappers = None


# ---------------------------------------------------------------------------- auto
class _AutoState:
    """What `auto` carries from one step to the next."""

    def __init__(self) -> None:
        self.plan = None
        self.profile = None  # the step the plan was made from (re-plan with other figures)
        self.warm = False   # a step ran since the last (re)start: the next one may profile
        self.replan_reason: str | None = "first profile"
        self.lock = threading.Lock()


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


class SchedulePlacement(Placement):
    """`auto`'s decision point: the profile step moves every eligible storage and records
    it; planned steps look each storage up in the plan by where it was saved."""

    def __init__(self, config: Config, session: "AutoSession") -> None:
        super().__init__(config, None, moves=True)
        self.session = session
        self.region: tuple = ("after", -1)
        self.ordinal = 0
        self._forced: Decision | None = None
        self._inputs: dict[int, int] = {}      # storage id -> positional input (checkpoint)
        self._decisions: dict[str, Decision] = {}
        self.items: list[ItemRecord] = []
        self.unplanned = 0

    @contextlib.contextmanager
    def forced(self, decision: Decision):
        """The next pack uses `decision` (a stored op output, recompute.py)."""
        self._forced = decision
        try:
            yield
        finally:
            self._forced = None

    def enter_region(self, region: tuple, inputs: dict[int, int] | None = None) -> None:
        self.region, self.ordinal = region, 0
        self._inputs = inputs or {}

    def target(self, name: str) -> Decision:
        """Decision for a plan target: "keep" or a tier (then the tiers after it to spill)."""
        decision = self._decisions.get(name)
        if decision is None:
            if name == "keep":
                decision = Decision((), "plan: keep")
            else:
                tiers = self.config.tiers
                decision = Decision(tiers[tiers.index(name):] if name in tiers else tiers,
                                    f"plan: {name}")
            self._decisions[name] = decision
        return decision

    def decide(self, info: TensorInfo) -> Decision:
        if self._forced is not None:
            return self._forced
        ordinal = self.ordinal
        self.ordinal += 1
        base = super().decide(info)  # no_offload, small: kept whatever the plan says
        eligible = not base.keep
        session = self.session
        if session.profiler is not None:
            producer, input_index = (None, None)
            if info.storage is not None and self.region[0] == "block":
                producer, input_index = session.profiler.producer_of(info.storage)
            self.items.append(ItemRecord(self.region, ordinal, info.nbytes, info.key, eligible,
                                         producer, input_index))
            return base
        if not eligible:
            return base
        plan = session.plan
        if plan is None or session.mode != "plan":
            # A whole-block strategy (NOTE [Trials]) moves every eligible storage, but
            # those of the blocks `checkpoint` runs as they are within the budget.
            if session.mode == "checkpoint" and self.region[0] == "block" \
                    and self.region[1] in plan.checkpoint_keeps:
                return self.target("keep")
            return base
        block = self.region[1] if self.region[0] == "block" else None
        if block is not None and info.storage is not None and id(info.storage) in self._inputs:
            name = plan.input_targets.get((block, self._inputs[id(info.storage)]))
        else:
            name = plan.item_targets.get((self.region, ordinal))
        if name is None:
            self.unplanned += 1
            return base  # not in the plan (another step shape): move it, memory-safe
        return self.target(name)


class AutoSession(Session):
    def __init__(self, config: Config, state: _AutoState, blocks: list,
                 model: torch.nn.Module | None = None) -> None:
        super().__init__(config)
        self.state = state
        self.blocks = blocks
        self.types = [block_type_key(b) for b in blocks]
        self.profiler: BlockProfiler | None = None
        self._placement: SchedulePlacement | None = None
        self._wrappers: BlockWrappers | None = None
        self._hooks = None
        self._start_s = 0.0
        self._fallback: str | None = None
        self._capacity: dict[str, int] = {}
        self.mode = "plan"   # what this step runs: the plan or a PURE strategy (Trials)
        # The compute device: the model's (CPU without parameters to tell).
        owners = ([model] if model is not None else []) + list(blocks)
        first = next((p for m in owners for p in m.parameters()), None)
        self._device = first.device if first is not None else torch.device("cpu")

    @property
    def plan(self):
        return self.state.plan

    def placement(self, bounce) -> Placement:
        self._placement = SchedulePlacement(self.config, self)
        return self._placement

    def enter(self, hooks, start_s: float) -> None:
        self._hooks, self._start_s = hooks, start_s
        self._fallback = None
        # Tiers are open now (closed again before step_done): note what they may hold.
        self._capacity = {name: tier.capacity_bytes for name, tier in hooks.tiers.items()}
        plan = self.state.plan
        self.mode = "plan" if plan is None else plan.running   # NOTE [Trials]
        if self.mode == "plan" and plan is not None \
                and plan.readahead_bytes > hooks.prefetcher.budget_bytes:
            hooks.prefetcher.budget_bytes = plan.readahead_bytes  # see Plan.readahead_bytes
        if self.state.plan is None and self.state.warm:
            self.profiler = BlockProfiler(self._device.type)
        elif self.state.plan is None:
            BlockProfiler.prime()  # the warm-up step pays for it
            if not self.blocks:
                log.info("offload: auto found no repeated blocks (pass model= or blocks=); "
                         "planning keep / host / nvme for every saved tensor, no recompute")
        else:
            self.profiler = None
        self._wrappers = BlockWrappers(self.blocks, self._run).__enter__()

    def exit(self) -> None:
        if self._wrappers is not None:
            self._wrappers.__exit__(None, None, None)
            self._wrappers = None

    def _run(self, index: int, forward, args: tuple, kwargs: dict):
        hooks, placement = self._hooks, self._placement
        if not ours_innermost(hooks.pack) or no_offload_active():  # blocks NOTE [Whose block]
            return forward(*args, **kwargs)
        inputs = {id(a.untyped_storage()): i
                  for i, a in reversed(list(enumerate(block_inputs(args, kwargs))))}
        placement.enter_region(("block", index), inputs)
        try:
            if self.profiler is not None:
                return self.profiler.run(index, self.types[index],
                                         type(self.blocks[index]).__name__, forward, args,
                                         kwargs, hooks)
            plan = self.state.plan
            if plan is None:  # the warm-up step (session doc, 0)
                return forward(*args, **kwargs)
            if self._fallback is None and plan.signatures.get(index) != signature(args, kwargs):
                self._fallback = (f"block {index} was called with other shapes than planned "
                                  "for")
                log.info("offload: auto: %s; this step checkpoints its blocks, the next one "
                         "profiles and plans again", self._fallback)
            bp = plan.block_plan(index)
            if _holds_cache(args, kwargs, self):
                return forward(*args, **kwargs)
            if self.mode == "checkpoint":
                if index in plan.checkpoint_keeps and self._fallback is None:
                    return forward(*args, **kwargs)
                return checkpoint_block(forward, args, kwargs)
            if self._fallback is not None or bp is None:
                return checkpoint_block(forward, args, kwargs)
            if self.mode == "offload":
                return forward(*args, **kwargs)
            if not bp.per_op:
                return forward(*args, **kwargs)
            from .recompute import run_block

            targets = plan.op_targets
            rset = bp.recompute

            def store(op_id):
                if op_id in rset:
                    return None
                name = targets.get((index, op_id))
                return None if name is None else placement.target(name)

            return run_block(forward, args, kwargs, store, hooks, placement)
        finally:
            placement.enter_region(("after", index))

    def step_done(self, stats, hooks, end_s: float) -> None:
        state = self.state
        if self._fallback is not None:
            with state.lock:
                state.plan, state.replan_reason, state.warm = None, self._fallback, True
            return
        if not state.warm:
            state.warm = True
            return
        if self.profiler is None:
            if self._placement is not None and self._placement.unplanned:
                log.debug("offload: auto: %d saved storages were not in the plan (moved)",
                          self._placement.unplanned)
            plan = state.plan
            if plan is not None:
                with state.lock:
                    settled = plan.trial_done(self.mode, end_s - self._start_s)
                if settled:
                    log.info("offload: auto: measured step %s; running %s", ", ".join(
                        f"{m} {min(t):.3g} s" for m, t in plan.measured.items()),
                        "the plan" if plan.mode == "plan"
                        else f"{plan.mode} ({PURE[plan.mode]})")
            return
        profile = self._profile(stats, hooks, end_s)
        if profile is None:
            return
        from .plan import make_plan
        from .probe import figures_for

        figures = figures_for(self.config, profile.device)
        plan = make_plan(profile, figures, self._params(profile))
        with state.lock:
            reason, state.plan, state.replan_reason = state.replan_reason, plan, None
            state.profile = profile
        log.info("offload: auto plan (%s): %s", reason, plan.summary())
        if plan.trials:
            log.info("offload: auto: measuring the plan against %s (predicted within %.0f%%)",
                     ", ".join(plan.trials), 100 * TRIAL_MARGIN)

    def _profile(self, stats, hooks, end_s: float) -> Profile | None:
        blocks = self.profiler.finish()
        overhead_s = self.profiler.overhead_s  # the profiler's own Python, not the model's
        self.profiler = None
        items = self._placement.items
        timing = {t[0]: t for t in hooks.timings}
        for it in items:
            t = timing.get(it.hooks_key)
            if t is not None:
                it.pack_s = t[2] - self._start_s
                it.unpack_s = None if t[3] is None else t[3] - self._start_s
        first_unpack = hooks.first_unpack_s
        if first_unpack is None:
            log.info("offload: auto: the profiled step ran no backward inside the context's "
                     "lifetime; profiling again next step")
            return None
        forward_s = max(first_unpack - self._start_s - stats.stall_forward_s - overhead_s,
                        1e-6)
        backward_s = max(end_s - first_unpack - stats.stall_backward_s, 1e-6)
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
