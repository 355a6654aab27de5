"""Which modules are the model's repeated blocks, and running them our way while a context
is active.

Found without configuration: every `nn.ModuleList` / `nn.Sequential` whose children (two or
more) are all of one class, e.g. Hugging Face GPT-2's `transformer.h` (GPT2Block), Llama's
and Mistral's `model.layers`, the built-in GPT's `blocks`. The stack holding the most
parameters wins; other stacks with at least a quarter of its parameters count too (an
encoder and a decoder). `blocks=` overrides detection with modules or a predicate.

NOTE [Whose block] Our wrapper runs a block its own way only when our saved-tensor hooks
are the innermost ones and grad mode is on. Otherwise someone else is in charge of this
region, and the block runs exactly as it would without us: the user's own
`torch.utils.checkpoint` around the block (non-reentrant: its hooks are innermost;
reentrant: its forward runs without grad), Hugging Face's gradient checkpointing, a
`save_on_cpu` region, `no_offload()`, or a checkpoint of ours being recomputed. A block
called while a backward pass runs is a reentrant checkpoint recomputing it: as is, too.
This is how a user's checkpointed block is never wrapped twice. Inside a `torch.func`
transform (`jvp`, `vmap`: their tensors are wrappers with no storage, which torch's
checkpoint cannot re-run) or forward-mode AD (`forward_ad.dual_level`: checkpoint refuses
dual tensors, and a dispatch mode changes the tangents of LayerNorm and GroupNorm by an
ulp), a block runs as is too: its saves go to our hooks like any other.

NOTE [Wrapping] The wrappers are instance attributes shadowing `forward` (no process-wide
hook: see tensor_meta's note on torch.compile), installed at context entry and removed at
exit; a forward the user had set on the instance is put back as it was. Rules:

1. One wrapper per module object, however often the module is listed: a layer shared by
   several positions (ALBERT-style `nn.ModuleList([layer] * 4)`) is wrapped once, and its
   k-th call in the step stands for its k-th position (cyclically), so the plan still sees
   every position. Wrapping it once per position stacked wrappers that exit could not all
   undo: they piled up step after step until Python's recursion limit.
2. Exit puts back exactly what entry found and leaves nothing else on the module (no
   attribute, no hook); a forward someone else set meanwhile is left alone. Contexts on one
   model may exit in any order (micro-batches in flight, threads, generators): an exit
   whose wrapper another's covers retires it (it passes through, its step let go), and the
   exit that uncovers it puts back what is under it. Else each out-of-order pair left a
   wrapper: they piled up until every call of the model, with or without offload, hit
   Python's recursion limit (~480 steps), each holding its whole step.
3. Under torch.compile's tracing a wrapper is transparent: the block is traced as the user
   wrote it, so the compiled graph is the one the model compiles to without offload, and
   none of our Python (checkpoint, dispatch modes, hook bookkeeping) is traced into it.
   What that graph saves for backward goes through the saved-tensor hooks like any tensor.
4. A copy or a pickle of a wrapped block is of the block as the wrapping found it: entry
   also shadows `__getstate__` (what `copy.deepcopy`, `copy.copy` and `torch.save` take a
   module's attributes from) with one that leaves our entries out. Else an EMA or teacher
   copy made inside the step (`copy.deepcopy(model)`) kept a wrapper that ran the
   original's forward, its own weights unused, for ever; and `torch.save(model)` inside the
   step could not pickle the wrapper.
5. A block compiled in place (`block.compile()`, as torchtune compiles each layer) is
   called through its compiled `_compiled_call_impl`, which runs `forward` inside dynamo's
   tracing, where Rule 3 makes the wrapper transparent: `recompute` and `auto` would
   recompute nothing in it. So that attribute is shadowed too, and the block runs our way
   around its compiled call, as a `torch.compile(block)` module does (run whole, never per
   op). Its own forward hooks run inside the compiled call, so a checkpointed re-run runs
   them again, as it runs those of every module inside a block.
"""
from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.nn.parameter import is_lazy
from torch.nn.utils.parametrize import type_before_parametrizations

