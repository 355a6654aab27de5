"""Buffers as they were at a block's call, put back for its re-run.

NOTE [Buffers in a re-run] `recompute` and `auto` re-run blocks in backward (checkpoint's
recompute). The re-run must compute what the forward computed, so it must read every
buffer as it was at the call, whoever changed it since: the forward itself (BatchNorm's
running statistics, a counter), the block's forward in a later call than its first (an
EMA codebook switched on after warm-up), code outside the block before the backward (a
parent updating each block's buffer after all ran, one buffer registered in every block
and written by the last), through `.data` (no version bump) or by a kernel that does not
bump versions (BatchNorm's statistics). And the re-run must leave the model's state
exactly as plain training does. A change is seen only after it happened, when the value
before it is gone, and some changes are not seen at all; so nothing is guessed. Rules:

1. At every checkpointed call, each guarded module's buffer slots are noted, name by name,
   `None` slots included (a buffer registered as None and set in forward: delayed
   scaling's `amax`), and every buffer is copied (one copy per tensor object, however many
   slots hold it). The copies are held until the call's re-run.
2. The re-run runs on them: each guarded module's slots are set to what they held at the
   call (a copy, None, a name absent then is absent), and afterwards the module gets back
   the very slots it had before the re-run. Whatever the re-run writes lands in the copies.
3. A module seen changing its buffers in a forward (a bumped version counter, an object
   replaced, a slot added or removed; at the block's first call also a compare of values,
   for BatchNorm's kernel) gets fresh clones of the copies in each re-run, so a second
   re-run (a retained graph's second backward) starts from the values at the call too.
4. The copies are taken outside our dispatch modes (recompute.py counts ops by position:
   a copy must not shift the ids of the block's own ops).
5. The guarded modules are the block's own that hold buffer slots and those handed to its
   call as arguments (`block(x, self.norm)`): the re-run calls those again too. A module
   the block reaches otherwise (a global, a reference to its parent) is not guarded; nor
   is a buffer that requires grad (a copy would cut its gradient), nor a module that held
   no buffer slot when the block was first seen.

What it costs: nothing for blocks without buffers; per call, one copy of every buffer,
held until the re-run (BatchNorm: a few vectors; a block holding a large buffer that never
changes pays its copy at every call and holds it until backward).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes

from ..util import per_model

__all__ = ["guard_buffers"]


class _Modules:
    """A block's modules that hold buffer slots, and which of them its calls saw changing.

    The modules are held weakly: this lives in the per-model registry, whose entry dies
    with the block only if nothing in it refers back to the block (a BatchNorm block is
    its own buffer holder).
    """

    __slots__ = ("refs", "changing")

    def __init__(self, block: nn.Module) -> None:
        self.learn(block)

    def learn(self, block: nn.Module) -> None:
        """Find the modules afresh; what calls showed is forgotten (rule 3)."""
        self.refs = [weakref.ref(module) for module in block.modules() if module._buffers]
        self.changing: set[int] | None = None   # module positions; None until a first call

    def modules(self, block: nn.Module) -> list[nn.Module]:
        """The modules; found afresh when one of them was replaced (and freed)."""
        modules = [ref() for ref in self.refs]
        if any(module is None for module in modules):
            self.learn(block)
            modules = [ref() for ref in self.refs]
        return modules


def _modules_of(block: nn.Module) -> _Modules:
    """The block's modules, kept per block in util/per_model.py (which dies with the block;
    `offload.process.reset()` forgets them: each block's next call is a first call again)."""
    return per_model.state_for(block, _Modules, lambda: _Modules(block))


class _Guard:
    """One checkpointed call of a block: the forward notes and copies, re-runs swap."""

    def __init__(self, info: _Modules, modules: list[nn.Module]) -> None:
        self.info = info
        self.modules = modules   # held for this call only: the registry holds them weakly
        # The slots as found, held until the forward ended (rule 3 compares with them).
        self.found = [dict(module._buffers) for module in modules]
        self.versions = [{name: buf._version for name, buf in slots.items() if buf is not None}
                         for slots in self.found]
        copies: dict[int, torch.Tensor] = {}
        with torch.no_grad(), _disable_current_modes():   # rule 4
            for slots in self.found:
                for buf in slots.values():
                    if buf is not None and not buf.requires_grad and id(buf) not in copies:
                        copies[id(buf)] = buf.detach().clone()
        # Rule 1: per module, what its slots held at the call (our copies in place of the
        # buffers; a buffer that requires grad is itself).
        self.at_call = [{name: copies.get(id(buf), buf) for name, buf in slots.items()}
                        for slots in self.found]
        self.ours = {id(copy) for copy in copies.values()}
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
        """Rule 3: which modules changed their buffers in this forward."""
        changed = set()
        for i, (module, found, versions) in enumerate(zip(self.modules, self.found,
                                                          self.versions)):
            now = module._buffers
            if now.keys() != found.keys() or any(
                    now[name] is not buf or (buf is not None and buf._version != versions[name])
                    for name, buf in found.items()):
                changed.add(i)
        info = self.info
        if info.changing is None:   # the block's first call compares values too
            with torch.no_grad(), _disable_current_modes():
                for i, (found, at_call) in enumerate(zip(self.found, self.at_call)):
                    if i not in changed and any(
                            buf is not None and at_call[name] is not buf
                            and not torch.equal(at_call[name], buf)
                            for name, buf in found.items()):
                        changed.add(i)
        info.changing = changed if info.changing is None else info.changing | changed
        self.found = self.versions = None   # the copies stand for them from here on

    def _rerun(self, fn: Callable, args: tuple) -> Any:
        changing = self.info.changing or ()
        # Rule 3: a copy held by a module seen changing is cloned, once, for every slot
        # holding it (a tensor shared by two modules stays shared in the re-run).
        refresh = {id(buf) for i in changing if i < len(self.at_call)
                   for buf in self.at_call[i].values() if id(buf) in self.ours}
        live = [dict(module._buffers) for module in self.modules]
        with torch.no_grad(), _disable_current_modes():   # rules 2 and 4
            fresh: dict[int, torch.Tensor] = {}
            for slots in self.at_call:
                for buf in slots.values():
                    if id(buf) in refresh and id(buf) not in fresh:
                        fresh[id(buf)] = buf.clone()
            for module, at_call in zip(self.modules, self.at_call):
                slots = module._buffers
                slots.clear()
                slots.update((name, fresh.get(id(buf), buf)) for name, buf in at_call.items())
        try:
            return fn(*args)
        finally:
            for module, slots in zip(self.modules, live):
                module._buffers.clear()
                module._buffers.update(slots)


def guard_buffers(block: nn.Module | None, fn: Callable) -> Callable:
    """`fn` (the function checkpoint runs, forward then re-runs) with `block`'s buffers as
    they were at the call put back for its re-runs (NOTE [Buffers in a re-run]); `fn`
    itself for a block without buffers."""
    if block is None:
        return fn
    info = _modules_of(block)
    modules = info.modules(block)
    if not modules:
        return fn
    return _Guard(info, modules).wrap(fn)
