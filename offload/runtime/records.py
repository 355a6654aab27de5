"""What autograd holds for each saved tensor, and what the runtime holds for each storage.

* `Kept`: a saved tensor that stays where it is: a `detach()`ed alias (same storage, same
  version counter) plus what autograd's error message needs (NOTE [Version check] in
  version_check.py). The alias, not the tensor: an output saved by its own node would tie
  a cycle the garbage collector cannot see (node -> Kept -> tensor -> grad_fn -> node), and a
  graph dropped without backward would never be freed. Autograd rebuilds the autograd
  metadata of whatever unpack returns.
* `Moved`: a saved tensor whose storage went to a tier: its `Record`, the view layout to
  rebuild and a zero-byte sentinel sharing its version counter. The compiled core's
  `MovedSave` (csrc/moved_save.cpp) is the same, made by the core's packer (hooks.py NOTE
  [Move path in C]); its unpack calls `load` below for what it does not do in C.
* `Record`: one stored storage (views share it: tensor_meta NOTE [Storage identity]); the
  compiled core's (csrc/saved_record.cpp), or without it `PyRecord`, worked on by `load` and
  `handle_done`.
* `SmallSave` (the compiled core's, csrc/saved_handles.cpp) or, without the core, `SmallKept`:
  a saved tensor below OFFLOAD_MIN_BYTES; the core's `KeptSave` is the `Kept` of a tensor
  that stays, made in C (hooks.py NOTE [Handles in C]).
* `Ledger`: the step's account of what its records and kept tensors hold, with the bytes
  resident on the device in a `SavedBytes` meter (saved_bytes.py).

NOTE [Record lifetime] A record lives exactly as long as some saved tensor of it lives, i.e.
as long as autograd holds it. Its death gives the payload back to its tier (under the
step's meter's release lock, on whatever thread autograd drops it): with
backward freeing saved tensors as it goes, tier space returns during backward and usage is
back to zero when backward ends. With retain_graph the records survive and a second
backward loads again. When the step is aborted (the block raised) its tiers are closed;
a later unpack of such a record raises UsedAfterCloseError. Every call a record makes goes
down (its tier, the prefetcher, the meter); nothing it does calls the hooks that made it.

NOTE [A storage resized since its pack] Code that frees a saved tensor's memory after the
forward (`t.untyped_storage().resize_(0)`, as FSDP and ZeRO do with their own buffers)
makes plain autograd raise in backward: the saved tensor no longer fits its storage. A
moved save would come back from its tier's copy, taken from memory that may have been
freed while the write was in flight. So a moved save whose storage still lives with
another size than it was stored at is rebuilt over that storage as it is now, as autograd
would: torch raises autograd's error for a storage too small, and a storage grown (moved
by the resize, its bytes kept) gives its bytes. A storage freed and grown back to its size
in place, or one that died after being resized, is not seen; nor is a resize of a storage
whose saved piece was stored as a private copy taken at the pack (a snapshot: tensor_meta
NOTE [Untracked aliases]), which comes back as it was saved.

NOTE [Writes into a shared copy] Autograd unpacks a moved save as a copy of its bytes (on
`nvme`, and `host` on a GPU), and every save of one storage is handed the same loaded copy
(NOTE [Unpack cache]). A backward that writes into a tensor it unpacked (a custom
`Function` changing `ctx.saved_tensors` in place) or code writing into one read through
`grad_fn._saved_self` changes that copy, not the forward's tensor, and no version counter
autograd checks. Plain autograd raises its in-place error when another save of that tensor
is unpacked after such a write. A CPU nvme payload's copy is one flat tensor and each save
is a view of it, sharing its version counter: its version is noted when it is loaded, and an
unpack from the cache that finds it moved on raises autograd's error, with the version
autograd would report (the save's own plus the writes). Not seen: a copy let go before
the next unpack (every save of the storage was unpacked: the weak reference died, and the
bytes are loaded afresh; a single save written through `grad_fn._saved_self`, a retained
graph's second backward), and the copies rebuilt over a storage (a CUDA storage's, and the
Python records'), whose counters are their own (README, *Limits*). Seeing the first would
cost a version sentinel per load.

NOTE [Unpack cache] Several saved tensors of one storage are unpacked at different times.
The loaded bytes stay referenced by the record while some of its saved tensors have not been
unpacked yet (so the storage is read once), then only weakly: their storage here, or for a
CPU nvme payload the flat tensor the tier handed them out as, typed as the first unpack's
dtype; later saves of another dtype view it as theirs (the core loads those records itself,
csrc/saved_record.cpp `record_load`, csrc/view_layout.cpp `rebuild_over_flat`). A reloaded CUDA
storage may be unpacked on several streams (autograd runs each node on its forward's
stream): every stream after the first waits for the first one's hand-off (copies Note 12).
"""
from __future__ import annotations

