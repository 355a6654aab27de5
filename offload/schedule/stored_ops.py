"""Per-op recompute's two dispatch modes: which op outputs a block's forward stores, and
how its re-run hands them back.

`recompute.run_block` runs a block under `torch.utils.checkpoint(use_reentrant=False,
context_fn=...)` with these two modes (`modes`): in the forward (`StoreOutputs`), the output
of every op that `store(op_id, out)` names is handed to our saved-tensor hooks with that decision
(keep, host or nvme: through the tiers and the prefetcher like any saved tensor); in the
recompute (`ReplayOutputs`), those ops return the stored bytes and every other op runs
again. `op_id` is `(op name, n)`: the n-th call of that op in the block, the same in forward
and recompute.

Rules (the code points back to them):

Rule 1 (what may be stored). Only ops that make new storage: not in-place / out= ops
(their output is an input, changed) and not views (their output aliases an input; a view
re-runs for free). Ops with non-tensor or non-plain-tensor outputs re-run too. A stored
output that the forward later changes in place would come back changed: the plan never
stores those (the profile sees it: offload/schedule/profile.py). One changed anyway (a
forward that starts to change it only in a step after the profile: a flag, a data-dependent
branch) is not handed back: the re-run finds its version moved (`changed_since_pack`, NOTE
[Version check] in offload/runtime/version_check.py), drops it and runs the op again, then
the in-place op after it, as plain checkpoint does; the caller is told (`on_changed`: auto
profiles the class again with that op never stored).

Rule 2 (random ops replay exactly). checkpoint restores the RNG state at the block's start
before recomputing. A stored random op (dropout as one op, attention with dropout) does
not run in the recompute, so the RNG would not advance past it and every later random op
would draw different numbers. The forward records the generator state right after each
stored random op and the recompute sets it back at that point: the default generators',
and the one the op was handed (`generator=`; poisson's, binomial's and _standard_gamma's
come positionally at this level, their schemas not keyword-only), which the re-run set back
to its state at the block's start (NOTE [Generators in a re-run], offload/schedule/generators.py).

Rule 3 (ops the two passes see differently). checkpoint itself runs `detach` a different
number of times in forward and recompute, and `prim.device` for its checks: these are not
counted, so the op ids of both passes agree.

Rule 4 (held outputs). What we hold is a detached alias of the op output (it shares the
storage and the version counter, Rule 1): holding the output itself would tie its autograd
node to our stash and make a reference cycle. Below autograd (in a dispatch mode) the
ADInplaceOrView key is off, and an alias made there would get a version counter of its own:
the pack runs with that key switched back on. A factory function's Python wrapper
(`torch.randn_like`, `zeros`, `arange`, `full`) detaches the op's output below autograd
before its caller gets it, so the caller's tensor counts its versions apart from the output
we would hold: an output detached so right after its op is not stored (it re-runs). Each
stored entry is dropped as soon as the recompute took it, so its tier space returns during
the backward of its block; a second backward (retain_graph) finds none and recomputes every
op, which is plain checkpointing and replays exactly too.

Rule 5 (the op the plan saw). An op's output is stored only when the op comes at the
position in the block's op sequence where the profile saw it (`positions`): a block whose
ops differ from the profiled ones (another input layout, a block standing in for one the
profile did not run) could otherwise store an output that a later op changes in place
through an alias autograd does not track (the CPU GRU cell's `unsafe_split`), which no
version check catches. Not storing is always safe: the op re-runs.

Rule 6 (the re-run's ops). A stored output is handed back only while the re-run has run
the forward's ops, in order, up to it, each on the same kind of arguments: the same op, on
the same parameters (the objects), other tensors of the same size, dtype and stride, and
equal other arguments (`op_entry`; a pass's own intermediates are other objects in each
pass, so they are told apart by their layout only: two same-shaped projections of
non-parameter weights would not be). An op's id `(op name, n)` alone shifts when the
re-run runs more or fewer ops of a kind than the forward did, and would then hand one op
another's output: a rotary
table kept in plain attributes of a module without buffers is rebuilt by the forward when
the length changed and found built by the re-run (one `mm` fewer: the next stored `mm`
went to the wrong projection); under autocast a backward run inside the autocast region
finds a weight's cast in autocast's cache (one `_to_copy` fewer). From the first op that
differs the re-run runs every op, as plain checkpoint does, and the stored entries are
dropped (said once per block type).
"""
from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from ..runtime.placement import Decision
from ..runtime.saved_handles import changed_since_pack
from ..runtime.tensor_meta import storage_of
from .generators import handed_generator

__all__ = ["modes", "storable_op", "op_entry", "op_name", "IGNORED_OPS", "forget_messages",
           "detaches_a_factory_output"]

log = logging.getLogger("offload")

_DETACH = torch.ops.aten.detach.default
IGNORED_OPS = {_DETACH, torch.ops.prim.device.default}  # Rule 3

_SEEDED = torch.Tag.nondeterministic_seeded


