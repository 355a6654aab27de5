"""What `auto` carries from one step to the next: a plan per shape class, per model.

A `PlanCache` holds, per shape class (NOTE [Shape classes] below), a `ClassPlan`:
the class's immutable `Plan` and its `TrialSteps` (trials.py). One cache per model and
settings lives in a process-wide registry keyed weakly by the model (it goes with the
model), so the contexts of a training loop share it; `reset()` empties the registry.

NOTE [Shape classes] A step's shape class is the type and signature (shapes, dtypes) of its
first block call (two towers of other block types picked per batch, or a GAN's generator and
discriminator steps in one context, the discriminator's running the generator under
`no_grad`, are classes of their own: in one class each step of the
other kind would run every block checkpointed, of a type its plan has not); each class gets
its own plan, kept across steps (the MAX_PLANS most recently run), so a run whose lengths
vary (unpadded batches) profiles each length once and plans from then on. A plan holds every
call its profiled step made: a step of micro-batches of two lengths (gradient accumulation
in one context) runs one plan for both. A call with other shapes than the plan holds runs
checkpointed, with the blocks after it, and the class profiles again; after SHAPE_REPROFILES
such profiles with no step between them that its plan held (calls of another shape every
other step: the profiled step may never see them) the class keeps its plan for good, and
such calls run checkpointed (said once). Until the first block call the class is not known:
the storages saved before it follow the plan of the latest step's class where their size is
the one planned for, else move (memory-safe), and are recorded in case this step turns out
to profile. A block the profiled step did not run (layer drop) uses the decisions of the
nearest profiled block of its type (`Plan.stand_in`), with what that one keeps moved instead
(memory-safe). A step in which no block ran through us (a torch.compile'd model: blocks.py
NOTE [Wrapping], rule 3) is its own class, planned keep / host / nvme per saved tensor with
nothing recomputed (said once, and in `ctx.plan`).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any

import torch

from ..config import Config
from ..util import per_model
from ..util.sizes import format_bytes
from .constants import KEPT_SLACK, KEPT_SLACK_BYTES, MAX_PLANS, SHAPE_REPROFILES
from .explain import render, summary
from .plan import Plan
from .trials import TrialSteps

__all__ = ["ClassPlan", "PlanCache", "NO_BLOCK", "UNTRAINED_SAID", "cache_for", "describe_class"]

log = logging.getLogger("offload")

NO_BLOCK = None   # the shape class of a step in which no block ran through us
UNTRAINED_SAID = 3   # steps, before the first training step, not one: said at this many


def describe_class(key) -> str:
    """A shape class for a log line: its first block's type and first tensor argument's
    shape."""
    if not key:
        return "no block"
    block_type, (args, _) = key
    shape = next((f" {tuple(sig[0])}" for sig in args if sig is not None), "")
    return f"a {block_type[0]}'s input{shape}"


class ClassPlan:
    """One shape class's plan and its trial steps: what `ctx.plan` is.

    Every attribute of the `Plan` reads through (`ctx.plan.blocks`, `.prediction`, ...);
    `mode`, `measured`, `settled`, `running` and `pending` are the trial steps' (copies:
    the session alone changes them), and printing it renders both (explain.py)."""

    __slots__ = ("plan", "trial_steps")

    def __init__(self, plan: Plan, trial_steps: TrialSteps | None = None) -> None:
        self.plan = plan
        self.trial_steps = trial_steps if trial_steps is not None else TrialSteps(plan.trials)

    def __getattr__(self, name: str) -> Any:
        if name in ClassPlan.__slots__:   # not set yet (copy, unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.plan, name)

    @property
    def mode(self) -> str:
        return self.trial_steps.mode

    @property
    def measured(self) -> dict[str, list[float]]:
        return {m: list(t) for m, t in self.trial_steps.measured.items()}

    @property
    def settled(self) -> bool:
        return self.trial_steps.settled

    @property
    def running(self) -> str:
        return self.trial_steps.running

    @property
    def pending(self) -> list[str]:
        return list(self.trial_steps.pending)

    def summary(self) -> str:
        return summary(self.plan, self.trial_steps.mode)

    def explain(self) -> str:
        return render(self.plan, self.trial_steps)

    __str__ = explain

    def __repr__(self) -> str:
        return f"<auto plan: {self.summary()}; runs {self.running}>"


class PlanCache:
    """The plans of one model and settings, per shape class, the MAX_PLANS most recently
    run kept; and what the steps learned on the way (warm-up done, the latest profile)."""

    def __init__(self) -> None:
        self.plans: OrderedDict = OrderedDict()   # class -> ClassPlan, least recent first
        self.profile = None  # the latest profile (re-plan it with other figures)
        self.warm = False    # a training step ran: from now on a class without plan profiles
        self.last = NO_BLOCK  # the class of the latest step that ran or made a plan
        self.reasons: dict = {}  # class -> why it profiles again (in its plan's log line)
        # class -> steps in a row that met calls of other shapes than its plans held
        self.shape_misses: dict = {}
        # Blocks that run as they are in every step, whatever its plan or trial (NOTE
        # [Blocks run alike on every rank]): a profile saw them call a collective, or their
        # inputs change in place after the call.
        self.as_is: set[int] = set()
        # (block type, op id) whose stored output a forward changed in place after a profile
        # that did not see it (stored_ops.py Rule 1): never stored by a later plan.
        self.changed_ops: set[tuple] = set()
        # class -> whether it is yet to be said, of those that profiled again for keeping
        # more than planned (NOTE [Kept more than planned])
        self.kept_over: dict = {}
        self.untrained_steps = 0   # steps in a row, before the first training step, not one
        self.lock = threading.Lock()

    def keeps_plan(self, key) -> bool:
        """NOTE [Shape classes]: class `key` keeps its plan through calls of other shapes
        (said once per class)."""
        misses = self.shape_misses.get(key, 0)
        if misses == SHAPE_REPROFILES:
            log.info("offload: auto: block calls with other shapes than planned for keep "
                     "coming after %d profiles of shapes %s; its plan stays, and such calls "
                     "run checkpointed with the blocks after them", misses,
                     describe_class(key))
        return misses >= SHAPE_REPROFILES

    def untrained(self, training: bool) -> bool:
        """Count a step that ended (step.py NOTE [Training step]); True once, when the first
        UNTRAINED_SAID steps were not training steps: the session says why ctx.plan stays
        None (a GAN step keeping its loss, and the graph it retained, until the next step
        never planned, silently)."""
        if training or self.warm:
            self.untrained_steps = 0
            return False
        self.untrained_steps += 1
        return self.untrained_steps == UNTRAINED_SAID

    @property
    def plan(self) -> ClassPlan | None:
        """The plan of the latest step's class (`ctx.plan`)."""
        return self.plans.get(self.last)

    @plan.setter
    def plan(self, plan: Plan) -> None:
        """Run `plan` for the latest step's class from the next step, its trials from the
        start."""
        self.plans[self.last] = ClassPlan(plan)

    def install(self, key, plan: Plan) -> ClassPlan:
        """`plan` for class `key`, its trials from the start; it ran (was made) now."""
        entry = self.plans[key] = ClassPlan(plan)
        self.ran(key)
        return entry

    def kept_more_than_planned(self, key, kept: int, plan: Plan) -> str | None:
        """NOTE [Kept more than planned] A planned step keeps what its plan predicts or less
        (`Plan.prediction.kept_bytes`, which `ctx.plan` says holds the budget or not). One
        that kept more by KEPT_SLACK and KEPT_SLACK_BYTES saved what its profile did not see
        (gradient checkpointing with use_reentrant=True switched on after the profile: its
        re-run saves during backward, which no tier frees), and the plan's word would be
        wrong: the class profiles again, once (the reason, or None: it did already, or it
        is within the plan), and `ctx.plan` then counts what stays. A second time it keeps
        its plan, said once."""
        predicted = plan.prediction.kept_bytes
        if kept <= predicted * (1 + KEPT_SLACK) + KEPT_SLACK_BYTES:
            return None
        with self.lock:
            if key in self.kept_over:
                if self.kept_over[key]:
                    self.kept_over[key] = False
                    log.warning("offload: auto: planned steps of %s keep more than their "
                                "plan predicts even after profiling again; what ctx.plan "
                                "says of the budget does not hold for them", key[0][0]
                                if key else "the steps without blocks")
                return None
            self.kept_over[key] = True
            reason = (f"a planned step kept {format_bytes(kept)} where the plan predicted "
                      f"{format_bytes(predicted)} (the blocks save more than in the profile: "
                      "gradient checkpointing switched on?)")
            self.profile_again(key, reason)
            return reason

    def profile_again(self, key, reason: str) -> None:
        """Drop class `key`'s plan: its next step profiles again, and its plan's log line
        says `reason`; `ctx.plan` is None for it until then. The caller holds `lock`."""
        self.plans.pop(key, None)
        self.reasons[key] = reason
        self.last = key

    def learn_as_is(self, blocks) -> None:
        """NOTE [Blocks run alike on every rank] Each rank decides auto on its own: its shape
        classes, profiles, figures, trials and their winner. A block that calls a collective
        (a tensor-parallel all_reduce, a synced statistic) must run the same way on every
        rank, or one rank re-runs it in backward while another does not, and their
        collectives pair up wrongly: wrong weights with no error, or a mismatch error. So a
        block a profile (`blocks`: its BlockRecords) saw call one runs as it is in every
        step from then on, whatever the step's plan, trial or fallback (a profile and
        the warm-up run every block as it is too); so does one whose inputs change in place
        after the call (a re-run would not see them), or whose backward reads a saved
        tensor twice (profile.py NOTE [Reads a re-run refuses]). A block that first calls
        one after its profiled step (a branch on the step) is found by the forward of its
        checkpointed call, whose re-run calls none (collectives.py NOTE [A re-run calls no
        collective]), and joins these. Not seen: a collective inside a compiled block (no
        op is seen there): ranks running it differently then pair collectives wrongly
        (README says so). (A module hook on the block runs outside the checkpoint, never
        in a re-run.)"""
        self.add_as_is({b.index for b in blocks
                        if b.must_run_as_is})

    def add_as_is(self, indices: set[int]) -> None:
        """Blocks `indices` run as they are in every step from now on."""
        if indices - self.as_is:
            with self.lock:
                self.as_is |= indices

    def ran(self, key) -> None:
        """`key`'s plan ran (or was made) now; keep the MAX_PLANS most recent."""
        self.last = key
        if key in self.plans:
            self.plans.move_to_end(key)
        while len(self.plans) > MAX_PLANS:
            self.plans.popitem(last=False)


def cache_for(model: torch.nn.Module | None, config: Config, blocks: list) -> PlanCache:
    """The plan cache of `model` under these settings (a new one for each setting that
    changes a plan), kept in the per-model registry (util/per_model.py: it dies with the
    model; offload.process.reset() clears it); without a model a fresh one (the context
    object keeps it)."""
    key = (config.tiers, config.min_bytes, str(config.budget), config.nvme_max_bw,
           str(config.probe), tuple(id(b) for b in blocks), config.host_bytes,
           config.nvme_bytes, config.staging_bytes)
    if model is None:
        return PlanCache()
    return per_model.state_for(model, ("auto", key), PlanCache)
