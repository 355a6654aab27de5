"""Modules as they were at a block's call, put back for its re-run: buffers and attributes.

NOTE [Buffers in a re-run] `recompute` and `auto` re-run blocks in backward (checkpoint's
recompute). The re-run must compute what the forward computed, so it must read every
buffer as it was at the call, whoever changed it since: the forward itself (BatchNorm's
running statistics, a counter), the block's forward in a later call than its first (an
EMA codebook switched on after warm-up), code outside the block before the backward (a
parent updating each block's buffer after all ran, one buffer registered in every block
and written by the last), through `.data` (no version bump) or by a kernel that does not
bump versions (BatchNorm's statistics). A module's buffers go with the plain values it
keeps beside them: a rotary table regrown in forward is re-registered next to the int
that says how long it is (`max_seq_len_cached`); a re-run that got the table back but not
the int would slice the short table to the new length. And the re-run must leave the
model's state exactly as plain training does. A change is seen only after it happened,
when the value before it is gone, and some changes are not seen at all; so nothing is
guessed. Rules:

1. At every checkpointed call, each guarded module's state is noted: its buffer slots,
   name by name, `None` slots included (a buffer registered as None and set in forward:
   delayed scaling's `amax`); its attributes that are values (None, bools, numbers,
   numpy's scalars too, strings, dtypes, devices, enums, and tuples of them: a step count,
   a cached length, the `training` flag) and those that are one of its buffers or a view
   of one (`self.scale = self.ema`, `self.row = self.stats[0]`); which attribute names it
   has. Every buffer is copied, one copy per stretch of memory however many slots hold it
   or views of it (a buffer that is a view of another stays a view of the other's copy).
   The copies and the values are held until the call's re-run.
2. Each re-run runs on the call's state: each guarded module's slots are set to fresh
   copies of the call's copies (a name absent then is absent), so a second re-run (a
   retained graph's second backward) starts from the call's values too, however the first
   wrote into them; its value attributes that hold a value now to their values at the call
   (one added since is removed; a name that moved to the submodules is left: `if self.sub
   is None: self.sub = nn.Linear(...)` in the first forward must not make the re-run
   create another); an attribute that was a buffer or a view of one to its copy. An
   attribute that holds another object now (a hook's handle, a list, a tensor, a module)
   is left as it is, as under checkpoint: a one-time setup the first call made (`if
   self.handle is None: self.handle = self.lin.register_forward_hook(...)`) is not made
   again, and no tensor an attribute held at the call is kept alive until backward.
   Afterwards the module gets back the very attributes, slots and submodules it had before
   the re-run.
3. The copies are taken outside our dispatch modes (stored_ops.py counts ops by position:
   a copy must not shift the ids of the block's own ops).
4. The guarded modules are the block's own that hold buffer slots and those handed to its
   call as arguments (`block(x, self.norm)`): the re-run calls those again too. They are
   found again when a module joined anywhere or a module got its first buffer since
   (structure.py NOTE [Module structure]) or one of them was freed. A module the block
   reaches otherwise (a global, a reference to its parent) is not guarded; nor is a buffer
   that requires grad (a copy would cut its gradient).

5. Every module of the block and those handed to its call re-runs in the train / eval
   mode it had at the call, buffers or not, and is afterwards in the mode it had before
   the re-run (`keep_modes`). A block called in eval mode (a consistency term) re-ran in
   the train mode the model was put back in before backward: its Dropout drew, and
   checkpoint raised on the re-run's other ops (so does torch's checkpoint). And
   checkpoint stops a re-run early, once backward has what it needs, so a block that
   switches a submodule's mode and back (a Dropout put in eval() for some inputs, back at
   the block's end) left it switched for the steps after, and they ran without dropout:
   silently, as under checkpoint itself.
6. Where every slot still holds the very buffer it held at the call (BatchNorm's running
   statistics, updated in place), the re-run gets the call's values copied into those
   buffers, and afterwards their values now back, rather than copies in their slots: an op
   that saves a buffer itself saves it by reference (BatchNorm in eval mode saves its
   running statistics), and plain autograd's backward reads what the buffer holds then.
   Saved from a copy, the re-run's eval-mode BatchNorm differentiated with the statistics
   of the call while plain autograd used those a later train-mode forward wrote (a
   gradient off by 6.8 in a helper's eval-then-train step). The copies into the buffers go
   through `.data`, so their version counters do not move: a save of them stays valid.
7. A buffer changed in place since the call returned (its version moved) and saved by an
   op of the re-run raises autograd's in-place error, as in plain training
   (changed_buffers.py). Versions are noted when the call returns, and moved on by what
   each re-run bumps itself (put back through `.data`, those are no user's change).

8. A block with forward pre-hooks (its own, or global ones; not one compiled in place,
   whose checkpointed call runs them: module_hooks.py) re-runs with the tensors its
   own attributes held at the call (plain ones, in its `__dict__`: not buffers, not
   parameters), whatever holds them now, and afterwards holds what they hold then
   (`keep_own_tensors`): those hooks run at its call, outside the checkpoint, and are not
   run again by a re-run (module_hooks.py). The old-style `torch.nn.utils.spectral_norm` /
   `weight_norm`, or a DropConnect hook, set the weight the forward computes with (or its
   mask) as such an attribute (`module.weight = orig / sigma`) at every call: a block
   called twice before one backward (a GAN discriminator on real and fake batches, or a
   frozen one on two fake batches in the generator's step, where the weight needs no grad)
   re-ran its first call with its second call's weight, silently wrong gradients (torch's
   checkpoint does the same). Those tensors are held from the call to its re-run (plain
   autograd saves a weight an op computes with), and so is a tensor such a block keeps in
   an attribute from its last call (an attention map kept for viewing) until it is
   replaced; a block without pre-hooks holds nothing more than rule 2 says. A pre-hook that
   sets an attribute of a submodule of the block is not covered.

Not set back: the attributes of modules holding no buffer (`self.calls += 1` there is
counted again by the re-run, as under checkpoint), but for their mode (rule 5). What it
costs: nothing for blocks without buffers; per call, a look at each guarded module's
attributes and one copy of every buffer, held until the re-run, and a second copy in the
re-run (rule 6: of the buffer's values then, to put back afterwards, with two copies into
the buffer; BatchNorm: a few vectors; a block holding a large buffer that never changes
pays both at every step, and holds the first until backward: docs/benchmarks.md *Buffer
copies*).
"""
from __future__ import annotations

