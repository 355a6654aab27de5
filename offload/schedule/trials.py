"""The trial steps of one shape class: the plan measured against whole-block strategies.

NOTE [Trials]. A plan is a prediction. When a whole-block strategy (`PURE`: `offload`,
`checkpoint`) is predicted within TRIAL_MARGIN of it (`Plan.trials`, search.py), the planned
steps start with TRIAL_ROUNDS (two) steps of the plan, then two of each such strategy (plan,
plan, offload, offload, checkpoint, checkpoint), and the steps after run whichever had the
fastest mean step (a pure strategy must beat the plan by TRIAL_WIN, so noise does not flip
it). Two consecutive steps and their mean, not the best of steps in turns: steps of two
kinds may alternate in one class (a GAN's discriminator and generator steps both starting
in the generator's blocks), and in turns every plan step fell on one kind and every
checkpoint step on the other; the best of each candidate's steps, one of each kind, was
always its light one, so the strategy fastest on the light kind won however slow on the
heavy one. Consecutive steps are one of each kind, whatever step a candidate starts at (a
dropped candidate shifts the others by one). The measured seconds and the
choice are in `ctx.plan` (`mode`, `measured`; one INFO line). Every candidate is bit-exact
and keeps no more than the budget (search.py leaves out one that would keep more), so a
trial step costs time, never memory or correctness; but it may raise where the plan does
not: `checkpoint` re-runs every block, and torch's checkpoint refuses some code plain
autograd runs (a backward reading `ctx.saved_tensors` twice; random ops in a backward under
vmap, `is_grads_batched=True`; the profile sees those two: profile.py NOTE [Reads a
re-run refuses]). A step running it that raised (in its block or in a backward after it)
drops it (`failed`, said once and in `ctx.plan`), whether it was on trial or had won: that
one step raised, not every later one. Only `checkpoint` is dropped, and only after a step
that ran a block checkpointed and raised what torch's checkpoint refuses code with (its
CheckpointError, or vmap's refusal of random ops) in the block, or a backward after the
block that never ended twice before one running it ended (whatever it raised: the step
cannot see it, and a user's check or a Ctrl-C seldom recurs). Any other error inside
the block (a bad batch's shape error, out of memory, Ctrl-C) drops nothing. A re-plan measures
again. Steps are timed on the device's clock (offload/util/clock.py): on CUDA the host's is
launch time.

The plan is immutable; what the trials have run and chosen is a `TrialSteps` the session
keeps next to it (plan_cache.py), one per shape class.
"""
from __future__ import annotations

import logging

import torch
import torch.utils.checkpoint

from .constants import TRIAL_ROUNDS, TRIAL_WIN

__all__ = ["PURE", "TrialSteps", "refused_by_checkpoint"]

log = logging.getLogger("offload")

# The whole-block strategies a plan is measured against, as the session runs them.
PURE = {"offload": "every eligible storage moved, blocks as they are",
        "checkpoint": "every block checkpointed whole but the last ones the budget keeps, "
                      "the rest moved"}


def refused_by_checkpoint(error: BaseException | None) -> bool:
    """Whether a failed step's `error` may be how torch's checkpoint refuses code plain
    autograd runs (NOTE [Trials]): its CheckpointError, vmap's refusal of random ops in a
    re-run, or not known (None: a backward after the block that never ended); a bad
    batch's shape error or an out-of-memory error is not."""
    return error is None or isinstance(error, torch.utils.checkpoint.CheckpointError) or (
        isinstance(error, RuntimeError) and "vmap" in str(error))


class TrialSteps:
    """What the next steps of one shape class run: `pending` the trial steps still to run
    (NOTE [Trials]), then `mode` ("plan" or a PURE name), chosen from `measured` (step
    seconds per candidate)."""

    def __init__(self, candidates: tuple[str, ...] = ()) -> None:
        self.pending: list[str] = [m for m in ("plan", *candidates)
                                   for _ in range(TRIAL_ROUNDS)] if candidates else []
        self.measured: dict[str, list[float]] = {}
        self.failed: list[str] = []   # candidates whose trial step raised
        self.suspected: set[str] = set()   # whose backward after the block did not end once
        self.mode = "plan"

    @property
    def settled(self) -> bool:
        """No trial step left: every further step runs `mode`."""
        return not self.pending

    @property
    def running(self) -> str:
        """What the next step runs: the next trial, or `mode`."""
        return self.pending[0] if self.pending else self.mode

    def done(self, mode: str, step_s: float) -> bool:
        """Record a step of `mode` if it was the pending trial; after the last one choose
        `mode`. True when this step settled the choice."""
        if not self.pending or self.pending[0] != mode:
            return False
        self.pending.pop(0)
        self.measured.setdefault(mode, []).append(step_s)
        if self.pending:
            return False
        self._choose()
        return True

    def completed(self, mode: str) -> None:
        """A training step running `mode` ended: a suspicion of it is forgotten."""
        self.suspected.discard(mode)

    def drop(self, mode: str, known: bool = True) -> None:
        """A step running `mode` raised (`known` False: its backward after the block did not
        end, for a reason not seen): run it no more, on trial or chosen (NOTE [Trials];
        said once); an unknown failure only the second time before one completes."""
        if mode == "plan" or mode in self.failed or \
                (mode not in self.pending and self.mode != mode):
            return
        if not known and mode not in self.suspected:
            self.suspected.add(mode)
            log.warning("offload: auto: the backward of a step running %s (%s) did not end "
                        "(an error raised in it: a hook's check, Ctrl-C, or torch's checkpoint "
                        "refusing code); if one does so again before one running it ends, auto "
                        "does not run it again for this shape class", mode, PURE[mode])
            return
        self.suspected.discard(mode)
        self.failed.append(mode)
        self.measured.pop(mode, None)
        if self.mode == mode:   # it had won: the plan runs instead
            self.mode = "plan"
        self.pending = [m for m in self.pending if m != mode]
        if not any(m != "plan" for m in self.pending):
            self.pending = []   # only the plan's own rounds were left: nothing to compare
            self._choose()
        log.warning("offload: auto: a step running %s (%s) raised an error, as torch's "
                    "checkpoint does for some code plain autograd runs; auto does not run it "
                    "again for this shape class", mode, PURE[mode])

    def means(self) -> dict[str, float]:
        """Each measured candidate's mean step (what the choice compares)."""
        return {m: sum(t) / len(t) for m, t in self.measured.items()}

    def _choose(self) -> None:
        best = self.means()
        if "plan" not in best:
            return
        fastest = min(best, key=best.get)
        if fastest != "plan" and best[fastest] < (1 - TRIAL_WIN) * best["plan"]:
            self.mode = fastest