def detaches_a_factory_output(func, args: tuple, made: torch.Tensor) -> bool:
    """Rule 4: whether `func(*args)` is the detach a factory's own Python wrapper (randn_like,
    zeros, arange) applies to `made`, the output of the op just before, handing its caller a
    copy whose version counter is not `made`'s."""
    return func is _DETACH and bool(args) and args[0] is made


def op_name(func) -> str:
    return str(func)


def storable_op(func) -> str | None:
    """Why an op's output may not be stored (Rule 1), or None when it may."""
    schema = func._schema
    if schema.is_mutable:
        return "in-place"
    if any(r.alias_info is not None for r in schema.returns):
        return "view"
    if not schema.returns:
        return "no output"
    return None


def _argument(x: Any) -> Any:
    """An op argument as Rule 6 compares it: a parameter by identity, another tensor by size,
    dtype and stride (a pass's own intermediates are other objects in each pass), a list or
    tuple item by item, anything else by value (`_Other`)."""
    if isinstance(x, torch.Tensor):
        if isinstance(x, torch.nn.Parameter):
            return ("parameter", id(x))
        return ("tensor", tuple(x.shape), x.dtype, tuple(x.stride()))
    if isinstance(x, (list, tuple)):
        return tuple(map(_argument, x))
    return x if isinstance(x, _BY_VALUE) else _Other(x)


# Arguments compared by value; any other object (a ProcessGroup, whose `==` raises; an
# object whose `==` is not a bool) by `_Other`.
_BY_VALUE = (int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device,
             torch.layout, torch.memory_format, torch.Generator)


class _Other:
    """An op argument of another type: equal to the same object, or to one of its type
    that compares equal (a failing or non-bool `==` is not equal)."""

    __slots__ = ("x",)

    def __init__(self, x: Any) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        if type(other) is not _Other:
            return NotImplemented
        a, b = self.x, other.x
        if a is b:
            return True
        if type(a) is not type(b):
            return False
        try:
            same = a == b
        except Exception:
            return False
        return same if type(same) is bool else False

    __hash__ = None   # compared only


def op_entry(func, args: tuple, kwargs: dict) -> tuple:
    """One op of a pass as Rule 6 compares it with the forward's: what it is and what it
    ran on."""
    return (func, tuple(map(_argument, args)),
            tuple((k, _argument(v)) for k, v in kwargs.items()))


class _Held:
    """A stored tensor output: what our hooks' pack returned for it."""

    __slots__ = ("packed",)

    def __init__(self, packed) -> None:
        self.packed = packed


class _Entry:
    __slots__ = ("packed", "cpu_rng", "device_rng", "device", "generator", "generator_rng")

    def __init__(self, packed, cpu_rng=None, device_rng=None, device=None):
        self.packed = packed
        self.cpu_rng = cpu_rng
        self.device_rng = device_rng
        self.device = device
        self.generator = None       # the op's own `generator=` (Rule 2) ...
        self.generator_rng = None   # ... and its state after the op


class StoreOutputs(TorchDispatchMode):
    """Forward: run every op; hand the chosen outputs to our hooks."""

    def __init__(self, stash: dict, ops: list, store: Callable[[tuple, Any], Decision | None],
                 hooks, placement, positions: dict | None = None) -> None:
        super().__init__()
        self.stash = stash
        self.ops = ops   # the forward's ops in order, for the re-run (Rule 6)
        self.store = store
        self.hooks = hooks
        self.placement = placement
        self.positions = positions
        # Rule 6 compares ops up to the last one the plan may store (all without a plan).
        self.last = max(positions.values(), default=-1) if positions is not None else None
        self.position = 0
        self.counter: dict[Any, int] = defaultdict(int)
        self._just_stored: tuple | None = None   # (stash key, output) of the op just stored

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        just_stored, self._just_stored = self._just_stored, None
        if func in IGNORED_OPS:
            if just_stored is not None and detaches_a_factory_output(func, args, just_stored[1]):
                del self.stash[just_stored[0]]   # Rule 4: a change would never be seen
            return out
        n = self.counter[func]
        self.counter[func] = n + 1
        position = self.position
        self.position = position + 1
        if self.last is None or position <= self.last:
            self.ops.append(op_entry(func, args, kwargs))
        op_id = (op_name(func), n)
        decision = self.store(op_id, out)
        if decision is None or storable_op(func) is not None:
            return out
        if self.positions is not None and self.positions.get(op_id) != position:
            return out  # Rule 5
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not all(type(o) is torch.Tensor for o in outs if isinstance(o, torch.Tensor)):
            return out  # Rule 1: subclasses re-run
        entry = _Entry(None)
        if _SEEDED in func.tags:  # Rule 2
            entry.cpu_rng = torch.get_rng_state()
            dev = next((o.device for o in outs if isinstance(o, torch.Tensor)
                        and o.device.type == "cuda"), None)
            if dev is not None:
                entry.device, entry.device_rng = dev, torch.cuda.get_rng_state(dev)
            generator = handed_generator(args, kwargs)
            if generator is not None:
                entry.generator, entry.generator_rng = generator, generator.get_state()

        def pack(x):
            if not isinstance(x, torch.Tensor):
                return x
            # Rule 4: the hooks make aliases of `x` too (the kept alias, the version
            # sentinel); under the guard they share its version counter as they do above
            # autograd, so a later in-place change is caught.
            with self.placement.forced(decision), torch._C._SetExcludeDispatchKeyGuard(
                    torch._C.DispatchKey.ADInplaceOrView, False):
                return _Held(self.hooks.pack(x.detach()))

        entry.packed = tree_map(pack, out)
        self.stash[(func, n)] = entry
        if isinstance(out, torch.Tensor):
            self._just_stored = ((func, n), out)
        return out


