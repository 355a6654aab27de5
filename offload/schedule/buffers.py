"""Buffers a block changes in its forward, kept exact when the block is run again.

NOTE [Buffers in a re-run] `recompute` and `auto` re-run blocks in backward (checkpoint's
recompute). A block that changes a buffer in its forward (BatchNorm's running statistics
and `num_batches_tracked` in train mode, a buffer counting calls) would change it
again in the re-run: BatchNorm statistics updated twice a step, silently, with the
gradients still right. The user never asked for checkpointing, so the runtime must leave
the model's state exactly as plain training does. Rules:

1. Before every checkpointed forward of a block, its buffers are noted (object and
   version counter) and copied: all of them, at every call. A module may change a buffer
   first in a later call than its first (an EMA codebook switched on after warm-up, an
   update every N steps), and a change is seen only after it happened, when the value
   before it is gone. After the forward, the copies of modules that changed nothing are
   dropped (those of modules seen changing in an earlier call are kept). A change shows
   as a bumped version counter or a buffer replaced by another object; the block's first
   call also compares values, as BatchNorm's kernel writes its running statistics without
   bumping their version counter (its `num_batches_tracked` bumps its own, so a BatchNorm
   first called in eval mode is still seen once it trains).
2. The re-run runs on copies: every buffer of a module that changed any (all of its
   buffers: BatchNorm counts batches by version but writes statistics without one) is
   swapped for a copy of its value from before the forward (rule 1), so the re-run computes
   what the forward computed; afterwards the module gets back the very buffers it had
   before the re-run. Whatever the re-run writes lands in copies that are dropped.
3. The copies are taken outside our dispatch modes (recompute.py counts ops by position:
   a copy must not shift the ids of the block's own ops).
4. The guarded modules are the block's own and those handed to its call as arguments
   (`block(x, self.norm)`): the re-run calls those again too. A module the block reaches
   otherwise (a global, a reference to its parent) is not guarded.

What it costs: nothing for blocks without buffers; per call, a look at each buffer's
version and a copy of every buffer, held while the forward runs and, for the modules that
changed, until the re-run (BatchNorm: a few vectors); one compare of every buffer at a
module's first call. A block holding a large buffer that never changes pays its copy at
every call.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes

from ..util import per_model

__all__ = ["guard_buffers"]


class _Slots:
    """A block's buffers as (owning module, name), and what its calls showed.

    The modules are held weakly: this lives in the per-model registry, whose entry dies
    with the block only if nothing in it refers back to the block (a BatchNorm block owns
    its buffers itself).
    """

    __slots__ = ("refs", "names", "owner_of", "changing")

    def __init__(self, block: nn.Module) -> None:
        self.learn(block)

    def learn(self, block: nn.Module) -> None:
        """Read the block's buffer slots afresh; what calls showed is forgotten (rule 1)."""
        modules: list[nn.Module] = []
        self.names: list[str] = []
        for module in block.modules():
            for name, buf in module._buffers.items():
                if buf is not None:
                    modules.append(module)
                    self.names.append(name)
        self.refs = [weakref.ref(module) for module in modules]
        # Slot -> all slots of its module (rule 2).
        by_module: dict[int, list[int]] = {}
        for i, module in enumerate(modules):
            by_module.setdefault(id(module), []).append(i)
        self.owner_of = [by_module[id(module)] for module in modules]
        self.changing: set[int] | None = None   # None until the first call (rule 1)

    def slots(self, block: nn.Module) -> list[tuple[nn.Module, str]]:
        """(module, name) per slot; read afresh when a module of the block was replaced."""
        modules = [ref() for ref in self.refs]
        if any(module is None for module in modules):
            self.learn(block)
            modules = [ref() for ref in self.refs]
        return list(zip(modules, self.names))


def _slots_of(block: nn.Module) -> _Slots:
    """The block's slots, kept per block in util/per_model.py (which dies with the block;
    `offload.process.reset()` forgets them: each block's next call is a first call again)."""
    return per_model.state_for(block, _Slots, lambda: _Slots(block))


class _Guard:
    """One checkpointed call of a block: the forward notes, the re-runs swap (module doc)."""

    def __init__(self, info: _Slots, slots: list[tuple[nn.Module, str]]) -> None:
        self.info = info
        self.slots = slots   # held for this call only: the registry holds them weakly
        self.before = [(b, None if b is None else b._version)
                       for b in (m._buffers.get(n) for m, n in slots)]
        with torch.no_grad(), _disable_current_modes():   # rule 1: every buffer
            self.copies = {i: buf.detach().clone() for i, (buf, _) in enumerate(self.before)
                           if buf is not None}
        self.swap: list[int] = []
        self.calls = 0

    def wrap(self, fn: Callable) -> Callable:
        def run(*args):
            self.calls += 1
            if self.calls == 1:
                out = fn(*args)
                self._forward_done()
                return out
            return self._rerun(fn, args)
        return run

    def _forward_done(self) -> None:
        info, slots = self.info, self.slots
        changed = set()
        for i, (module, name) in enumerate(slots):
            buf, version = self.before[i]
            now = module._buffers.get(name)
            if now is not buf or (buf is not None and buf._version != version):
                changed.add(i)
        if info.changing is None:  # rule 1: the first call compares values too
            with torch.no_grad(), _disable_current_modes():
                for i, copy in self.copies.items():
                    now = slots[i][0]._buffers.get(slots[i][1])
                    if i not in changed and now is not None and not torch.equal(copy, now):
                        changed.add(i)
        whole = {j for i in changed for j in info.owner_of[i]}   # rule 2
        info.changing = whole if info.changing is None else info.changing | whole
        for i in list(self.copies):
            # Kept for a module seen changing in any call: a later call of a shared one may
            # change it before this call's re-run. Else the re-run may use the buffer itself.
            if i not in info.changing:
                del self.copies[i]
        self.swap = sorted(whole | set(self.copies))

    def _rerun(self, fn: Callable, args: tuple) -> Any:
        if not self.swap:
            return fn(*args)
        slots = self.slots
        current = [(slots[i][0], slots[i][1], slots[i][0]._buffers.get(slots[i][1]))
                   for i in self.swap]
        with torch.no_grad(), _disable_current_modes():  # rule 3
            for i, (module, name, now) in zip(self.swap, current):
                start = self.copies.get(i)   # None: the slot held no buffer at the call
                module._buffers[name] = None if start is None else start.detach().clone()
        try:
            return fn(*args)
        finally:
            for module, name, now in current:
                module._buffers[name] = now


def guard_buffers(block: nn.Module | None, fn: Callable) -> Callable:
    """`fn` (the function checkpoint runs, forward then re-runs) with `block`'s buffers kept
    exact across its re-runs (NOTE [Buffers in a re-run]); `fn` itself for a block without
    buffers."""
    if block is None:
        return fn
    info = _slots_of(block)
    slots = info.slots(block)
    if not slots:
        return fn
    return _Guard(info, slots).wrap(fn)
