"""The saved-tensor hooks: pack (forward) and unpack (backward), and nothing else.

A saved tensor walks one way: `pack` → `Storer.store` (storing.py: `Placement.decide`, a
tier's `store`) → the C++ engine; and back: `unpack` → its record's `load` → the prefetcher
/ the tier's `fetch`. Each object hands its result down and returns (records.py NOTE
[Record lifetime]).

What pack does, cheapest first (every saved tensor pays the first lines):

1. A plain tensor below OFFLOAD_MIN_BYTES that an op just made stays: an alias and its
   version (`SmallKept`), counted once per storage by the step's ledger.
2. Weights (by what they are, or `model=`'s) stay and are counted apart.
3. Anything else is stored once per storage and version (tensor_meta NOTE [Storage identity],
   NOTE [Versions], NOTE [Untracked aliases]): the storer (storing.py) has the placement
   decide keep or which tiers and a tier take the bytes, and each saved tensor gets a
   `Moved` (view layout + sentinel) or a `Kept` pointing at that record.
4. Other types: subclasses move through their inner tensors (NOTE [Subclasses]); the rest
   stays and is counted by type.

NOTE [Version check] lives in version_check.py: every saved tensor holds an alias or a
sentinel sharing its version counter, and unpack raises autograd's own error when it moved.

NOTE [Handles in C] With the compiled core, the hooks torch calls are the core's `Packer`
and `Unpacker` (csrc/hook_front.cpp, csrc/hook_unpacker.cpp), and what autograd holds for a
tensor that stays is a core handle: a `SmallSave` (step 1: made in C, counted once per
storage in the ledger's `SavedBytes` meter) or a `KeptSave` (steps 2 and 3 when the tensor
stays: the decision is taken here, in `_pack_strided`, which hands the core a `Record` or
None to hold it with). The unpacker checks a handle's version and does a KeptSave's part of
the unpack in C (the backward's marks, its record's timing: `_kept_unpacked` in Python);
everything else goes to `pack_full` / `unpack`. The core's records and index
(csrc/saved_record.cpp, csrc/storage_index.cpp) and the step's timeline (csrc/timeline.cpp)
come with it: all core objects, or all Python ones, as the step's ledger chose its meter.
Same tests, same holding, same message as the Python path (`SmallKept`, `Kept`: taken
without the core and while a profiler runs, so the ranges are recorded); what differs is the
cost: less interpreter, and no object for the garbage collector to walk (every object a save
keeps alive costs it ~1-2 us, docs/benchmarks.md *Hook cost*). Both paths count small
storages in the same meter (one count per storage, whichever path saved it); records count
their storages there (saved bytes; kept, or bytes per tier) and the core's packer the saves
it packs: the step folds the meter into Stats whenever they are read (`Step.fold`).

NOTE [Move path in C] A plain CPU activation that the standing decision (placement.py NOTE
[Standing decision]) sends to a tier with a store in C (`Tier.store_cpu`) is stored by the
core's Packer itself: the steps of `_pack_strided` → `_pack_plain` → `Storer.store`, in
their order (csrc/pack_moved.cpp's header lists them), ending in a `MovedSave`
(saved_handles.Moved in C) or a `KeptSave`, which the Unpacker unpacks in C. Whatever it is
not sure of goes on to `_pack_strided` before anything changed, and while a profiler runs
both hooks take the Python path, so its ranges are recorded.
"""
from __future__ import annotations

import threading
import time
import weakref

import torch

from .._ext import core_available, load_core
from ..util.never_compiled import never_compiled
from ..util.ranges import PACK, UNPACK, profiling, span
from . import hook_stack
from .backward_marks import BackwardMarks, graph_task_id
from .no_offload import no_offload_active, thread_depth
from .placement import Placement
from .records import Ledger, PyRecord
from .saved_handles import Kept, Moved, PackedSubclass, SmallKept, held_tensor_error
from .storing import Storer
from .subclasses import TRACING_TYPES, flatten, held_as_is, kind_name, unmoved_bytes
from .tensor_meta import (ParamStorages, StorageIndex, is_weight, layout_key, movable,
                          movable_strided, untracked_alias)