import time
import weakref

from typing import Any

import torch

from .._ext import core_available, load_core
from ..errors import UsedAfterCloseError
from ..tiers.base import on_cuda
from ..tiers.copy_tickets import SharedReload
from ..util.never_compiled import never_compiled
from .saved_bytes import PySavedBytes, saved_bytes_meter
from .tensor_meta import ViewMeta, instance_attrs, rebuild, rebuild_as_resized, view_meta
from .version_check import NOBODY, SavedOrigin, next_sequence_nr as _next_sequence_nr, \
    node_at_unpack, version_error, version_sentinel

__all__ = ["Ledger", "Record", "PyRecord", "load", "handle_done", "Kept", "SmallKept", "Moved",
           "PackedSubclass"]

_UNSET: Any = object()


class Ledger:
    """What a step's saved tensors hold: live records with tier space, resident bytes.

    Records and kept tensors count themselves in and out of the step's `SavedBytes` meter
    as they come and go, on whatever thread autograd drops them (its device threads too):
    the bytes resident on the device, the small saves' storages (counted once while any
    save of them lives, whichever hook path saved them) and the records holding tier
    space; the meter keeps itself consistent (the core's with the GIL, the Python one with
    its own lock and free queue). `fold()` brings its figures into the step's Stats.
    """

    __slots__ = ("stats", "meter", "record_type")

    def __init__(self, stats) -> None:
        self.stats = stats
        self.meter = saved_bytes_meter()   # what the step's saves hold (saved_bytes.py)
        # The step's records: the core's with the core's meter (hooks.py NOTE [Handles in
        # C]), else the Python ones; the same fields and calls.
        self.record_type = PyRecord if type(self.meter) is PySavedBytes else Record

    def fold(self) -> None:
        """Bring what the meter counted into the step's Stats (at the block's exit and at
        the step's end; idempotent)."""
        stats, meter = self.stats, self.meter
        packed, offloaded, storages, saved_bytes, kept_bytes, stored = meter.take_counts()
        stats.packed_tensors += packed
        stats.offloaded_tensors += offloaded
        stats.unique_storages += storages
        stats.saved_bytes += saved_bytes
        stats.kept_bytes += kept_bytes
        for tier, nbytes in stored:
            stats.tier(tier.name).bytes += nbytes
        stats.resident_bytes = meter.resident
        stats.peak_resident_bytes = meter.peak

    def small_saved(self, key: int, nbytes: int) -> None:
        """A small storage saved (again) by the Python path (`SmallKept`)."""
        self.meter.small_saved(key, nbytes)

    def small_freed(self, key: int) -> None:
        """A small save of the Python path died (on whatever thread autograd dropped it)."""
        self.meter.small_freed(key)

    @property
    def live_records(self) -> int:
        """Records holding tier space (the step ends at 0: step.py NOTE [End of step])."""
        return self.meter.live_records

    @property
    def idle_since_s(self) -> float | None:
        """When the last of them died (only noted: the step ends at a defined point)."""
        return self.meter.idle_since_s