from ..errors import ConfigError, short_repr
from ..runtime import hook_stack
from .stack_watch import StackWatch

_forward_ad = torch.autograd.forward_ad   # its `_current_level`: -1 outside any dual level
_functorch = torch._C._functorch

__all__ = ["find_blocks", "locate_blocks", "lone_layer_hint", "BlockWrappers", "ours_innermost",
           "block_type_key", "compiled_block", "compiled_in_place"]

log = logging.getLogger("offload")

BlocksArg = "Sequence[nn.Module] | Callable[[nn.Module], bool] | None"

_MIN_SHARE = 0.25  # a second stack counts when it has this share of the largest's params


def _nparams(module: nn.Module) -> int:
    # A lazy module's parameter (LazyLinear's before its first forward) has no size yet:
    # it counts as one element, so a stack of lazy layers is still a stack.
    return sum(1 if is_lazy(p) else p.numel() for p in module.parameters())


def _is_stack(module: nn.Module) -> bool:
    if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
        return False
    # A parametrized layer (weight_norm, spectral_norm, orthogonal) is an instance of a
    # class of its own, made for it: the class it was made from tells the stack.
    classes = {type_before_parametrizations(child) for child in module}
    return len(classes) == 1 and _nparams(module) > 0


def find_blocks(model: nn.Module | None, blocks: Any = None) -> list[nn.Module]:
    """The blocks to checkpoint / plan for, in model order (see module doc).

    Args:
        model: The model (`model=` of the context); may be None when `blocks` lists modules.
        blocks: None (detect), a sequence of modules, or a predicate `f(module) -> bool`
            applied to every submodule of `model` (a match inside another match is skipped).
            A ModuleList or ModuleDict among them stands for its members.

    Raises:
        ConfigError: `blocks` is of the wrong type, a predicate without `model`, or a
            module that `model` does not hold.
    """
    return locate_blocks(model, blocks)[0]


def locate_blocks(model: nn.Module | None, blocks: Any = None
                  ) -> tuple[list[nn.Module], "StackWatch"]:
    """`find_blocks`, and a watch over the containers they were found in (one walk of the
    model for both)."""
    if blocks is not None:
        return _expand_containers(_given_blocks(model, blocks)), \
            StackWatch(_given_containers(blocks))
    stacks = _detected_stacks(model)
    return [block for stack in stacks for block in stack], StackWatch(stacks, model)


def _detected_stacks(model: nn.Module | None) -> list[nn.Module]:
    """The stacks whose members are the detected blocks (module doc), in model order."""
    if model is None:
        return []
    stacks = [m for m in model.modules() if _is_stack(m)]
    if not stacks:
        return []
    largest = max(_nparams(m) for m in stacks)
    chosen: list[nn.Module] = []
    inside: set[int] = set()
    for stack in model.modules():  # model order; an outer stack shadows inner ones
        if id(stack) in inside or not _is_stack(stack) or _nparams(stack) < _MIN_SHARE * largest:
            continue
        chosen.append(stack)
        inside.update(id(m) for m in stack.modules())
    return chosen


def lone_layer_hint(model: nn.Module | None) -> str:
    """For a message saying no block was found: the largest stack of `model` that holds
    one layer only (a one-layer debug config of a transformer), which detection passes
    over (module doc: two or more), and the `blocks=` that would choose it; "" when there
    is none. A layer here has layers of its own: `nn.Sequential(nn.Linear(...))` heads are
    not what a user would checkpoint; nor is the model itself, held by itself. One inside
    another found is passed over (a deep chain of them is walked once, not once each)."""
    if model is None:
        return ""
    lone, inside = [], set()
    for name, m in model.named_modules():   # parents first
        if id(m) in inside or not name or not isinstance(m, (nn.ModuleList, nn.Sequential)) \
                or len(m) != 1 or isinstance(m[0], (nn.ModuleList, nn.Sequential)) \
                or next(m[0].children(), None) is None:
            continue
        inside.update(id(sub) for sub in m.modules())
        nparams = _nparams(m)
        if nparams > 0:
            lone.append((nparams, name, type_before_parametrizations(m[0])))
    if not lone:
        return ""
    _, name, cls = max(lone, key=lambda found: found[0])
    return (f"model.{name} holds one {cls.__name__} only (a stack counts from two layers): "
            f"pass blocks=lambda m: isinstance(m, {cls.__name__})")


