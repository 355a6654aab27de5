"""What an `offload.activations()` context asks of its policy's scheduler, and what the two
block policies (`recompute`, `auto`) share.

The context calls `placement(round_trip)` (the step's decision point), then `enter(view)`
with what the step offers (runtime/step.py `StepView`), `exit()`, and `step_done(report)`
at the end of each step (`StepReport`); `plan` is `ctx.plan`, `clock` what the step marks
its backward's start on. `keep` and `offload` need nothing of it: `Session` itself.
"""
from __future__ import annotations

import logging
import weakref

import torch

from ..config import Config
from ..runtime.placement import Placement

__all__ = ["Session", "holds_cache", "say_unrun_once", "UNRUN", "reset"]

log = logging.getLogger("offload")


class Session:
    """`keep` / `offload`: nothing to do."""

    plan = None
    clock = None
    watch = None   # recompute / auto: a stack_watch.StackWatch of where their blocks were found

    def placement(self, round_trip) -> Placement:
        return Placement(self.config, round_trip)

    def __init__(self, config: Config) -> None:
        self.config = config

    def enter(self, view) -> None:
        pass

    def exit(self) -> None:
        pass

    def step_done(self, report) -> None:
        pass


# Models (their first block) whose key/value cache was said once.
_said_cache: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def holds_cache(args: tuple, kwargs: dict, blocks: list) -> bool:
    """Whether a block call got a key/value cache object (Hugging Face `Cache`): the forward
    appends to it, so a recompute would replay against a changed cache. Such a call runs as
    is (warned once per model, not per context: one is built per step): recompute needs a
    block that is a function of its inputs, as torch.utils.checkpoint does."""
    for value in (*args, *kwargs.values()):
        if value is not None and type(value).__name__.endswith("Cache") \
                and hasattr(value, "update"):
            if _first_time(_said_cache, blocks):
                log.warning("offload: a block got a %s (use_cache=True): it runs as is, not "
                            "recomputed; pass use_cache=False when training",
                            type(value).__name__)
            return True
    return False


# Blocks whose "no block ran through offload" was said once (first block of the list).
_said_unrun: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()

UNRUN = ("no block ran through offload in a training step (a torch.compile'd model runs its "
         "blocks inside the compiled graph, as it compiles without offload; blocks the model "
         "checkpoints itself are its own)")


def say_unrun_once(blocks: list, policy: str, consequence: str) -> None:
    """Log UNRUN once per list of blocks (keyed by its first block)."""
    if _first_time(_said_unrun, blocks):
        log.info("offload: %s: %s; %s", policy, UNRUN, consequence)


def _first_time(said: "weakref.WeakSet[torch.nn.Module]", blocks: list) -> bool:
    """Whether the model of `blocks` (keyed by its first block) is not in `said` yet; it
    is from now on."""
    if not blocks or blocks[0] in said:
        return False
    said.add(blocks[0])
    return True


def reset() -> None:
    """Forget which blocks were told about (tests; a process-wide reset): said again."""
    _said_unrun.clear()
    _said_cache.clear()