@never_compiled   # freed (payload given back) wherever its last save dies: NOTE [Never compiled]
class PyRecord(weakref.ref):
    """One stored storage: where its bytes are (tier and payload; none when kept).

    The compiled core's `Record` (csrc/saved_record.cpp) is this, as an object the garbage
    collector does not walk; this one serves a process without the core. Both have the
    same fields, are weak references to the storage they were made for (`record()`: the
    storage while it lives, so the storage index checks a hit with it: tensor_meta NOTE
    [Storage identity]), count themselves into the step's meter when made and out when
    freed (giving the payload back to its tier), and are worked on by `load` and
    `handle_done` below.
    """

    __slots__ = ("tier", "payload", "nbytes", "resident", "meta", "meter", "prefetcher",
                 "handles_left", "cache", "cache_ref", "cache_offset", "shared", "timeline",
                 "row", "version", "__weakref__")

    def __new__(cls, storage: torch.UntypedStorage, *args, **kwargs) -> "PyRecord":
        return super().__new__(cls, storage)  # no callback: the other arguments are ours

    def __init__(self, storage: torch.UntypedStorage, tier, payload, nbytes: int,
                 resident: bool, meta: ViewMeta | None, meter: PySavedBytes,
                 prefetcher) -> None:
        self.tier = tier              # None when kept
        self.payload = payload
        self.nbytes = nbytes
        self.resident = resident
        # A snapshot's layout (tensor_meta NOTE [Untracked aliases]): the payload holds only
        # those elements, so every save deduped onto this record rebuilds with it.
        self.meta = meta
        self.prefetcher = prefetcher  # set when the tier's reloads are worth starting early
        self.handles_left = 0         # saved tensors of this record not yet unpacked
        self.cache = None             # strong reference to the loaded storage (NOTE [Unpack cache])
        self.cache_ref = None         # weak reference to it
        self.cache_offset = 0
        self.shared: SharedReload | None = None  # a CUDA storage's streams (NOTE [Unpack cache])
        self.timeline = None          # the step's Timeline, when this storage is timed
        self.row = -1                 # ... and its row there
        self.version = -1             # set by the StorageIndex: the version it was stored at
        meter.record_made(nbytes, resident, tier if payload is not None else None)
        self.meter = meter            # last: a record counted in is counted out

    def note_packed(self, timeline, position: int) -> None:
        """A row on `timeline` for this storage, packed now (the `position`-th storage the
        step stored); its first unpack is noted there."""
        self.row = timeline.add(position, self.nbytes, time.perf_counter())
        self.timeline = timeline

    def __del__(self) -> None:
        try:
            meter = getattr(self, "meter", None)
            if meter is not None:
                meter.record_freed(self.tier, self.payload, self.nbytes, self.resident)
        except Exception:  # interpreter shutdown or a closed tier: nothing left to free
            pass


Record = load_core().Record if core_available() else PyRecord


@never_compiled   # the core's unpack calls it (NOTE [Never compiled])
def load(record) -> tuple[torch.UntypedStorage, int]:
    """A moved record's bytes (loading them at most once while they are needed)."""
    storage = record.cache if record.cache is not None else \
        (record.cache_ref() if record.cache_ref is not None else None)
    if storage is None:
        tier, payload = record.tier, record.payload
        if tier.released(payload) or tier.closed:
            raise UsedAfterCloseError(
                "offload: a saved tensor was used after its offload.activations() context "
                "released it (the block exited with an exception, or the context's close() "
                "ran before this backward); run backward before closing the context")
        if record.timeline is not None:
            record.timeline.unpacked(record.row, time.perf_counter())
        if record.prefetcher is not None:
            flat = record.prefetcher.fetch(tier, payload)
        else:
            flat = tier.fetch(payload)
        storage, record.cache_offset = flat.untyped_storage(), flat.storage_offset()
        record.cache_ref = weakref.ref(storage)
        record.shared = SharedReload(storage.device) if on_cuda(storage.device) else None
    elif record.shared is not None:
        record.shared.use_on_current_stream(storage, record.cache_offset)  # copies Note 12
    if record.handles_left > 1:
        record.cache = storage
    return storage, record.cache_offset


