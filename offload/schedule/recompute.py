"""Per-op recompute in eager mode: checkpoint a block, but keep chosen op outputs.

`run_block(forward, args, kwargs, store, hooks, placement)` runs `forward` under
`torch.utils.checkpoint(use_reentrant=False, context_fn=...)` with the two dispatch modes
of stored_ops.py: the forward hands the outputs of the ops `store(op_id, out)` names to our
saved-tensor hooks, and the re-run takes them back instead of running those ops
(stored_ops.py's Rules 1-6 say which outputs may be stored and when one is handed back).
`checkpoint_block` is the checkpoint itself, also `recompute`'s: every tensor argument
handed to checkpoint where its hooks see it, and the block's buffers, weights, modes and
random generators as they were at the call for the re-run (buffers.py, weights.py,
generators.py).
"""
from __future__ import annotations

import itertools
import logging
import weakref
from typing import Any, Callable

import torch
from torch.nn.modules.lazy import LazyModuleMixin
from torch.utils.checkpoint import checkpoint

from ..runtime.placement import Decision
from ..util import per_model
from ..util.ranges import RECOMPUTE, profiling, span
from . import structure
from .blocks import compiled_block, compiled_in_place
from .arguments import flatten_call
from .buffers import guard_buffers, keep_modes, keep_own_tensors
from .generators import guard_generators
from .module_hooks import guard_module_hooks, pre_hooks_run_outside
from .parametrize_cache import guard_parametrize_cache
from .stored_ops import modes
from .weights import guard_weights

__all__ = ["run_block", "checkpoint_block", "block_inputs", "runs_as_is", "forget_messages",
           "stacked"]

log = logging.getLogger("offload")

def block_inputs(args: tuple, kwargs: dict, leaves: list | None = None) -> list[torch.Tensor]:
    """The tensors a block call receives, in the order checkpoint_block passes them (and
    the profile numbers them): positional ones, then those inside keyword arguments.
    `leaves`: the call's `flatten_call` leaves, when the caller took them apart already."""
    if leaves is None:
        leaves = flatten_call(args, kwargs)[0]
    return [x for x in leaves if _handed(x)]


def _handed(x: Any) -> bool:
    """Whether checkpoint_block hands `x` to checkpoint as an input: a tensor, but not a
    parameter (`scale=self.scale`), which stays where it is anyway and is held as the
    object it is, so the re-run gets a parameter again (torch.compile guards on the type:
    a plain tensor in its place ran another compiled variant in the re-run, whose saves
    did not match the forward's)."""
    return isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter)


def checkpoint_block(forward: Callable, args: tuple, kwargs: dict, context_fn=None,
                     block: torch.nn.Module | None = None, flat: tuple | None = None,
                     checked: bool = False) -> Any:
    """Non-reentrant checkpoint of `forward(*args, **kwargs)` with every tensor argument,
    also those inside keyword arguments (Hugging Face passes rotary tables and masks that
    way), handed to checkpoint positionally: checkpoint saves positional inputs through the
    saved-tensor hooks (so ours place them), while it would hold keyword ones in a closure,
    out of our reach. `block` is the module `forward` belongs to: its buffers, and those of
    modules handed to the call, stay exact across the re-run (offload/schedule/buffers.py),
    the re-run computes with the weights the forward ran with (weights.py), and draws what
    the forward drew from the random generators it drew from (generators.py). `flat`:
    `flatten_call(args, kwargs)` taken at this call by the caller (auto takes the call apart
    once for both); its leaves become this call's own. `checked`: the caller found it is
    not a call that runs as is (`runs_as_is`) already."""
    # NOTE [Arguments as at the call]
    leaves, rebuild = flatten_call(args, kwargs) if flat is None else flat
    handed_in = _modules_handed_in(leaves, block)
    if any(map(_still_lazy, handed_in if block is None else [block, *handed_in])):
        return forward(*args, **kwargs)
    if not checked and runs_as_is(block, leaves):
        return forward(*args, **kwargs)
    where = [i for i, x in enumerate(leaves) if _handed(x)]
    if len(where) == len(args) and all(map(_handed, args)) and not kwargs:
        tensors, call = args, forward
    else:
        tensors = [leaves[i] for i in where]
        first: list | None = [args, kwargs]

        def call(*ts):
            # The forward (checkpoint's first call) gets the caller's own objects: a list or
            # dict it was passed and writes into (MoE auxiliary losses, stats) must be the
            # caller's. A re-run gets the inputs in a rebuilt copy of the call's arguments as
            # they were at the call: what the caller or later blocks changed there since is
            # not seen, and what it writes is thrown away (checkpoint's own re-run would
            # write into the caller's list a second time). Told apart by count, not by the
            # tensors: a re-run is handed the very input objects that need no gradient.
            # After the forward this closure holds no input tensor: checkpoint saves them
            # through our hooks (which move them) and hands them to the re-run as `ts`;
            # holding them here would keep every block's inputs in memory until backward.
            nonlocal first
            if first is not None:
                (a, kw), first = first, None
                for i in where:
                    leaves[i] = None
                return forward(*a, **kw)
            full = list(leaves)
            for i, t in zip(where, ts):
                full[i] = t
            a, kw = rebuild(full)
            return forward(*a, **kw)
    extra = {} if context_fn is None else {"context_fn": context_fn}
    # Compiled code runs without our generator modes in both passes: dynamo guards on the
    # modes on the stack, and a re-run with other modes than its forward ran another
    # compiled variant, whose saves did not match (generators.py NOTE [Modes under
    # torch.compile]).
    compiled = block is not None and compiled_block(block, forward)
    guarded = guard_parametrize_cache(call)   # parametrize_cache.py
    guarded = guard_buffers(block, guarded if compiled else guard_generators(guarded))
    for module in handed_in:   # buffers.py rule 4
        guarded = guard_buffers(module, guarded)
    roots = handed_in if block is None else [block, *handed_in]
    handed = tuple(x for x in leaves if isinstance(x, torch.nn.Parameter))   # `_handed`
    if roots or handed:   # weights.py NOTE [Weights in a re-run]
        guarded = guard_weights(roots, guarded, handed, block)
    if roots:
        # (a block compiled in place runs its own hooks inside the checkpoint too)
        own_inside = block is not None and compiled_in_place(block)
        guarded = guard_module_hooks(roots, guarded, None if own_inside else block)
        guarded = keep_modes(roots, guarded)      # buffers.py NOTE [Buffers in a re-run] 5
        if block is not None and not own_inside and pre_hooks_run_outside(block):
            guarded = keep_own_tensors(block, guarded)   # buffers.py NOTE [...] 8
    return checkpoint(_ranged(guarded), *tensors, use_reentrant=False,
                      **extra)