class ReplayOutputs(TorchDispatchMode):
    """Recompute: stored ops return their stored bytes, every other op runs."""

    def __init__(self, stash: dict, ops: list, hooks, block_name: str,
                 on_changed: Callable[[tuple], None] | None = None) -> None:
        super().__init__()
        self.stash = stash
        self.ops = ops
        self.hooks = hooks
        self.block_name = block_name
        self.on_changed = on_changed   # Rule 1: told the op id of a stored output changed
        self.counter: dict[Any, int] = defaultdict(int)
        self.position = 0
        self.diverged = False

    def __enter__(self):
        self.counter.clear()  # a second backward (retain_graph) replays from the start
        self.position = 0
        self.diverged = False
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in IGNORED_OPS or self.diverged or not self.stash:   # nothing left to hand
            return func(*args, **kwargs)
        position = self.position
        self.position = position + 1
        if position >= len(self.ops) or self.ops[position] != op_entry(func, args, kwargs):
            self._diverge(func, position)   # Rule 6
            return func(*args, **kwargs)
        n = self.counter[func]
        self.counter[func] = n + 1
        entry = self.stash.pop((func, n), None)  # Rule 4: dropped once taken
        if entry is None:
            return func(*args, **kwargs)
        if any(changed_since_pack(x.packed) for x in tree_leaves(entry.packed)
               if isinstance(x, _Held)):
            self._changed((op_name(func), n))   # Rule 1: the op runs again instead
            return func(*args, **kwargs)
        out = tree_map(lambda x: self.hooks.unpack(x.packed) if isinstance(x, _Held) else x,
                       entry.packed)
        if entry.cpu_rng is not None:  # Rule 2
            torch.set_rng_state(entry.cpu_rng)
            if entry.device_rng is not None:
                torch.cuda.set_rng_state(entry.device_rng, entry.device)
            if entry.generator is not None:
                entry.generator.set_state(entry.generator_rng)
        return out

    def _changed(self, op_id: tuple) -> None:
        """Rule 1: a stored output was changed in place after its op; it is not handed back."""
        if self.on_changed is not None:
            self.on_changed(op_id)
        if (self.block_name, op_id) not in _said_changed:
            _said_changed.add((self.block_name, op_id))
            log.info("offload: auto: an output of %s #%d (as ctx.plan names it) that the "
                     "plan stores for a %s was changed in place after it was stored (the "
                     "forward changes it now, not in the profiled step): the re-run runs that "
                     "op again, as plain checkpoint does", op_id[0].removeprefix("aten."),
                     op_id[1], self.block_name)

    def _diverge(self, func, position: int) -> None:
        """Rule 6: the re-run left the forward's ops; no stored output is handed back."""
        self.diverged = True
        self.stash.clear()   # their tier space returns now
        if self.block_name not in _said_diverged:
            _said_diverged.add(self.block_name)
            forward = op_name(self.ops[position][0]) if position < len(self.ops) else "none"
            log.info("offload: auto: a %s's re-run ran other ops than its forward, or on "
                     "other arguments (op %d: %s, where the forward ran %s; state kept "
                     "outside its inputs and buffers, such as a cache in plain attributes, or "
                     "a backward run under autocast, whose cache holds casts): from there it "
                     "recomputes every op, as plain checkpoint does", self.block_name,
                     position, op_name(func), forward)


# Block types whose re-run left the forward's ops (Rule 6), and (block type, op id) whose
# stored output was changed (Rule 1): said once.
_said_diverged: set[str] = set()
_said_changed: set[tuple] = set()


def forget_messages() -> None:
    """Say Rules 1 and 6's messages again (offload.process.reset)."""
    _said_diverged.clear()
    _said_changed.clear()


def output_bytes(out: Any) -> int:
    """Bytes of the distinct storages of an op's tensor outputs (a stored op's are new:
    Rule 1), as the profile counts them (`OpRecord.out_bytes`)."""
    if type(out) is torch.Tensor and out.layout is torch.strided:   # most ops: one output
        return out.untyped_storage().nbytes()
    storages = {id(s): s.nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                for s in (storage_of(t),) if s is not None}
    return sum(storages.values())


def modes(store: Callable[[tuple, Any], Decision | None], hooks, placement,
          positions: dict | None, block_name: str,
          on_changed: Callable[[tuple], None] | None = None
          ) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """The forward's and the re-run's modes of one block call, sharing its stash (what
    `run_block` hands checkpoint as its `context_fn`'s result)."""
    stash: dict = {}
    ops: list = []
    return (StoreOutputs(stash, ops, store, hooks, placement, positions),
            ReplayOutputs(stash, ops, hooks, block_name, on_changed))