def handle_done(record) -> None:
    """One saved tensor of a moved record was unpacked (or died unpacked)."""
    record.handles_left -= 1
    if record.handles_left <= 0:
        record.cache = None


@never_compiled   # autograd frees and unpacks it: NOTE [Never compiled]
class Kept:
    """A saved tensor that stays where it is (see the module doc)."""

    __slots__ = ("tensor", "version", "record", "node_name", "output_nr")

    def __init__(self, t: torch.Tensor, version: int, record: Record | None = None,
                 node: Any = _UNSET) -> None:
        if node is _UNSET:
            node = t.grad_fn
        if node is not None and (_next_sequence_nr is None
                                 or node._sequence_nr() == _next_sequence_nr() - 1):
            # Saved by its own node (an output): an alias breaks the cycle (module doc), and
            # autograd's message names this node (version_check.py).
            self.tensor = t.detach()
            self.node_name = type(node).__name__
            self.output_nr = t.output_nr
        else:
            # An input or a leaf, held as autograd itself holds one: its grad_fn when
            # unpacked names the op that changed it.
            self.tensor = t
            self.node_name = None
        self.version = version
        self.record = record          # the storage's record, when it has one (dedup, timing)

    def check_version(self) -> None:
        """NOTE [Version check]: raise autograd's error if the tensor changed since pack."""
        if self.tensor._version != self.version:
            raise kept_version_error(self.tensor, self.version, self.node_name,
                                     self.output_nr if self.node_name is not None else 0)

    def unpack(self) -> torch.Tensor:
        self.check_version()
        record = self.record
        if record is not None and record.timeline is not None:
            record.timeline.unpacked(record.row, time.perf_counter())
        return self.tensor


class _KeptOrigin:
    """What autograd's message names for a kept tensor (version_check.py)."""

    __slots__ = ("tensor", "node_name", "output_nr")

    def __init__(self, tensor: torch.Tensor, node_name: str | None, output_nr: int) -> None:
        self.tensor, self.node_name, self.output_nr = tensor, node_name, output_nr

    def node_at_unpack(self) -> str | None:
        # An output: the node that saved it; an input: its grad_fn now (the in-place op).
        return node_at_unpack(NOBODY if self.node_name is not None else self.tensor,
                              self.node_name, False)


def kept_version_error(tensor: torch.Tensor, expected: int, node_name: str | None,
                       output_nr: int) -> RuntimeError:
    """Autograd's error for a kept tensor (`Kept`, `SmallKept`, the core's handles)
    changed in place since pack; `node_name` None: an input, named at unpack."""
    if node_name is None:
        output_nr = tensor.output_nr
    return version_error(tensor.dtype, tensor.device, tensor.shape,
                         _KeptOrigin(tensor, node_name, output_nr), expected, tensor._version)


@never_compiled   # the core's unpacker calls it (NOTE [Never compiled])
def held_tensor_error(save) -> RuntimeError:
    """The error for the core's `SmallSave` / `KeptSave` whose tensor changed (its unpack
    raises it)."""
    return kept_version_error(save.tensor, save.version, save.node_name, save.output_nr)


@never_compiled   # autograd frees and unpacks it: NOTE [Never compiled]
class SmallKept(Kept):
    """A saved tensor below OFFLOAD_MIN_BYTES: the step's ledger counts its storage once
    while any save of it lives (no record: the fast path)."""

    __slots__ = ("ledger", "key")

    def __init__(self, t: torch.Tensor, version: int, ledger: Ledger, key: int,
                 node: Any) -> None:
        Kept.__init__(self, t, version, None, node)
        self.ledger = ledger
        self.key = key

    def __del__(self) -> None:
        try:
            self.ledger.small_freed(self.key)
        except Exception:  # interpreter shutdown
            pass


