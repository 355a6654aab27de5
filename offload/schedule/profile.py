"""What one step saved and what each op cost: the scheduler's view of the model.

The profile step runs every block as it is (no checkpoint) while the hooks move every
eligible saved storage to the tiers (memory-safe, like OFFLOAD_POLICY=offload). Inside
blocks a dispatch mode times every op and notes which storages it made; the placement
notes every storage it is asked about (`ItemRecord`): its size, where in the step it was
saved (region and ordinal: the key the plan is looked up by), and which op of which block
made it. The hooks' own pack / unpack clock gives each moved storage's pack→unpack gap.

What profiling costs: one step at offload's cost (every eligible activation crosses the
link once each way), plus a few microseconds of Python per op inside blocks; op times are
taken around the op alone, and the bookkeeping time is subtracted from the forward. On a
GPU every op is bracketed by two CUDA events, read once after the step.

NOTE [Op identity] An op inside a block is `(op name, n)`: its n-th call in that block's
forward, as offload/schedule/stored_ops.py counts them (Rule 3 there), so a profiled op and
the op the recompute replays are the same key. Blocks of one type (blocks.block_type_key)
usually run the same op sequence, and the plan uses their median times; instances whose
sequence differs (data-dependent: a non-contiguous input makes `linear` clone + mm + add
instead of one addmm, and shifts every later id) are planned apart (`block_types`), and the
recompute stores an op's output only where the op comes at the position the plan saw it
(stored_ops.py Rule 5).

NOTE [Micro-batches] With gradient accumulation inside one context, each micro-batch's
backward frees its forward's saves before the next forward: the step holds one micro-batch's
at once, not their sum. Each storage notes its micro-batch (`ItemRecord.segment`, told by
placement.py), the budget and tier capacities hold per micro-batch (costs.py `predict`), a
percentage is of the largest one's saves (`peak_saved_bytes`), and each later forward is
taken to be as long as the first, the one the clock marks (auto_session `_profile`).
"""
from __future__ import annotations

import time
import weakref
from collections import defaultdict
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..runtime.version_check import version_sentinel
from ..runtime.tensor_meta import storage_of
from .recompute import block_inputs
from .stored_ops import IGNORED_OPS, detaches_a_factory_output, op_name, storable_op
from .collectives import COLLECTIVE_NAMESPACES
from .op_timer import OpTimer
from .profile_records import BlockRecord, ItemRecord, OpRecord, Profile
from .unsaved_outputs import UnsavedOutputs

__all__ = ["OpRecord", "ItemRecord", "BlockRecord", "Profile", "BlockProfiler", "step_times",
           "signature", "WHOLE_BLOCK"]

_functorch = torch._C._functorch
_graph_task_id = torch._C._current_graph_task_id


def _under_vmap() -> bool:
    """Whether this runs under vmap: torch.func's, or the one `is_grads_batched` runs
    (torch._vmap_internals: a VmapMode dispatch key the Python enum does not name)."""
    return _functorch.peek_interpreter_stack() is not None or \
        "VmapMode" in str(torch._C._dispatch_tls_local_include_set())


# The one op of a compiled block's record: the block's whole call (BlockProfiler.run).
WHOLE_BLOCK = ("compiled block (run whole)", 0)

_SEEDED = torch.Tag.nondeterministic_seeded
# Inputs whose version counter the profile follows (a subclass's own counter may not be
# reachable through a detached alias; an inference tensor has none). Not weights: an
# optimizer step inside the context changes them after the backward, harmlessly.
_COUNTED = (torch.Tensor, torch.nn.Parameter)


def signature(args: tuple, kwargs: dict) -> tuple:
    """Shapes and dtypes of a block call's tensor arguments (re-plan when they change)."""
    def sig(v):
        if not isinstance(v, torch.Tensor):
            return None
        if v.is_nested and v.layout == torch.strided:   # no .shape: its components' sizes
            return (tuple(map(tuple, v._nested_tensor_size().tolist())), v.dtype,
                    v.device.type)
        return (tuple(v.shape), v.dtype, v.device.type)
    return (tuple(sig(a) for a in args),
            tuple(sorted((k, sig(v)) for k, v in kwargs.items() if isinstance(v, torch.Tensor))))


def step_times(items: list[ItemRecord], report, clock, t0: Any, start_s: float,
               overhead_s: float) -> tuple[float, float] | None:
    """A profiled step's compute seconds, (forward, backward), from its `report`
    (runtime/step.py StepReport), the stalls and the profiler's own Python (`overhead_s`)
    taken out; each item's pack / unpack times, from the step's start (`start_s`), filled
    in from the report's rows. None: the step ran no backward inside the context."""
    timing = {t[0]: t for t in report.rows}
    for it in items:
        t = timing.get(it.hooks_key)
        if t is not None:
            it.pack_s = t[2] - start_s
            it.unpack_s = None if t[3] is None else t[3] - start_s
    if report.backward_mark is None:
        return None
    forward_s = clock.seconds(t0, report.backward_mark)
    backward_s = clock.seconds(report.backward_mark, clock.mark(report.end_s))
    micro_batches = 1 + max((it.segment for it in items), default=0)
    if micro_batches > 1:
        # NOTE [Micro-batches]: the backward mark is the first micro-batch's; each later
        # one's forward is taken to be as long as the first's.
        total_s = forward_s + backward_s
        forward_s = min(forward_s * micro_batches, total_s - backward_s / micro_batches)
        backward_s = total_s - forward_s
    if not clock.device:
        forward_s -= overhead_s   # every micro-batch's forward's: all in forward_s now
    stats = report.stats
    return (max(forward_s - stats.stall_forward_s, 1e-6),
            max(backward_s - stats.stall_backward_s, 1e-6))