def _given_containers(blocks: Any) -> list[nn.Module]:
    """The containers among `blocks=` (a predicate's matches and single modules: none)."""
    if isinstance(blocks, nn.Module):
        return [blocks] if _is_container(blocks) else []
    if callable(blocks):
        return []
    return [b for b in blocks if isinstance(b, nn.Module) and _is_container(b)]


def _is_container(module: nn.Module) -> bool:
    """No forward of its own: its members are the blocks (`_expand_containers`). A
    torch.compile'd module's class has none either, but its instance does (the compiled
    call): it is a block, run whole or checkpointed; its inner module runs inside dynamo's
    trace, where no block of ours is run our way (NOTE [Wrapping] rule 5)."""
    return type(module).forward is nn.Module.forward and "forward" not in module.__dict__


def _given_blocks(model: nn.Module | None, blocks: Any) -> list[nn.Module]:
    """`blocks=` as given: one module, a predicate's matches, or a list (find_blocks). A
    module torch.compile wrapped stands for its wrapper in `model` (the model calls that,
    and the module itself runs inside dynamo's trace: `_is_container`)."""
    found = _given_modules(model, blocks)
    compiled = _compiled_wrappers(model) if model is not None else {}
    return [compiled.get(id(m), m) for m in found] if compiled else found


def _given_modules(model: nn.Module | None, blocks: Any) -> list[nn.Module]:
    if isinstance(blocks, nn.Module):
        return [blocks]
    if callable(blocks):
        if model is None:
            raise ConfigError("offload.activations(blocks=<predicate>): a predicate needs "
                              "model= to search (or pass the block modules themselves)")
        found: list[nn.Module] = []
        inside: set[int] = set()
        for module in model.modules():
            if id(module) in inside:
                continue
            if blocks(module):
                found.append(module)
                inside.update(id(m) for m in module.modules())
        return found
    try:
        found = list(blocks)
    except TypeError:
        found = None
    if found is None or not all(isinstance(m, nn.Module) for m in found):
        raise ConfigError(f"offload.activations(blocks={short_repr(blocks)}): expected a list of "
                          "nn.Module blocks or a predicate f(module) -> bool")
    if model is not None:
        # A block the model does not hold never runs in its step: nothing would be
        # checkpointed or planned, which only a log line at INFO said.
        inside = {id(m) for m in model.modules()}
        stray = [i for i, m in enumerate(found) if id(m) not in inside]
        if stray:
            raise ConfigError(f"offload.activations(blocks=...): blocks[{stray[0]}] "
                              f"({type(found[stray[0]]).__name__}) is not a module of "
                              "model= (pass the model's own block modules)")
    return found


def _compile_wrapper_type() -> type | None:
    """torch.compile's module wrapper class; None while dynamo is not imported (nothing was
    compiled in this process, and importing it costs ~1 s)."""
    frames = sys.modules.get("torch._dynamo.eval_frame")
    return frames.OptimizedModule if frames is not None else None


def _compiled_wrappers(model: nn.Module) -> dict[int, nn.Module]:
    """id(compiled module) -> the torch.compile wrapper of it that `model` holds."""
    wrapper = _compile_wrapper_type()
    if wrapper is None:
        return {}
    return {id(m._orig_mod): m for m in model.modules() if isinstance(m, wrapper)}