import collections
import enum
import numbers
import operator
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _disable_current_modes

from ..util import per_model
from . import structure
from .changed_buffers import BufferVersions, refusing_saves_of

__all__ = ["guard_buffers", "keep_modes"]

# The types of attributes that are values (rule 1); tuples of them too.
_VALUES = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype,
                     torch.device, torch.Size})
_CONTAINERS = frozenset({dict, collections.OrderedDict, set})   # nn.Module's own: no value
_ABSENT = object()


def _is_value(x: Any) -> bool:
    kind = type(x)
    if kind in _VALUES or isinstance(x, (enum.Enum, numbers.Number)):   # numpy's scalars
        return True
    return kind is tuple and all(map(_is_value, x))


def _holds_buffers(module: nn.Module) -> bool:
    return bool(module._buffers)


def _modules_of(block: nn.Module) -> structure.KeptModules:
    """The block's modules that hold buffer slots (a BatchNorm block is its own), kept per
    block (found afresh when the structure moved or one was freed: rule 4);
    `offload.process.reset()` forgets them."""
    return per_model.state_for(block, _holds_buffers,
                               lambda: structure.KeptModules(block, _holds_buffers))


def _copy_together(tensors: Iterable[torch.Tensor]) -> dict[int, torch.Tensor]:
    """A copy of each tensor (keyed by the original's id) in which tensors whose memory
    overlaps overlap again: each stretch of memory overlapping tensors cover is copied
    once, and every tensor on it becomes the same view of the copy (rule 1). Tensors that
    overlap nothing (the common buffer) are cloned one by one. Runs under no_grad."""
    copies: dict[int, torch.Tensor] = {}
    spans: list[tuple[int, int, torch.Tensor]] = []   # first byte, end byte, tensor
    for t in tensors:
        if id(t) in copies:
            continue
        if type(t) is torch.Tensor and t.layout is torch.strided and t.numel() \
                and not t.is_quantized and not t.is_meta:
            first = t.data_ptr()
            end = first + (t.nbytes if t.is_contiguous() else t.element_size() * (
                1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))))
            spans.append((first, end, t))
            copies[id(t)] = t   # set below
        else:   # a subclass, or no bytes (an observer's empty `min_val`, resized in forward)
            copies[id(t)] = t.clone()
    spans.sort(key=operator.itemgetter(0))
    i = 0
    while i < len(spans):
        first, end, t = spans[i]
        j = i + 1
        while j < len(spans) and spans[j][0] < end and spans[j][2].device == t.device:
            end = max(end, spans[j][1])
            j += 1
        if j == i + 1:
            copies[id(t)] = t.clone()
        else:
            _copy_stretch(spans[i:j], first, end, copies)
        i = j
    return copies


