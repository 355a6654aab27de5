"""The user's own random generators a block draws from, kept exact across its re-runs.

NOTE [Generators in a re-run] `recompute` and `auto` re-run blocks in backward
(checkpoint's recompute). checkpoint sets the default CPU and CUDA generators back to their
state at the block's start first, so random ops draw the same numbers again; a
`torch.Generator` of the user's (`torch.randn(..., generator=self.g)` in a noise layer or
an augmentation) it does not know. The re-run would draw other numbers, so the backward
would differentiate another function than the forward ran (silently wrong gradients), and
the generator would end the step advanced twice. Rules:

1. Which generators: those that are attributes of the block's modules, and those the
   block's first call (per process) hands to an op, seen through a dispatch mode for that
   call only. Both are remembered per block, held (a generator refers to nothing, so the
   block's entry in the per-model registry still dies with it). An op is handed a new
   Python object for the same generator each time, so each is told apart from the others
   by what setting it changes.
2. The forward notes each one's state before the block draws from it: at the call's start,
   or, for one first seen during the first call, right before that op.
3. A re-run sets each back to that state, and afterwards to the state it had before the
   re-run: the re-run draws what the forward drew, and the generator ends the step where
   plain training leaves it. (A stored random op is replayed, not re-run: recompute.py
   Rule 2 sets its generator to its state after the op.)

Not seen: a generator held outside the block's modules and first drawn from in a later
call, or any under torch.compile (torch's own checkpoint has both limits for every
generator but the default ones).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..util import per_model

__all__ = ["guard_generators"]


def _same_generator(a: torch.Generator, b: torch.Generator) -> bool:
    """Whether `a` and `b` are one generator (two Python objects of it compare unequal):
    seeding `a` twice moves `b` too. Both states are put back; the test runs outside every
    dispatch mode (recompute.py counts the block's ops by position)."""
    if a is b:
        return True
    if a.device != b.device:
        return False
    with _disable_current_modes():
        state_a, state_b = a.get_state(), b.get_state()
        try:
            for seed in (1, 2):
                a.manual_seed(seed)
                if not torch.equal(b.get_state(), state_b):
                    return True
            return False
        finally:
            a.set_state(state_a)
            b.set_state(state_b)


class _Known:
    """The generators a block draws from (rule 1)."""

    __slots__ = ("generators", "called")

    def __init__(self) -> None:
        self.generators: list[torch.Generator] = []
        self.called = False   # the block's first call ran (rule 1)

    def add(self, generator: torch.Generator) -> bool:
        """Remember `generator` unless it is one already known; whether it was new."""
        if any(_same_generator(g, generator) for g in self.generators):
            return False
        self.generators.append(generator)
        return True


class _SeeGenerators(TorchDispatchMode):
    """The first call's forward: every generator an op is handed, its state noted before
    the op draws (rule 2)."""

    def __init__(self, known: _Known, states: dict) -> None:
        super().__init__()
        self.known = known
        self.states = states

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        generator = kwargs.get("generator")
        if isinstance(generator, torch.Generator) and self.known.add(generator):
            with _disable_current_modes():
                self.states[generator] = generator.get_state()
        return func(*args, **kwargs)


class _Guard:
    """One checkpointed call of a block: the forward notes, the re-runs set back."""

    def __init__(self, known: _Known) -> None:
        self.known = known
        self.first = not known.called
        known.called = True
        self.states = {g: g.get_state() for g in known.generators}
        self.calls = 0

    def wrap(self, fn: Callable) -> Callable:
        def run(*args):
            self.calls += 1
            if self.calls > 1:
                return self._rerun(fn, args)
            if self.first:
                with _SeeGenerators(self.known, self.states):
                    return fn(*args)
            return fn(*args)
        return run

    def _rerun(self, fn: Callable, args: tuple) -> Any:
        if not self.states:
            return fn(*args)
        with _disable_current_modes():
            now = {g: g.get_state() for g in self.states}
            for generator, state in self.states.items():
                generator.set_state(state)
        try:
            return fn(*args)
        finally:
            with _disable_current_modes():
                for generator, state in now.items():
                    generator.set_state(state)


def _known_of(block: nn.Module) -> _Known:
    """The block's generators, kept per block in util/per_model.py (`offload.process.reset()`
    forgets them: the next call is a first call again)."""
    def learn() -> _Known:
        known = _Known()
        for module in block.modules():
            for value in vars(module).values():
                if isinstance(value, torch.Generator):
                    known.add(value)
        return known
    return per_model.state_for(block, _Known, learn)


def guard_generators(block: nn.Module | None, fn: Callable) -> Callable:
    """`fn` (the function checkpoint runs, forward then re-runs) with the generators of
    `block` set back for its re-runs (NOTE [Generators in a re-run]); `fn` itself when
    there is nothing to guard."""
    if block is None or torch.compiler.is_compiling():
        return fn
    known = _known_of(block)
    if known.called and not known.generators:
        return fn   # its first call drew from none, and none is an attribute
    return _Guard(known).wrap(fn)