from .timeline import Timeline
from .version_check import next_sequence_nr, sentinel_data

__all__ = ["OffloadHooks", "after_fork_in_child"]

_Tensor = torch.Tensor
_strided = torch.strided
_CPU = torch.device("cpu")
_profiler_enabled = torch._C._autograd._profiler_enabled


class _NoHandle:
    """Stands for the core's handles where the core is not built (never made)."""


_core = load_core() if core_available() else None   # NOTE [Handles in C]
_SmallSave = _core.SmallSave if _core is not None else _NoHandle
_KeptSave = _core.KeptSave if _core is not None else _NoHandle
_MovedSave = _core.MovedSave if _core is not None else _NoHandle
_new_moved_save = _core.moved_save if _core is not None else None


class _Forks:
    """Bumped in each forked child: hooks made before the fork hold every save as it is
    (process.py NOTE [Process state])."""
    generation = 0


_RETIRED = -1   # the generation of retired hooks (`retire`): never a fork's


def after_fork_in_child() -> None:
    _Forks.generation += 1
    if _core is not None:
        _core.after_fork_in_child()


@never_compiled   # autograd and the core call in here under torch.compile too
class OffloadHooks:
    """pack / unpack for `torch.autograd.graph.saved_tensors_hooks`.

    Args:
        placement: Decides keep or which tiers, per stored storage.
        tiers: The step's open tiers, by name (a decision names them).
        ledger: The step's account of what saved tensors hold (records.py).
        prefetcher: Reads ahead of backward for tiers whose reloads are worth starting early.
        params: `model=`'s parameters and buffers.
        strict: OFFLOAD_STRICT (storing.py).
        min_bytes: OFFLOAD_MIN_BYTES: a smaller activation stays at once (step 1).
        timeline: Where moved (and round-trip-kept) storages' pack → unpack times go
            (the step's round-trip plan and `auto` learn from them).
        clock: Marks the start of the backward on the clock `auto` times steps with
            (util/clock.py: the device's on CUDA); None: not needed.
    """

    def __init__(self, placement: Placement, tiers: dict, ledger: Ledger, prefetcher,
                 params: ParamStorages, strict: bool, min_bytes: int,
                 timeline: Timeline | None = None, clock=None) -> None:
        self.ledger = ledger
        self.stats = ledger.stats
        self.prefetcher = prefetcher
        self.params = params
        self._min_bytes = min_bytes
        self._param_ids: set[int] = set()
        self._lock = threading.RLock()
        self.timeline = timeline if timeline is not None else Timeline()
        # Step 3: decide and store (the core's move path reads it too: NOTE [Move path in C]).
        self.storer = Storer(placement, tiers, ledger, prefetcher, self.timeline, strict)
        # The backward's start and end, as the unpacks see them (the step reads and sets them).
        self.marks = BackwardMarks(prefetcher, clock)

        # NOTE [Handles in C]: the core's front, index and handles go with the core's
        # records, which the ledger makes when the core counts its resident bytes.
        self._record_type = ledger.record_type
        self._generation = _Forks.generation
        self._packer = None
        if self._record_type is PyRecord:
            self.index = StorageIndex()
        else:
            self.index = _core.StorageIndex()
            front = (weakref.ref(self), OffloadHooks.pack_full, OffloadHooks._pack_strided,
                     ledger.meter, min_bytes, _Tensor, _strided, _profiler_enabled,
                     next_sequence_nr, self._record_type)
            if any(tier.stores_cpu_in_core for tier in tiers.values()):
                # NOTE [Move path in C]: what the packer's move path reads.
                self._packer = _core.Packer(
                    *front, index=self.index, timeline=self.timeline, prefetcher=prefetcher,
                    lock=self._lock, param_ids=params.by_storage_id, no_offload=thread_depth,
                    graph_task_id=graph_task_id, empty=sentinel_data(_CPU), cpu_device=_CPU)
            else:
                self._packer = _core.Packer(*front)

    # ---------------------------------------------------------------- hooks
    @property
    def pack(self):
        """The pack hook: the core's `Packer` (NOTE [Handles in C]), else `pack_full`."""
        packer = self._packer
        return packer if packer is not None else self.pack_full

    def retire(self) -> None:
        """Hold every later save as it is, for no step (hook_stack.py: an entry left on
        the stack of a thread the context was not exited on)."""
        self._generation = _RETIRED
        if self._packer is not None:
            self._packer.retire()

    @property
    def retired(self) -> bool:
        return self._generation == _RETIRED

    def unpack_hook(self):
        """What to push as the unpack hook: the core's `Unpacker` in front of `unpack` when
        pack makes core handles. Not kept here: the hooks hold their packer, and autograd
        holds this with every save."""
        if self._packer is None:
            return self.unpack
        return _core.Unpacker(self.unpack, self.marks, held_tensor_error, graph_task_id,
                              _profiler_enabled, self._lock)

    # ---------------------------------------------------------------- pack
    def pack_full(self, t: torch.Tensor):
        """Every step of pack (the module doc), for any tensor."""
        if profiling():  # util/ranges.py
            with span(PACK):
                return self._pack(t)
        return self._pack(t)

    def _pack(self, t: torch.Tensor):
        if self._generation != _Forks.generation:   # a child forked inside the block,
            if self._generation == _RETIRED:          # or retired: on top here, so off
                hook_stack.top()
            return Kept(t, t._version)
        self.stats.packed_tensors += 1   # every save, whichever step below takes it
        if type(t) is _Tensor and t.layout is _strided:
            try:
                storage = t.untyped_storage()
            except NotImplementedError:   # no storage of its own: torch.func's wrappers
                return Kept(t, t._version)
            nbytes = storage.nbytes()
            node = t.grad_fn
            version = t._version
            # 1: a small activation an op made (a leaf without grad_fn, or a view of one,
            # may be a weight: step 2 tells).
            if nbytes < self._min_bytes and node is not None:
                base = t._base
                if base is None or not base.is_leaf:
                    key = id(storage)
                    self.ledger.small_saved(key, nbytes)
                    return SmallKept(t, version, self.ledger, key, node)
            return self._handle(t, version, node,
                                self._pack_strided(t, version, storage, nbytes, node))
        if movable(t):  # an nn.Parameter saved as it is
            return self._pack_movable(t)
        return self._pack_other(t, t._version)

    def _pack_strided(self, t: torch.Tensor, version: int, storage: torch.UntypedStorage,
                      nbytes: int, node):
        """Steps 2 on for a plain strided tensor that is not a small save (also where the
        core's Packer hands one on, with what it read: NOTE [Handles in C]; the caller
        counted the save). Returns the handle, or what one holds a tensor that stays with
        (`_handle`)."""
        if movable_strided(t):
            return self._pack_plain(t, version, storage, nbytes, node)
        return self._pack_other(t, version)

    def _pack_movable(self, t: torch.Tensor):
        storage = t.untyped_storage()
        node = t.grad_fn
        version = t._version
        return self._handle(t, version, node,
                            self._pack_plain(t, version, storage, storage.nbytes(), node))

    def _handle(self, t: torch.Tensor, version: int, node, got):
        """The Python path's handle for what `_pack_strided` returned: a `Kept` for a tensor
        that stays (`got`: its storage's record, None for a weight), else `got` itself. A
        record with a payload is a resident one (the core's Packer counts it the same)."""
        if got is not None:
            if type(got) is not self._record_type:
                return got
            if got.payload is not None:
                self.stats.offloaded_tensors += 1
        return Kept(t, version, got, node)

    # The packed objects capture autograd's message data from `t` as they are made: before
    # pack returns, so no in-place op can have rewritten `t.grad_fn` yet.
    def _pack_plain(self, t: torch.Tensor, version: int, storage: torch.UntypedStorage,
                    nbytes: int, node):
        """`nbytes`: the storage's size (`storage.nbytes()`, read once per save). Returns a
        `Moved`, or for a tensor that stays its storage's `Record` (None for a weight):
        `_handle` or the core's Packer holds the tensor with it."""
        stats = self.stats
        base = t._base   # read once: the weight test and the alias test both look at it
        if self.params.is_param(t, storage, node, base):  # 2
            stats.param_tensors += 1
            if id(storage) not in self._param_ids:
                self._param_ids.add(id(storage))
                stats.param_bytes += nbytes
            return None
        # A save inside no_offload() or during a backward must stay even if the same
        # storage was moved earlier in the step, so it neither reuses nor enters the index.
        in_backward = graph_task_id() >= 0
        no_offload = no_offload_active()
        keep_here = in_backward or no_offload
        # tensor_meta NOTE [Untracked aliases]: such a tensor dedups by its exact layout.
        layout = layout_key(t, base) if untracked_alias(t, nbytes, base) else None
        lock = self._lock   # acquire / release: half the cost of a `with` on this path
        lock.acquire()
        try:
            record = None if keep_here else self.index.lookup(storage, version, layout)
            if record is None:
                record = self.storer.store(t, storage, nbytes, in_backward, no_offload,
                                           layout is not None)
                if not keep_here:
                    self.index.add(storage, version, record, layout)
        finally:
            lock.release()
        if record.payload is None:
            return record
        if record.resident and record.meta is None:
            # The payload *is* the tensor's storage (host tier on a CPU run): holding an
            # alias of it costs nothing and carries its version counter. Counted as
            # offloaded by whoever holds it (`_handle`, the core's Packer).
            return record
        stats.offloaded_tensors += 1
        # With the record's layout if it has one (a snapshot). A core record's saves are the
        # core's handles, which alone load it (csrc/saved_record.cpp `record_load`).
        if self._packer is not None:
            return _new_moved_save(t, record, version, node, base, sentinel_data(t.device))
        return Moved(t, record, version)

    def _pack_other(self, t: torch.Tensor, version: int):
        """A tensor our byte round trip cannot hold as it is (subclasses NOTE [Subclasses])."""
        if is_weight(t):  # a DTensor / quantized weight: never moved, like any parameter
            self.stats.param_tensors += 1
            return Kept(t, version)
        flat = flatten(t)
        if flat is not None:
            return PackedSubclass(t, flat, [self._pack_inner(x) for x in flat.inner], version)
        name = kind_name(t)
        if name not in TRACING_TYPES:
            self.stats.count_unmoved(name, unmoved_bytes(t))
        return Kept(t, version)

    def _pack_inner(self, x: object):
        """One inner entry of a flattened subclass (NOTE [Subclasses])."""
        if not isinstance(x, torch.Tensor):
            return x
        if held_as_is(x):
            return Kept(x, x._version)
        return self._pack_movable(x) if movable(x) else self._pack_other(x, x._version)

    # ---------------------------------------------------------------- unpack
    def unpack(self, packed) -> torch.Tensor:
        if profiling():  # util/ranges.py
            with span(UNPACK):
                return self._unpack(packed)
        return self._unpack(packed)

    def _unpack(self, packed) -> torch.Tensor:
        cls = type(packed)
        if cls is _SmallSave or cls is _KeptSave:  # the core's (NOTE [Handles in C]), while
            if cls is _KeptSave:                   # a profiler runs, or a replayed save
                self._kept_unpacked(packed.record)
            tensor = packed.tensor_if_unchanged()
            if tensor is None:
                raise held_tensor_error(packed)   # NOTE [Version check]
            return tensor
        if cls is SmallKept:
            packed.check_version()  # NOTE [Version check]
            return packed.tensor
        if cls is Kept and self._generation != _Forks.generation:
            return packed.unpack()   # held in a forked child (`_pack`): no step to mark
        self.marks()
        if cls is Moved or cls is _MovedSave:
            return packed.unpack(self._lock)
        if cls is PackedSubclass:
            packed.check_version()  # the outer tensor's counter (NOTE [Subclasses])
            inner = [self._unpack(x) if isinstance(x, (Kept, Moved, _MovedSave, PackedSubclass))
                     else x for x in packed.inner]
            return packed.flat.rebuild(inner)
        return packed.unpack()  # Kept

    def _kept_unpacked(self, record) -> None:
        """A KeptSave's unpack, but for its version check, in Python (`_unpack` while a
        profiler runs; the core's Unpacker does the same in C). `record`: its storage's
        record, None for a weight."""
        self.marks()
        if record is not None and record.timeline is not None:
            record.timeline.unpacked(record.row, time.perf_counter())