def runs_as_is(block: torch.nn.Module | None, leaves: list) -> bool:
    """Whether a block call (`leaves`: its `flatten_call` leaves) runs as is rather than
    checkpointed or profiled (NOTE [Calls that run as is])."""
    needs_grad = False
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            continue
        if t.is_nested and t.layout == torch.strided:
            _say_once(block, "got a nested tensor of the strided layout, which torch's "
                      "checkpoint cannot re-run from (torch.nested.nested_tensor(..., "
                      "layout=torch.jagged) can be)")
            return True
        needs_grad = needs_grad or t.requires_grad
    if needs_grad or block is None:
        return False
    roots = (block, *_modules_handed_in(leaves, block))
    return not any(t.requires_grad for root in roots
                   for t in itertools.chain(root.parameters(), root.buffers()))


# NOTE [Calls that run as is] A block call whose inputs (parameters handed to it too),
# weights and buffers need no gradient (a frozen encoder feeding a trained head) builds no
# graph, unless it reaches a tensor that needs one otherwise (a closure, a plain
# attribute: then its saves are kept, not recomputed; gradients are right either way). A
# checkpoint would save nothing and re-run nothing, but run the forward under our modes,
# which torch's own fast paths treat as a reason to leave them: a frozen
# nn.TransformerEncoder in eval() computed another output than in plain training (off by
# 7e-7 in its head's gradient) and, given a padding mask, raised (its nested-tensor path
# runs only without modes). So it runs as is. So does a call given a nested tensor of the
# strided layout: torch's checkpoint reads its `.shape`, which it has not. The cost where
# inputs need grad (every block after the first trained one): a look at each input's
# flags (~0.6 us); otherwise a walk over the block's weights and buffers (5-20 us).

# Block types whose "runs as is" was said once.
_said: set[str] = set()


def _say_once(block: torch.nn.Module | None, why: str) -> None:
    name = "block" if block is None else type(block).__name__
    if name not in _said:
        _said.add(name)
        log.info("offload: a %s %s: such calls run as is, not checkpointed", name, why)


def forget_messages() -> None:
    """Say the messages again (offload.process.reset)."""
    _said.clear()