def _expand_containers(found: list[nn.Module]) -> list[nn.Module]:
    """A container with no forward of its own (`nn.ModuleList`, `nn.ModuleDict`) is never
    called, so as a block it would checkpoint nothing, silently: its children are the
    blocks (`blocks=model.layers`)."""
    out: list[nn.Module] = []
    for module in found:
        members = _runnable(module)
        if not members:   # a ParameterList / ParameterDict: nothing of it ever runs
            raise ConfigError(f"offload.activations(blocks=...): a {type(module).__name__} "
                              "has no forward of its own and holds no module that runs, so "
                              "nothing of it would be a block (pass the modules that run)")
        out.extend(members)
    return out


def _runnable(module: nn.Module) -> list[nn.Module]:
    """`module` if it has a forward; else the members of it that do, at any depth (a
    ParameterList beside a container's layers never runs: it holds none)."""
    if not _is_container(module):
        return [module]
    return [m for child in module.children() for m in _runnable(child)]


def block_type_key(block: nn.Module) -> tuple:
    """Blocks with equal keys are structurally identical and share one plan."""
    return (type(block).__qualname__,
            tuple((name, None if is_lazy(p) else tuple(p.shape), p.dtype)
                  for name, p in block.named_parameters()))


def compiled_in_place(block: nn.Module) -> bool:
    """`block.compile()`: its call runs its compiled `_compiled_call_impl`, hooks and all
    (NOTE [Wrapping] rule 5)."""
    return block.__dict__.get("_compiled_call_impl") is not None


def compiled_block(block: nn.Module, forward: Callable | None = None) -> bool:
    """A block that is a torch.compile'd module of its own, one compiled in place
    (`block.compile()`: NOTE [Wrapping] rule 5), or one whose forward (`forward`: the one a
    wrapper was handed) is compiled: its ops run inside compiled code, which our dispatch
    modes cannot see into and our function modes must stay out of (generators.py NOTE
    [Modes under torch.compile])."""
    wrapper = _compile_wrapper_type()
    if wrapper is not None and isinstance(block, wrapper):
        return True
    if compiled_in_place(block):
        return True
    return any(getattr(f, "_torchdynamo_orig_callable", None) is not None
               for f in (block.forward, forward) if f is not None)


def ours_innermost(pack: Callable) -> bool:
    """NOTE [Whose block]: are our hooks (`pack`) the innermost saved-tensor hooks, with
    grad mode on? Then a block may be run our way."""
    if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1 or \
            _forward_ad._current_level >= 0 or _functorch.peek_interpreter_stack() is not None:
        return False
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is not None and top[0] == pack:
        return True
    top = hook_stack.top()   # hooks retired on top (a context exited on another thread) go
    return top is not None and top[0] == pack


class BlockWrappers:
    """Shadow each block's `forward` with `run(index, forward, args, kwargs)` while active
    (NOTE [Wrapping]).

    Example:
        >>> wrappers = BlockWrappers(blocks, run)
        >>> with wrappers:          # context entry to exit
        ...     loss = model(x)
    """

    def __init__(self, blocks: Iterable[nn.Module],
                 run: Callable[[int, Callable, tuple, dict], Any]) -> None:
        self.blocks = list(blocks)
        self._run = run
        # (block, what entry found under _SHADOWED, what it set there) per module object
        self._saved: list[tuple[nn.Module, dict, dict]] = []

    def __enter__(self) -> "BlockWrappers":
        positions: dict[int, tuple[nn.Module, list[int]]] = {}
        for index, block in enumerate(self.blocks):
            positions.setdefault(id(block), (block, []))[1].append(index)
        try:   # an interrupt half-way leaves no block wrapped
            for block, where in positions.values():  # Rule 1: once per module object
                found = {key: block.__dict__[key] for key in _SHADOWED if key in block.__dict__}
                # What the block had before any context wrapped it (another context may be
                # wrapping it too): what its copies get (Rule 4).
                unwrapped = getattr(found.get("__getstate__"), _UNWRAPPED, found)
                ours = {"forward": _wrapper(block.forward, where, self._run),
                        "__getstate__": _state_as_unwrapped(block, unwrapped)}
                compiled = found.get("_compiled_call_impl")
                if compiled is not None:   # Rule 5
                    ours["_compiled_call_impl"] = _wrapper(compiled, where, self._run)
                for key, value in ours.items():
                    setattr(value, _UNWRAPPED, unwrapped)
                    setattr(value, _BELOW, found.get(key, _NOTHING))
                self._saved.append((block, found, ours))   # before any is set (Rule 2)
                for key, value in ours.items():
                    block.__dict__[key] = value
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        # The last wrapping first (Rule 2), each dropped from the list once undone (undoing
        # one twice changes nothing): an exit interrupted half-way (context.py NOTE [An
        # interrupted exit]) resumes where it stopped.
        saved = self._saved
        while saved:
            block, found, ours = saved[-1]
            for key, value in ours.items():
                _retire(value)
                if block.__dict__.get(key) is not value:
                    continue  # covered by someone else's: it passes through under theirs
                below = getattr(value, _BELOW)
                while _retired(below):   # a wrapping that exited while ours covered it
                    below = getattr(below, _BELOW)
                if below is _NOTHING:
                    del block.__dict__[key]
                else:
                    block.__dict__[key] = below
            saved.pop()