class _ProfileMode(TorchDispatchMode):
    """Times ops and maps the storages they make to their op ids (one block's forward)."""

    def __init__(self, profiler: "BlockProfiler", block: BlockRecord) -> None:
        super().__init__()
        self.p = profiler
        self.block = block
        self.counter: dict[Any, int] = defaultdict(int)
        self.made: tuple | None = None   # (record, output) of the op just run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        made, self.made = self.made, None
        if func in IGNORED_OPS:
            if made is not None and detaches_a_factory_output(func, args, made[1]):
                made[0].not_storable = "a factory's, detached by its wrapper"
            return func(*args, **kwargs)
        if func.namespace in COLLECTIVE_NAMESPACES:
            self.block.collective = True
        entered = time.perf_counter()
        n = self.counter[func]
        self.counter[func] = n + 1
        record = OpRecord((op_name(func), n), 0.0, not_storable=storable_op(func),
                          seeded=_SEEDED in func.tags)
        inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)]
        start = self.p.timer.start()
        out = func(*args, **kwargs)
        self.p.timer.stop(record, start)
        self.block.ops.append(record)
        if isinstance(out, torch.Tensor):
            self.made = (record, out)
        p = self.p
        if func._schema.is_mutable:
            # An in-place op: the storages it wrote must not be stored before it (the
            # stored copy would be stale), and it re-runs with whatever made them.
            for arg, a in zip(func._schema.arguments, args):
                written = arg.alias_info is not None and arg.alias_info.is_write
                storage = storage_of(a) if written and isinstance(a, torch.Tensor) else None
                if storage is not None:   # (None: a sparse tensor, never moved)
                    maker = p.producer_record(storage)
                    if maker is not None:
                        maker.not_storable = maker.not_storable or "changed in place later"
                        p.chains.append((maker, record))
        else:
            seen = {id(s) for t in inputs for s in (storage_of(t),) if s is not None}
            for o in torch.utils._pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor) and o.device.type != "meta":
                    storage = storage_of(o)
                    if storage is not None and id(storage) not in seen:
                        seen.add(id(storage))
                        record.out_bytes += storage.nbytes()
                        p.note_storage(storage, record)
        p.overhead_s += time.perf_counter() - entered - (0.0 if p.timer.cuda else record.time_s)
        return out


class _Read:
    """A profiled block's save, with the backward (graph task) that last read it.

    NOTE [Reads a re-run refuses] Torch's checkpoint hands each tensor its re-run made to
    one read and frees it: a backward that reads a saved tensor twice in one backward (a
    custom Function reading `ctx.saved_tensors` twice) raises its CheckpointError, and so
    does a backward under vmap (`is_grads_batched=True`, `jacobian(vectorize=True)`) of a
    block that draws random numbers, which vmap refuses. Plain autograd runs both, and so
    does a block run as it is with its saves moved. A profiled block that does either
    runs as it is in every step from then on (`BlockRecord.rerun_refused`): a plan that
    re-ran its ops would raise at every step, as would a `checkpoint` trial (trials.py NOTE
    [Trials]). A read outside a backward (`grad_fn._saved_self`) is not one."""

    __slots__ = ("packed", "task")

    def __init__(self, packed) -> None:
        self.packed, self.task = packed, -1