class _LazyModules:
    """A block's lazy modules (`nn.LazyLinear`, `nn.LazyBatchNorm1d`) that have not run yet,
    held weakly. Their parameters and buffers get their shape and values in their first
    forward: that forward runs as is, not checkpointed, since its re-run could not start
    from the call's state (an uninitialised buffer has no value to copy). A module that
    has run becomes its plain class (`nn.Linear`) and leaves the list: then the check is
    free. Found again when a module joined since (structure.py NOTE [Module structure])."""

    __slots__ = ("refs", "count", "calls")

    def __init__(self, block: torch.nn.Module) -> None:
        self.calls = 0   # calls run as is
        self.learn(block)

    def learn(self, block: torch.nn.Module) -> None:
        self.count = structure.count()
        self.refs = [weakref.ref(m) for m in block.modules() if isinstance(m, LazyModuleMixin)]

    def pending(self, block: torch.nn.Module) -> bool:
        if self.count != structure.count():
            self.learn(block)
        if self.refs:
            self.refs = [ref for ref in self.refs if isinstance(module := ref(), LazyModuleMixin)
                         and module.has_uninitialized_params()]
        if not self.refs:
            return False
        self.calls += 1
        if self.calls == 2:   # one call ran and left it lazy: a branch not taken (yet)
            names = sorted({type(module).__name__ for ref in self.refs
                            if (module := ref()) is not None})
            log.info("offload: a %s holds lazy modules its calls have not run yet (%s): its "
                     "calls run as is, not checkpointed, until they have",
                     type(block).__name__, ", ".join(names))
        return True


def _still_lazy(block: torch.nn.Module) -> bool:
    """Whether `block` holds a lazy module that has not run yet (`_LazyModules`)."""
    return per_model.state_for(block, _LazyModules, lambda: _LazyModules(block)).pending(block)


def _modules_handed_in(leaves: list, block: torch.nn.Module | None) -> list[torch.nn.Module]:
    """The modules among a call's arguments that are not the block's own (`block(x,
    self.norm)`): the re-run calls them again, so their buffers are guarded too. Not one
    holding the block (its parent handed in: guarding it would copy the whole model's
    buffers at every call; buffers.py rule 4 leaves a parent's out)."""
    handed = {id(x): x for x in leaves if isinstance(x, torch.nn.Module)}
    if handed and block is not None:
        for own in block.modules():
            handed.pop(id(own), None)
        for key, module in list(handed.items()):
            if any(sub is block for sub in module.modules()):
                del handed[key]
    return list(handed.values())


class stacked:
    """Both context managers, `below` entered first (of two modes, `above` is asked first
    about each op). Entered again for each re-run (a retained graph's second backward), so
    not a generator's one-shot context manager."""

    __slots__ = ("below", "above")

    def __init__(self, below, above) -> None:
        self.below, self.above = below, above

    def __enter__(self) -> None:
        self.below.__enter__()
        try:
            self.above.__enter__()
        except BaseException:
            self.below.__exit__(None, None, None)
            raise

    def __exit__(self, *exc) -> bool:
        try:
            self.above.__exit__(*exc)
        finally:
            self.below.__exit__(*exc)
        return False


def _ranged(fn: Callable) -> Callable:
    """`fn`, its re-run in backward shown as an `offload::recompute` profiler range."""
    def run(*args):
        if profiling() and torch._C._current_graph_task_id() >= 0:  # checkpoint's re-run
            with span(RECOMPUTE):
                return fn(*args)
        return fn(*args)
    return run


def run_block(forward: Callable, args: tuple, kwargs: dict,
              store: Callable[[tuple, Any], Decision | None], hooks, placement,
              block: torch.nn.Module | None = None, positions: dict | None = None,
              flat: tuple | None = None,
              on_changed: Callable[[tuple], None] | None = None, checked: bool = False,
              watch: Callable | None = None) -> Any:
    """`forward(*args, **kwargs)` under non-reentrant checkpoint with per-op storing.

    Args:
        store: (op_id, the op's output) -> Decision for outputs to keep / move, None to
            recompute.
        hooks: the context's OffloadHooks (pack / unpack).
        placement: has `forced(decision)`, a context manager making the next pack use it.
        block: the module `forward` belongs to (its buffers, see checkpoint_block).
        positions: op_id -> position in the profiled op sequence (stored_ops.py Rule 5);
            None: no check.
        flat: the call taken apart already (checkpoint_block).
        on_changed: told the op id of a stored output the forward changed in place after
            storing it, which the re-run ran again instead (stored_ops.py Rule 1).
        checked: as checkpoint_block's.
        watch: a context_fn whose context managers run below the per-op modes (auto's
            `ReRuns.context_fn`).
    """
    block_name = "block" if block is None else type(block).__name__

    def context_fn():
        forward, rerun = modes(store, hooks, placement, positions, block_name, on_changed)
        if watch is None:
            return forward, rerun
        below = watch()
        return stacked(below[0], forward), stacked(below[1], rerun)

    return checkpoint_block(forward, args, kwargs, context_fn, block, flat, checked)
