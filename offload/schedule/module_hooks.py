"""The forward hooks a block's forward ran with, put back for its re-run.

NOTE [Forward hooks in a re-run] Forward hooks on the modules inside a block (and
`register_module_forward_hook`'s global ones) run again in its re-run, which sees them as
they are then, as under torch's checkpoint. A hook attached for the forward only and
removed before the backward (activation steering, an ablation, a probe that adds to an
output) left the re-run computing another function than the forward: silently wrong
gradients, training diverging within a few steps; one added between the forward and the
backward did the same the other way. So a call notes the forward (pre-)hooks of the
modules it guards, their kwargs / always-called flags and the global ones, and a re-run
that finds them changed runs with them as they were at the call, for itself only;
afterwards the modules get what they have. A forward that registers or removes hooks
itself (once, for good; one that swaps its own hook at each call; a hook that removes
itself) is left to do so again in its re-run, as under checkpoint: swapped dicts would
take its registrations and miss its removals (a handle removes from the dict it was made
for). The block's own hooks are not among them: they run around its call, outside the
checkpoint, and not in the re-run (but for a block compiled in place, whose checkpointed
call runs them). Not noted: backward hooks (a full backward hook registered or removed
between the two passes), and what a hook reads that is not the hook itself (a flag in its
closure: as it is then).

Every hook torch registers takes a number from `RemovableHandle.next_id`: while it has not
moved, no hook was added anywhere. So the block's modules that hold hooks are found once
and kept per block (as buffers.py's modules: structure.py NOTE [Module structure]), found
again when a hook was registered since; a call copies their dicts (usually none), and a
re-run, when no hook was registered since the call, compares those only (a removal). Not
seen: a hook put into a module's dict without torch's handle. The global hooks are
torch's module globals, swapped for the re-run's time: a module another thread calls
meanwhile sees the re-run's (on CUDA, re-runs run on autograd's device threads). Cost
when no module of the block holds a hook: ~4 us per call and its re-run together (a GPT
block of 13 modules, timeit on the dev VM).
"""
from __future__ import annotations

from typing import Any, Callable

import torch.nn as nn
import torch.nn.modules.module as torch_module
from torch.utils.hooks import RemovableHandle

from ..util import per_model
from . import structure

__all__ = ["guard_module_hooks", "pre_hooks_run_outside"]

# A module's dicts its `__call__` reads around `forward`.
_OWN = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
        "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
# The process-wide ones (torch.nn.modules.module globals), read by every module's call.
_GLOBAL = ("_global_forward_pre_hooks", "_global_forward_hooks",
           "_global_forward_hooks_with_kwargs", "_global_forward_hooks_always_called")


def _every(module: nn.Module) -> bool:
    return True


class _Inside:
    """The modules under a block, not the block itself (structure.KeptModules), and the
    indices of those that held a forward hook when `next_id` was read: found again when
    the modules were or a hook was registered since."""

    __slots__ = ("kept", "seen", "hooked", "next_id")

    def __init__(self, block: nn.Module) -> None:
        self.kept = structure.KeptModules(block, _every)
        self.seen = None   # the kept list `hooked` was found in

    def modules(self, block: nn.Module) -> list[nn.Module]:
        modules = self.kept.modules(block)[1:]   # (`modules()` yields the block first)
        if self.seen is not self.kept.refs or self.next_id != RemovableHandle.next_id:
            self.seen, self.next_id = self.kept.refs, RemovableHandle.next_id
            self.hooked = _hooked(modules)
        return modules


def _hooked(modules: list[nn.Module]) -> list[int]:
    """The indices of those of `modules` that hold a forward hook."""
    return [i for i, m in enumerate(modules)
            if (own := m.__dict__).get("_forward_hooks") or own.get("_forward_pre_hooks")]


def _copies(owner: dict, names: tuple) -> dict:
    """Copies of `owner`'s non-empty dicts among `names`."""
    return {name: hooks.copy() for name in names if (hooks := owner.get(name))}


def _same(owner: dict, then: dict, names: tuple) -> bool:
    """`owner`'s dicts among `names` hold what `then` (its `_copies`) held, by identity
    and in order."""
    for name in names:
        now, was = owner.get(name), then.get(name)
        if (now or was) and list((now or {}).items()) != list((was or {}).items()):
            return False
    return True


def pre_hooks_run_outside(block: nn.Module) -> bool:
    """Whether `block`'s call runs forward pre-hooks (its own or global ones) before its
    forward: outside the checkpoint, and not again in a re-run (the module doc)."""
    return bool(block.__dict__.get("_forward_pre_hooks")) \
        or bool(torch_module._global_forward_pre_hooks)


def guard_module_hooks(roots: list[nn.Module], fn: Callable,
                       block: nn.Module | None = None) -> Callable:
    """`fn` (the function checkpoint runs, forward then re-runs) with the forward hooks of
    the modules `roots` hold (not `block`'s own) and the global ones as they were at the
    call put back for its re-runs, unless the forward changed them itself (NOTE [Forward
    hooks in a re-run])."""
    calls = 0
    inside: list[nn.Module] = []
    then: dict[int, dict] = {}   # index in `inside` -> its hook dicts at the call (`_copies`)
    global_then: dict = {}
    next_id = 0
    own_changes = False   # the forward registered or removed hooks itself
    torch_globals = vars(torch_module)

    def run(*args) -> Any:
        nonlocal calls, global_then, next_id, own_changes
        calls += 1
        if calls == 1:
            next_id = RemovableHandle.next_id
            hooked: list[int] = []
            for root in roots:
                if root is block:
                    kept = per_model.state_for(block, _Inside, lambda: _Inside(block))
                    modules = kept.modules(block)
                    hooked += [len(inside) + i for i in kept.hooked]
                else:
                    modules = list(root.modules())
                    hooked += [len(inside) + i for i in _hooked(modules)]
                inside.extend(modules)
            then.update((i, _copies(inside[i].__dict__, _OWN)) for i in hooked)
            global_then = _copies(torch_globals, _GLOBAL)
            out = fn(*args)
            own_changes = RemovableHandle.next_id != next_id or not _same(
                torch_globals, global_then, _GLOBAL) or not all(
                _same(inside[i].__dict__, was, _OWN) for i, was in then.items())
            return out
        if own_changes:
            return fn(*args)
        if RemovableHandle.next_id == next_id:   # none added since: a removal, if any
            changed = {i for i, was in then.items() if not _same(inside[i].__dict__, was, _OWN)}
        else:
            changed = {i for i in _hooked(inside) if i not in then} | {
                i for i, was in then.items() if not _same(inside[i].__dict__, was, _OWN)}
        globals_changed = not _same(torch_globals, global_then, _GLOBAL)
        if not changed and not globals_changed:
            return fn(*args)
        kept_own = [(inside[i], {name: inside[i].__dict__[name] for name in _OWN
                                 if name in inside[i].__dict__}) for i in changed]
        kept_global = {name: torch_globals[name] for name in _GLOBAL}
        for i in changed:
            own = inside[i].__dict__
            for name in _OWN:
                if name in own:
                    own[name] = type(own[name])(then.get(i, {}).get(name, ()))
        if globals_changed:
            for name, hooks in kept_global.items():
                setattr(torch_module, name, type(hooks)(global_then.get(name, ())))
        try:
            return fn(*args)
        finally:
            for module, dicts in kept_own:
                module.__dict__.update(dicts)
            if globals_changed:
                for name, hooks in kept_global.items():
                    setattr(torch_module, name, hooks)

    return run
