"""The user's own random generators a block draws from, kept exact across its re-runs.

NOTE [Generators in a re-run] `recompute` and `auto` re-run blocks in backward
(checkpoint's recompute). checkpoint sets the default CPU and CUDA generators back to their
state at the block's start first, so random ops draw the same numbers again; a
`torch.Generator` of the user's (`torch.randn(..., generator=self.g)` in a noise layer or
an augmentation) it does not know. The re-run would draw other numbers, so the backward
would differentiate another function than the forward ran (silently wrong gradients), and
the generator would end the step advanced twice. Rules:

1. Which generators: every one the block's forward hands to a torch function, wherever
   the block holds it (an attribute, an argument, a module global, one made for this step),
   seen through a torch function mode around every forward call. Not once per block: a
   generator first drawn from in a later call (a new one each step, noise switched on
   after warm-up) is as wrong in its re-run as one drawn from at the first. The default
   generators are checkpoint's (it sets them back, implicit draws included).
2. The forward notes each one's state right before the call's first draw from it.
3. A re-run sets each back to that state, and afterwards to the state it had before the
   re-run: the re-run draws what the forward drew, and the generator ends the step where
   plain training leaves it. They are set back in the reverse order of their first draws,
   so two Python objects of one generator (the earlier noted state is the right one) end
   on the earlier state. (A stored random op is replayed, not re-run: recompute.py Rule 2
   sets its generator to its state after the op.)

Cost: the mode on every forward call of a re-run block, some 5 µs per torch function
call on a CPU (docs/benchmarks.md *Generators seen at every call*); one `get_state` per
generator drawn from. Not seen: generators under torch.compile (torch's own checkpoint
does not see them either).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["guard_generators"]


def _is_default(generator: torch.Generator) -> bool:
    """Whether checkpoint sets `generator` back itself (the CPU and CUDA defaults)."""
    if generator is torch.default_generator:
        return True
    return generator.device.type == "cuda" and torch.cuda.is_initialized() and \
        any(generator is g for g in torch.cuda.default_generators)


class _SeeGenerators(TorchFunctionMode):
    """The forward of one call: each generator handed to a torch function, its state noted
    before the call's first draw from it (rules 1 and 2)."""

    def __init__(self, states: dict) -> None:
        super().__init__()
        self.states = states

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        generator = kwargs.get("generator")
        if generator is not None:
            self._note(generator)
        for arg in args:   # torch's own functions take it by keyword; a user's may not
            if isinstance(arg, torch.Generator):
                self._note(arg)
        return func(*args, **kwargs)

    def _note(self, generator) -> None:
        if isinstance(generator, torch.Generator) and generator not in self.states and \
                not _is_default(generator):
            with _disable_current_modes():   # get_state makes a tensor: no op of the block
                self.states[generator] = generator.get_state()


class _Guard:
    """One checkpointed call of a block: the forward notes, the re-runs set back."""

    def __init__(self) -> None:
        self.states: dict = {}   # generator -> its state before the forward's first draw
        self.calls = 0

    def wrap(self, fn: Callable) -> Callable:
        def run(*args):
            self.calls += 1
            if self.calls > 1:
                return self._rerun(fn, args)
            with _SeeGenerators(self.states):
                return fn(*args)
        return run

    def _rerun(self, fn: Callable, args: tuple) -> Any:
        if not self.states:
            return fn(*args)
        with _disable_current_modes():
            now = {g: g.get_state() for g in self.states}
            for generator, state in reversed(self.states.items()):   # rule 3's order
                generator.set_state(state)
        try:
            return fn(*args)
        finally:
            with _disable_current_modes():
                for generator, state in now.items():
                    generator.set_state(state)


def guard_generators(fn: Callable) -> Callable:
    """`fn` (the function checkpoint runs, forward then re-runs) with the generators its
    forward draws from set back for its re-runs (NOTE [Generators in a re-run]); `fn`
    itself under torch.compile."""
    if torch.compiler.is_compiling():
        return fn
    return _Guard().wrap(fn)
