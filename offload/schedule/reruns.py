"""What `auto` learns from the re-runs of the blocks it checkpoints.

Each checkpointed call gets a `context_fn` (`ReRuns.context_fn`): its re-run side notes
that the block's re-run began, until its backward ends (`pending`, NOTE [A re-run
refused]); in a job of
many ranks, its two sides are also collectives.py's modes (NOTE [A re-run calls no
collective]). A block found either way runs as it is in every later step
(`PlanCache.add_as_is`).

NOTE [A re-run refused] A block whose re-run saves other tensors than its forward (a memo
the forward fills at the first call of a step and the re-run finds filled; a module-global
cache) makes torch's checkpoint raise its CheckpointError in backward. The profile runs
every block as it is and cannot see it, so a plan that recomputes such a block raised at
every step. A re-run that began in a backward that never ended (its end callback did not
run: autograd runs those of a backward that completed only: `pending`) counts as refused
(`refused`): its block and those of its type (the same code) run as they are from then
on, and its class profiles again; that one step raised, not every later one. Learned when
the step reports a failure of the kind checkpoint refuses code with (its CheckpointError),
or, for a backward after the block when the step ended already at the block's exit
(nothing of it left to unpack), at the next step's entry; not when the step's report knew
its error and it was another kind (out of memory). What the backward raised is not known at
the next entry (a hook's check, a Ctrl-C in a notebook, or torch's refusal), and a wrong
guess costs every later step its re-runs (their saves stay: seen, a step hundreds of times
slower on a slow disk); a refusal recurs at every re-run of the block, a user's error seldom
does. So an unknown failure only makes the block type suspected (`suspected`, said once at
WARNING); a second while suspected refuses it; a backward in which a block of that type
re-ran and that ended clears it. The cost: a refusal with the backward after the block
raises at two steps, not one.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch

from . import collectives
from .plan_cache import PlanCache
from .recompute import stacked
from .trials import refused_by_checkpoint

__all__ = ["ReRuns"]

log = logging.getLogger("offload")


class _ReRunBegins:
    """The re-run side of a checkpointed call's context_fn: notes as `pending`, until its
    backward ends, that block `index`'s re-run began."""

    __slots__ = ("reruns", "index")

    def __init__(self, reruns: "ReRuns", index: int) -> None:
        self.reruns, self.index = reruns, index

    def __enter__(self) -> None:
        self.reruns.began(self.index)

    def __exit__(self, *exc) -> bool:
        return False


class ReRuns:
    """The re-runs of one context's blocks (`blocks`, their type keys `types`, whether each
    is compiled: `opaque`), learned into `state`."""

    def __init__(self, state: PlanCache, blocks: list, types: list, opaque: list) -> None:
        self.state, self.blocks, self.types, self.opaque = state, blocks, types, opaque
        self.many_ranks = False   # a job of many ranks (AutoSession.enter: each step)
        self.pending: int | None = None   # a block whose re-run began in a backward not ended
        self._task = -1   # the graph task whose end clears `pending`
        self.suspected: set = set()   # block types of one unknown failure (NOTE [A re-run ...])
        self._began: set = set()      # block types whose re-run began in `_task`
        # A refusal's reason to profile again, learned from the report of a step that is not
        # the session's latest (its graph died late): said at the next entry.
        self.unsaid: str | None = None

    def began(self, index: int) -> None:
        task = torch._C._current_graph_task_id()
        if task < 0:   # a saved tensor read outside a backward (torchviz): no end to wait for
            return
        self.pending = index
        if task != self._task:
            self._task, self._began = task, set()
            torch.autograd.Variable._execution_engine.queue_callback(self._ended)
        self._began.add(self.types[index])

    def _ended(self) -> None:
        self.suspected -= self._began   # their re-runs were not refused
        self.pending, self._task, self._began = None, -1, set()

    def context_fn(self, index: int, on_collective: Callable[[str], None]) -> Callable:
        """For a checkpointed call of block `index`; `on_collective(reason)`: its forward
        called a collective its profile did not see (the block runs as it is from then
        on)."""
        mark = _ReRunBegins(self, index)
        if self.opaque[index] or not self.many_ranks:   # (compiled: no op is seen)
            return lambda: (contextlib.nullcontext(), mark)
        name = type(self.blocks[index]).__name__

        def on_call(op: str) -> None:
            if index not in self.state.as_is:
                self.state.add_as_is({index})
                log.warning("offload: auto: block %d (a %s) called a collective (%s) that its"
                            " profile did not see; its re-run hands back the forward's result "
                            "instead of calling it again, and it runs as it is from now on",
                            index, name, op)
                on_collective(f"block {index} called a collective its profile did not see")

        def context_fn():
            forward, rerun = collectives.modes(on_call, name)
            return forward, stacked(rerun, mark)
        return context_fn

    def failed(self, error: BaseException | None) -> str | None:
        """A step raised `error` (None: not known): `refused` for the re-run that began in a
        backward that did not end, if one did and the error is what torch's checkpoint
        refuses code with."""
        if error is not None and not refused_by_checkpoint(error):
            self.pending = None   # an error of another kind (out of memory): none refused
            return None
        if self.pending is None:
            return None
        return self.refused(self.pending, error) if error is not None else self._unknown()

    def refused_pending(self) -> str | None:
        """At a step's entry: for a re-run that began in a backward that never ended, if
        one did, `refused` when its type is suspected already, else it becomes so; or a
        refusal not said yet (`unsaid`)."""
        reason = self._unknown() if self.pending is not None else None
        reason, self.unsaid = reason or self.unsaid, None
        return reason

    def _unknown(self) -> str | None:
        """The backward in which block `pending`'s re-run began did not end, for a reason
        not known (NOTE [A re-run refused]): its type refused at the second time."""
        index, self.pending = self.pending, None
        key = self.types[index]
        if key in self.suspected or index in self.state.as_is:
            self.suspected.discard(key)
            return self.refused(index, None)
        self.suspected.add(key)
        log.warning("offload: auto: a backward did not end after the re-run of block %d (a %s) "
                    "began (an error raised in it: a hook's check, Ctrl-C, or torch's "
                    "checkpoint refusing the re-run); if one does so again before a backward "
                    "that re-runs a block of its type ends, blocks of its type run as they are "
                    "from then on", index, type(self.blocks[index]).__name__)
        return None

    def refused(self, index: int, error: BaseException | None) -> str | None:
        """A step raised `error` (None: not known) after block `index`'s re-run began: run
        it and the blocks of its type as they are from now on (NOTE [A re-run refused]).
        Returns the reason its class profiles again, or None when they ran so already."""
        self.pending = None
        if index in self.state.as_is:
            return None
        self.state.add_as_is({i for i, key in enumerate(self.types)
                              if key == self.types[index]})
        raised = type(error).__name__ if error is not None else \
            "in a backward that did not end, a second time,"
        log.warning("offload: auto: the step raised %s after the re-run of block %d (a %s) "
                    "began: torch's checkpoint refuses a re-run that saves other tensors "
                    "than its forward (a cache the forward fills and its re-run finds "
                    "filled). Blocks of its type run as they are from now on", raised, index,
                    type(self.blocks[index]).__name__)
        return f"block {index}'s re-run was refused"