def _copy_stretch(group: list[tuple], start: int, end: int,
                  copies: dict[int, torch.Tensor]) -> None:
    """Copy the memory of overlapping tensors once and make each the same view of it; each
    alone when they overlap on storages of their own (`torch.from_numpy` of overlapping
    slices of one array: no storage holds the stretch)."""
    storage = group[0][2].untyped_storage()
    base = storage.data_ptr()
    if any(t.untyped_storage().data_ptr() != base for _, _, t in group):
        for _, _, t in group:
            copies[id(t)] = t.clone()
        return
    start -= (start - base) % 16   # every element size divides it: each view starts on one
    raw = torch.empty(0, dtype=torch.uint8, device=group[0][2].device)
    raw.set_(storage, start - base, (end - start,), (1,))
    stretch = raw.clone().untyped_storage()
    for first, _, t in group:
        view = torch.empty(0, dtype=t.dtype, device=t.device)
        view.set_(stretch, (first - start) // t.element_size(), t.shape, t.stride())
        copies[id(t)] = view


def _attributes(module: nn.Module) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """`module`'s attributes that are values (rule 1), and those that are plain tensors."""
    values, tensors = {}, []
    for name, value in module.__dict__.items():
        kind = type(value)
        if kind in _VALUES:
            values[name] = value
        elif kind is torch.Tensor:
            tensors.append((name, value))
        elif kind not in _CONTAINERS and _is_value(value):
            values[name] = value
    return values, tensors


def _views_of_buffers(tensors: list[tuple[str, torch.Tensor]],
                      buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensor attributes that share storage with one of `buffers` without being one
    (`self.row = self.stats[0]`): copied with them, they stay views of the buffers' copies
    (rule 1)."""
    if not tensors:   # the common module: no tensor attribute
        return []
    held = {id(buf) for buf in buffers}
    tensors = [t for _, t in tensors if id(t) not in held and t.layout is torch.strided]
    storages = {buf.untyped_storage().data_ptr() for buf in buffers
                if type(buf) is torch.Tensor and buf.layout is torch.strided}
    return [t for t in tensors if t.untyped_storage().data_ptr() in storages]


class _Guard:
    """One checkpointed call of a block: the forward notes and copies, re-runs swap."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules   # held for this call only: the registry holds them weakly
        found = [dict(module._buffers) for module in modules]
        buffers = [buf for slots in found for buf in slots.values()
                   if buf is not None and not buf.requires_grad]
        attributes = [_attributes(module) for module in modules]
        views = _views_of_buffers([t for _, tensors in attributes for t in tensors], buffers)
        with torch.no_grad(), _disable_current_modes():   # rule 3
            copies = _copy_together(buffers + views)
        # Rule 1: per module, what its slots held at the call (our copies in place of the
        # buffers; a buffer that requires grad is itself), its value attributes and those
        # that were buffers or views of one (their copies), and the names it had.
        self.at_call = [{name: copies.get(id(buf), buf) for name, buf in slots.items()}
                        for slots in found]
        self.objects = found   # the buffer objects themselves (rule 6)
        self.values = [values for values, _ in attributes]
        self.aliases = [{name: (t, copies[id(t)]) for name, t in tensors if id(t) in copies}
                        for _, tensors in attributes]
        self.names = [frozenset(module.__dict__) for module in modules]
        self.held = list(copies.values())
        self.calls = 0
        self.versions: BufferVersions | None = None   # rule 7, from the call's return

    def wrap(self, fn: Callable) -> Callable:
        def run(*args):
            self.calls += 1
            if self.calls == 1:
                out = fn(*args)
                self.versions = BufferVersions(self.modules, self.objects, self.at_call)
                return out
            return self._rerun(fn, args)
        return run

    def _rerun(self, fn: Callable, args: tuple) -> Any:
        live_slots = [dict(module._buffers) for module in self.modules]
        live_attributes = [dict(module.__dict__) for module in self.modules]
        live_children = [dict(module._modules) for module in self.modules]
        swaps, swapped = _in_place(self.objects, self.at_call, live_slots)   # rule 6
        with torch.no_grad(), _disable_current_modes():   # rules 2, 3 and 6
            fresh = _copy_together([c for c in self.held if _stretch(c) not in swapped])
            now = [(buf, buf.clone()) for buf, _ in swaps.values()]
            for buf, copy in swaps.values():
                buf.data.copy_(copy)   # `.data`: no version bump (a save of it is unchanged)
        # Rule 7, before the re-run changes any: what it reads in place of each buffer
        # changed since, the buffer itself (rule 6) or its fresh copy.
        versions = self.versions
        changed = versions.changed(lambda buf, copy: buf if id(buf) in swaps
                                   else fresh.get(id(copy), copy))
        start = versions.now()
        try:
            self._put_back(live_attributes, fresh, swaps, swapped)
            with refusing_saves_of(changed):
                return fn(*args)
        finally:
            with torch.no_grad(), _disable_current_modes():
                for buf, values in now:
                    buf.data.copy_(values)
            versions.move_on(start)   # rule 7: the re-run's own bumps are no user's change
            for module, live, slots, children in zip(self.modules, live_attributes,
                                                     live_slots, live_children):
                _refill(module.__dict__, live)
                _refill(module._buffers, slots)
                _refill(module._modules, children)

    def _put_back(self, live_attributes: list[dict], fresh: dict, swaps: dict,
                  swapped: set[int]) -> None:
        """Rule 2: each module's value attributes, its buffer slots and its attributes that
        were buffers or views of one, as at the call: fresh copies, but the buffers `swaps`
        holds (rule 6), which now hold the call's values themselves, and views of them (on
        the `swapped` stretches)."""
        for module, objects, at_call, values, aliases, names, live in zip(
                self.modules, self.objects, self.at_call, self.values, self.aliases,
                self.names, live_attributes):
            state = module.__dict__
            for name, value in values.items():
                now = live.get(name, _ABSENT)
                if now is not _ABSENT and _is_value(now):
                    state[name] = value
            for name, now in live.items():
                if name not in names and _is_value(now):
                    del state[name]
            for name, (was, copy) in aliases.items():
                now = live.get(name, _ABSENT)
                if now is _ABSENT or isinstance(now, torch.Tensor):
                    state[name] = was if _stretch(copy) in swapped else fresh.get(id(copy), copy)
            _refill(module._buffers, {
                name: objects[name] if id(objects[name]) in swaps else fresh.get(id(buf), buf)
                for name, buf in at_call.items()})


def _stretch(copy: torch.Tensor) -> int:
    """Which stretch of copied memory `copy` is on (`_copy_together` copies overlapping
    tensors into one); its own id when it is not a plain tensor with bytes."""
    if type(copy) is torch.Tensor and copy.layout is torch.strided and copy.numel():
        return copy.untyped_storage().data_ptr()
    return id(copy)


def _in_place(objects: list[dict], at_call: list[dict], live: list[dict]
              ) -> tuple[dict, set[int]]:
    """Rule 6: id -> (buffer, its copy at the call) of the call's buffers a re-run gets the
    call's values copied into: each still in every slot that held it at the call, a plain
    tensor of its copy's shape and dtype, and so are the others on its stretch of memory
    (views of one another stay views of one another); and those stretches (`_stretch`)."""
    ok: dict[int, tuple] = {}
    spoilt: set[int] = set()   # stretches with a buffer that gets a copy
    for found, copies, now in zip(objects, at_call, live):
        for name, buf in found.items():
            copy = copies[name]
            if buf is None or copy is buf:   # a None slot; a buffer that requires grad
                continue
            stretch = _stretch(copy)
            if now.get(name) is not buf or stretch == id(copy) or \
                    type(buf) is not torch.Tensor or copy.shape != buf.shape or \
                    copy.dtype != buf.dtype:
                spoilt.add(stretch)
            else:
                ok[id(buf)] = (buf, copy, stretch)
    swaps = {key: (buf, copy) for key, (buf, copy, stretch) in ok.items()
             if stretch not in spoilt}
    return swaps, {stretch for _, _, stretch in ok.values()} - spoilt


def _refill(into: dict, items: dict) -> None:
    """Make `into` (the very dict object: modules hold it) hold exactly `items`."""
    into.clear()
    into.update(items)


def guard_buffers(block: nn.Module | None, fn: Callable) -> Callable:
    """`fn` (the function checkpoint runs, forward then re-runs) with `block`'s modules
    holding buffers, buffers and attributes, put back as they were at the call for its
    re-runs (NOTE [Buffers in a re-run]); `fn` itself for a block without buffers."""
    if block is None:
        return fn
    modules = _modules_of(block).modules(block)
    if not modules:
        return fn
    return _Guard(modules).wrap(fn)


def keep_own_tensors(block: nn.Module, fn: Callable) -> Callable:
    """`fn` (the function checkpoint runs, forward then re-runs) with `block`'s own tensor
    attributes as they were at the call for a re-run, and as they are then afterwards (rule
    8: for a block whose forward pre-hooks ran outside the checkpoint)."""
    at_call: dict[str, torch.Tensor] | None = None

    def run(*args):
        nonlocal at_call
        if at_call is None:
            at_call = {name: value for name, value in vars(block).items()
                       if isinstance(value, torch.Tensor)}
            return fn(*args)
        state = vars(block)
        now = [(name, state.get(name, _ABSENT)) for name, value in at_call.items()
               if state.get(name) is not value]
        if not now:
            return fn(*args)
        try:
            for name, _ in now:   # (in __dict__ directly: it shadows a slot of that name)
                state[name] = at_call[name]
            return fn(*args)
        finally:   # also when checkpoint stops the re-run early (it raises to stop it)
            for name, value in now:
                if value is _ABSENT:
                    state.pop(name, None)
                else:
                    state[name] = value
    return run


def keep_modes(roots: list[nn.Module], fn: Callable) -> Callable:
    """`fn` (the function checkpoint runs, forward then re-runs) with every module of
    `roots` in the train / eval mode it had at the call for a re-run, and left by the
    re-run in the mode it had before it (rule 5)."""
    at_call: list[tuple[nn.Module, bool]] | None = None

    def run(*args):
        nonlocal at_call
        if at_call is None:
            at_call = [(module, module.training) for root in roots for module in root.modules()]
            return fn(*args)
        modes = [(module, module.training) for module, _ in at_call]
        try:
            for module, training in at_call:
                module.training = training
            return fn(*args)
        finally:   # also when checkpoint stops the re-run early (it raises to stop it)
            for module, training in modes:
                module.training = training
    return run