@never_compiled   # autograd frees and unpacks it: NOTE [Never compiled]
class Moved(SavedOrigin):
    """A saved tensor whose storage went to a tier (see the module doc).

    It holds the view layout to rebuild as `ViewMeta`'s fields of its own rather than a
    `ViewMeta`: every object a save keeps alive until backward is one more for the garbage
    collector to walk (docs/benchmarks.md *Hook cost*), and `rebuild` reads only the fields.
    """

    __slots__ = ("record", "version", "sentinel", "unpacked", "attrs") + ViewMeta._fields

    def __init__(self, t: torch.Tensor, record: Record, version: int) -> None:
        self.record = record
        # The tensor's own layout over the stored storage, or a snapshot's (tensor_meta NOTE
        # [Untracked aliases]); the ViewMeta itself is not kept.
        meta = record.meta if record.meta is not None else view_meta(t)
        self.dtype, self.size, self.stride, self.storage_offset, self.conj, self.neg = meta
        self.version = version
        self.sentinel = version_sentinel(t)  # zero bytes; shares t's version counter
        self.attrs = instance_attrs(t)  # tensor_meta NOTE [Saved attributes]
        self.unpacked = False
        record.handles_left += 1

    def check_version(self) -> None:
        seen = self.sentinel._version
        if seen != self.version:
            raise version_error(self.dtype, self.sentinel.device, self.size, self,
                                self.version, seen)

    def unpack(self, lock) -> torch.Tensor:
        self.check_version()  # NOTE [Version check]
        # NOTE [A storage resized since its pack]; a snapshot's record stored a private
        # copy of part of the storage (tensor_meta NOTE [Untracked aliases]): not this case.
        live = self.record() if self.record.meta is None else None
        if live is not None and live.nbytes() != self.record.nbytes:
            out = rebuild_as_resized(live, self)
        else:
            with lock:
                storage, offset = load(self.record)
            out = rebuild(storage, offset, self)   # its layout fields (class doc)
        if self.attrs is not None:
            out.__dict__ = self.attrs   # shared, not copied: tensor_meta NOTE [Saved attributes]
        if not self.unpacked:
            self.unpacked = True
            handle_done(self.record)
        return out

    def __del__(self) -> None:
        if not self.unpacked:
            self.unpacked = True
            handle_done(self.record)


class _MovedOrigin:
    """What autograd's message names for the core's MovedSave (version_check.py)."""

    __slots__ = ("save",)

    def __init__(self, save) -> None:
        self.save = save

    @property
    def output_nr(self) -> int:
        return self.save.output_nr

    def node_at_unpack(self) -> str | None:
        save = self.save
        tensor = save.origin() if save.origin is not None else NOBODY
        return node_at_unpack(tensor, save.node_name, save.is_view)


@never_compiled   # the core's MovedSave calls it
def moved_version_error(save, seen: int) -> RuntimeError:
    """The error for the core's MovedSave whose tensor is at version `seen` (its unpack
    raises it): changed in place since the pack, or its shared copy since the load (NOTE
    [Writes into a shared copy])."""
    return version_error(save.dtype, save.sentinel.device, save.size, _MovedOrigin(save),
                         save.version, seen)


if core_available():   # what the core's MovedSave calls (hooks.py NOTE [Move path in C])
    load_core().configure_moved(load=load, empty=torch.empty, neg_view=torch._neg_view,
                                version_error=moved_version_error,
                                next_sequence_nr=_next_sequence_nr,
                                rebuild_as_resized=rebuild_as_resized)


@never_compiled   # autograd frees and unpacks it: NOTE [Never compiled]
class PackedSubclass(SavedOrigin):
    """What autograd holds for a saved wrapper subclass: its inner tensors, packed each
    (subclasses NOTE [Subclasses])."""

    __slots__ = ("flat", "inner", "version", "sentinel")

    def __init__(self, t: torch.Tensor, flat, inner: list, version: int) -> None:
        self.flat = flat
        self.sentinel = flat.sentinel(t)
        flat.inner = None  # the inner tensors live on only as `inner`'s packed entries
        self.inner = inner
        self.version = version

    def check_version(self) -> None:
        seen = self.sentinel._version
        if seen != self.version:
            raise version_error(self.sentinel.dtype, self.sentinel.device, self.flat.size,
                                self, self.version, seen)