class BlockProfiler:
    """Collects BlockRecords during the profile step; the placement asks it who made a
    storage (`producer_of`)."""

    def __init__(self, device_type: str = "cpu", new_event: Callable[[], Any] | None = None,
                 min_bytes: int = 0) -> None:
        self.timer = OpTimer(device_type, new_event)
        self.min_bytes = min_bytes
        self.blocks: list[BlockRecord] = []
        self.overhead_s = 0.0
        self.chains: list[tuple[OpRecord, OpRecord]] = []  # (maker, in-place op on its output)
        self._inputs: dict[int, tuple[weakref.ref, int]] = {}
        # Per call, its tensor inputs' version counters as the call began (zero-byte
        # sentinels: version_check.py NOTE [Version check]); read at `finish`.
        self._input_versions: list[tuple[BlockRecord, list[tuple[torch.Tensor, int]]]] = []
        # The current block's storages and their makers, and what the step's saves used of
        # them (`note_saved`: the placement's saves).
        self.unsaved = UnsavedOutputs(min_bytes)
        self._whole: OpRecord | None = None   # the compiled block running (`run`)
        self.note_saved = self.unsaved.saved

    def note_storage(self, storage: torch.UntypedStorage, record: OpRecord) -> None:
        # Held weakly: the profile must not keep activations alive (NOTE [Storage identity]).
        self.unsaved.made(storage, record)

    def producer_record(self, storage: torch.UntypedStorage) -> OpRecord | None:
        return self.unsaved.maker(storage)

    def producer_of(self, storage: torch.UntypedStorage) -> tuple[tuple | None, int | None]:
        """(op id, None) for a storage made in the current block, (None, i) for its i-th
        tensor input (recompute.block_inputs order), (None, None) otherwise."""
        record = self.producer_record(storage)
        if record is not None:
            return record.op_id, None
        entry = self._inputs.get(id(storage))
        if entry is not None and entry[0]() is storage:
            return None, entry[1]
        if self._whole is not None:   # inside a compiled block: it made what it saves
            return self._whole.op_id, None
        return None, None

    def run(self, index: int, type_key: tuple, type_name: str, forward, args, kwargs, hooks,
            opaque: bool = False):
        """Run one block's forward under the profiling mode.

        Our hooks' own bookkeeping (a storage view, the version sentinel) would run under
        the mode too and read as ops of the block: the block's saves go through the same
        hooks pushed once more, innermost, with the mode switched off around them.

        An `opaque` block (compiled with torch.compile) runs as it is: a dispatch mode
        around compiled code makes dynamo trace our hooks, and the ops it would see are
        not the ones the compiled block runs. Its record has one op, `WHOLE_BLOCK`, timed
        around the call and the maker of every storage it saves but its inputs, so the
        plan runs it whole: as it is, or checkpointed (recomputing `WHOLE_BLOCK`), never
        per op.
        """
        block = BlockRecord(index, type_key, type_name, signature(args, kwargs), opaque=opaque)
        small_seen: set[int] = set()

        def pack(t):
            with _disable_current_modes():
                if type(t) is torch.Tensor and t.layout is torch.strided:
                    self.unsaved.saved(t.untyped_storage())
                    if t.grad_fn is not None:
                        self._note_small(t.untyped_storage(), block, small_seen)
                return _Read(hooks.pack(t))

        def unpack(read: _Read):   # NOTE [Reads a re-run refuses]
            task = _graph_task_id()
            if task >= 0 and (read.task == task or (
                    _under_vmap() and any(op.seeded for op in block.ops))):
                block.rerun_refused = True
            read.task = task
            return hooks.unpack(read.packed)

        self._input_versions.append((block, [
            (version_sentinel(a), a._version) for a in block_inputs(args, kwargs)
            if type(a) in _COUNTED and not a.is_inference() and a.layout is torch.strided
            and not (a.is_leaf and a.requires_grad)]))   # a weight: the optimizer's to change
        self._inputs = {id(s): (weakref.ref(s), i)
                        for i, a in reversed(list(enumerate(block_inputs(args, kwargs))))
                        for s in (storage_of(a),) if s is not None}
        if opaque:
            whole = OpRecord(WHOLE_BLOCK, 0.0)
            self._whole = whole
            t0 = time.perf_counter()
            start = self.timer.start()
            try:
                return forward(*args, **kwargs)
            finally:
                self.timer.stop(whole, start)
                block.forward_s = time.perf_counter() - t0
                block.ops.append(whole)
                self.blocks.append(block)
                self._whole = None
                self._inputs.clear()
        t0 = time.perf_counter()
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack), \
                    _ProfileMode(self, block):
                return forward(*args, **kwargs)
        finally:
            block.forward_s = time.perf_counter() - t0
            self.blocks.append(block)
            self.unsaved.block_done(block)
            self._inputs.clear()

    def _note_small(self, storage: torch.UntypedStorage, block: BlockRecord,
                    seen: set[int]) -> None:
        """A save of the block below OFFLOAD_MIN_BYTES, once per storage, counted to the op
        of the block that made it (`small_saved`)."""
        nbytes = storage.nbytes()
        if nbytes >= self.min_bytes or id(storage) in seen:
            return
        seen.add(id(storage))   # (the block's storages live while it runs: ids are unique)
        record = self.producer_record(storage)
        if record is not None:
            block.small_saved[record.op_id] = block.small_saved.get(record.op_id, 0) + nbytes

    @staticmethod
    def prime() -> None:
        """Pay the one-time costs of a dispatch mode now (its first use imports
        torch._dynamo, which takes long next to a step), not in the profiled step."""
        class _Nothing(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                return func(*args, **(kwargs or {}))

        with _Nothing():
            torch.zeros(1).add_(1)

    def finish(self) -> list[BlockRecord]:
        """The step's block records, once its backward ran."""
        self.timer.resolve()
        for block, versions in self._input_versions:
            block.inputs_changed = any(s._version != v for s, v in versions)
        self._input_versions.clear()
        for maker, inplace in self.chains:
            maker.chain_s += inplace.time_s
        self.chains.clear()
        self.unsaved.finish()
        return self.blocks