# The instance attributes a wrapping sets (the last one only on a block that
# `nn.Module.compile()` compiled: Rule 5), and the attribute on each that holds what the
# block had there before any wrapping (Rule 4).
_SHADOWED = ("forward", "__getstate__", "_compiled_call_impl")
_UNWRAPPED = "_offload_unwrapped"
# On each of our entries: what it covers (Rule 2), and the cell holding its `run` (None
# once its wrapping exited: retired).
_BELOW = "_offload_below"
_RUN = "_offload_run"
_NOTHING = object()   # below an entry: no instance attribute (the class's)


def _retire(value: Callable) -> None:
    getattr(value, _RUN)[0] = None


def _retired(value: Any) -> bool:
    cell = getattr(value, _RUN, None)
    return cell is not None and cell[0] is None


def _state_as_unwrapped(block: nn.Module, unwrapped: dict) -> Callable[[], Any]:
    """The block's `__getstate__` while wrapped (Rule 4): its state, with each attribute a
    wrapping set (and still there) as it was before any."""
    def __getstate__():   # retired or not, the same (it holds no step)
        own = unwrapped.get("__getstate__")
        if own is not None:
            state = own()
        else:
            of_class = getattr(type(block), "__getstate__", None)   # Python 3.11: object's
            state = of_class(block) if of_class is not None else block.__dict__
        if not isinstance(state, dict):
            return state
        state = dict(state)
        for key in _SHADOWED:
            if getattr(state.get(key), _UNWRAPPED, None) is unwrapped:   # a wrapping's
                if key in unwrapped:
                    state[key] = unwrapped[key]
                else:
                    del state[key]
        return state
    setattr(__getstate__, _RUN, [True])
    return __getstate__


def _wrapper(forward: Callable, where: list[int], run: Callable) -> Callable:
    """The forward that replaces a block's while a context is active (NOTE [Wrapping])."""
    is_compiling = torch.compiler.is_compiling
    cell = [run]   # [None] once retired (Rule 2): then the block's own forward, and no step
    if len(where) == 1:
        index = where[0]

        def wrapper(*args, **kwargs):
            run = cell[0]
            if run is None or is_compiling():  # Rules 2, 3
                return forward(*args, **kwargs)
            return run(index, forward, args, kwargs)
        setattr(wrapper, _RUN, cell)
        return wrapper
    calls = [0]

    def shared(*args, **kwargs):
        run = cell[0]
        if run is None or is_compiling():  # Rules 2, 3
            return forward(*args, **kwargs)
        k = calls[0]  # Rule 1: the k-th call stands for the k-th position
        calls[0] = k + 1
        return run(where[k % len(where)], forward, args, kwargs)
    setattr(shared, _RUN, cell)
    return shared
