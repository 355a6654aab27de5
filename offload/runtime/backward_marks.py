"""Where a step's backward starts and ends, as the saved-tensor hooks see it.

Every unpack but a small save's calls the step's `BackwardMarks`. The first marks the
backward's start: the prefetcher starts reading ahead, and the clock `auto` times steps with
marks it (`backward_mark`), and a step whose graph may be too deep to free on this stack is
warned of before it can be freed (deep_graphs.py NOTE [Deep graphs]). Once per backward
(autograd graph task), while the step wants to hear of it (`on_backward_end` set: step.py
NOTE [End of step], point 2), the end of that
backward is queued as an autograd callback. What a call does depends only on
`first_unpack_s`, `on_backward_end` and the graph task, so the core's Unpacker calls again
only when the task or `epoch` (bumped with every new `on_backward_end`) changed
(hooks.py NOTE [Handles in C]).
"""
from __future__ import annotations

import time

import torch

from ..util.never_compiled import never_compiled
from .deep_graphs import check as check_graph_depth, nodes_made, running_node_number

__all__ = ["BackwardMarks", "graph_task_id"]

# The id of the backward running on this thread, -1 outside one (torch >= 2.0).
graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


@never_compiled   # the core's unpacker calls it at every unpack: NOTE [Never compiled]
class BackwardMarks:
    """Args:
        prefetcher: Started at the backward's first unpack.
        clock: Marks that start on the clock `auto` times steps with (util/clock.py: the
            device's on CUDA); None: not needed.
    """

    def __init__(self, prefetcher, clock=None) -> None:
        self.prefetcher = prefetcher
        self.clock = clock
        self.first_node = nodes_made()            # autograd nodes made before the step
        self.first_unpack_s: float | None = None  # where the backward starts
        self.backward_mark = None                 # ... on `clock`
        self._on_backward_end = None
        self.epoch = 0
        self._queued_task = -1
        # Backwards heard of (their end queued) that have not ended: one that raised never
        # does (autograd runs the callbacks of a backward that completed only).
        self.open_backwards = 0

    @property
    def on_backward_end(self):
        """Called at the end of every backward that unpacked a stored tensor once set (the
        step sets it when its block exits with stored tensors alive)."""
        return self._on_backward_end

    @on_backward_end.setter
    def on_backward_end(self, callback) -> None:
        self._on_backward_end = callback
        self.epoch += 1

    def __call__(self) -> None:
        """An unpack (not a small save's)."""
        if self.first_unpack_s is None:
            self._starts()
        if self._on_backward_end is not None:
            task = graph_task_id()
            if task != self._queued_task and task >= 0:
                self._queued_task = task
                self.open_backwards += 1
                torch.autograd.Variable._execution_engine.queue_callback(self._ended)

    def _starts(self) -> None:
        self.first_unpack_s = time.perf_counter()
        # The node being run was made by the forward, on its thread: its number counts the
        # step's nodes wherever the backward runs (a CUDA backward runs on autograd's own
        # device threads, whose counters are their own).
        check_graph_depth(self.first_node, last_node=running_node_number())
        # Read-ahead starts with the backward, not at the first moved payload's fetch:
        # when the end of the forward stayed on the device (the round-trip plan, auto's
        # plan), the link would otherwise idle while backward works through it.
        self.prefetcher.start()
        if self.clock is not None:
            self.backward_mark = self.clock.mark(self.first_unpack_s)

    def _ended(self) -> None:
        self.open_backwards -= 1
        callback = self._on_backward_end
        if callback is not None:
            callback()
