"""What the runtime holds for each stored storage, and the step's account of them.

* `Record`: one stored storage (views share it: tensor_meta NOTE [Storage identity]); the
  compiled core's (csrc/saved_record.cpp), or without it `PyRecord`, worked on by `load` and
  `handle_done`. What autograd holds for each saved tensor, and refers to a record with, is
  in saved_handles.py.
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

NOTE [Writes into a shared copy] Autograd unpacks a moved save as a copy of its bytes (on
`nvme`, and `host` on a GPU), and every save of one storage is handed the same loaded copy
(NOTE [Unpack cache]; a save of another layout, a copy of its own: NOTE [One tensor per
layout]). A backward that writes into a tensor it unpacked (a custom
`Function` changing `ctx.saved_tensors` in place) or code writing into one read through
`grad_fn._saved_self` changes that copy, not the forward's tensor, and no version counter
autograd checks. Plain autograd raises its in-place error when another save of that tensor
is unpacked after such a write. A CPU nvme payload's copy is one flat tensor and each save
is a view of it, sharing its version counter: its version is noted when it is loaded, and an
unpack from the cache that finds it moved on raises autograd's error, with the version
autograd would report (the save's own plus the writes); a save with gaps is handed a fresh
tensor with its strides instead (tensor_meta NOTE [Snapshot strides]), at version 1 after its
copy, and the cache counts writes into it by its own counter. Not seen: a write before an
unpack that loads afresh (every save of the storage was unpacked already: a single save
written through `grad_fn._saved_self`, a retained graph's second backward), writes into
the copy a save of another layout was handed (NOTE [One tensor per layout]), and the copies
rebuilt over a storage (a CUDA storage's, and the Python records'), whose counters are
their own (README, *Limits*). Seeing the first would cost a version sentinel per load.

NOTE [Unpack cache] Several saved tensors of one storage are unpacked at different times.
The loaded bytes stay referenced by the record while some of its saved tensors have not been
unpacked yet (so the storage is read once): their storage here, or for a CPU nvme payload
the flat tensor the tier handed them out as, typed as the first unpack's dtype; later saves
of another dtype view it as theirs (the core loads those records itself,
csrc/saved_record.cpp `record_load`, csrc/view_layout.cpp `rebuild_over_flat`). Once every
save was unpacked the record lets go of them, and an unpack after that (a retained graph's
next backward, `ctx.saved_tensors` read again) loads afresh (NOTE [One tensor per layout]).
A reloaded CUDA storage may be unpacked on several streams (autograd runs each node on its
forward's stream): every stream after the first waits for the first one's hand-off (copies
Note 12).

NOTE [One tensor per layout] Autograd's AccumulateGrad takes a gradient that nothing else
refers to as the parameter's `.grad` itself, uncopied, and adds the next micro-batch's into
it in place. Plain autograd unpacks every save of a tensor as that same tensor object, which
its saves keep referring to: taken as a `.grad` it is copied. A backward that returns saved
tensors as gradients (custom Functions do) must not be handed two tensors over one copy, or
the copy itself once it may be a `.grad`:
1. While other saves of the storage are still to be unpacked, the record keeps the tensor it
   handed out for each layout (`handed`: dtype, size, stride, offset, conj / neg bits and
   attribute dict), and hands it again to a save of that layout. Referred to by the record,
   it is copied if it becomes a gradient meanwhile, as plain autograd's is.
2. A save of another layout (a tensor and its transpose both saved) gets a copy of the bytes
   of its own: two tensors over one copy could both be taken as gradients. (Plain autograd's
   transpose is a view that refers to the tensor, which is then copied; ours cannot refer
   to the first one's without keeping it: ours are views of the loaded bytes, not of each
   other.) A write into one is not seen by the other, where plain autograd's view sees it.
   Such storages are rare: 2 of 59 in a small Llama, 3% of its saved bytes; none in GPT-2
   or a conv net.
3. An unpack after every save was unpacked loads afresh (NOTE [Unpack cache]): the copy
   handed out last may be a `.grad` by now, changed in place. A write into it (a backward
   changing `ctx.saved_tensors`, then reading them again) is not seen, where plain autograd
   raises its in-place error: a `.grad` accumulated in place would look the same.
4. A save rebuilt over its storage as it is now (resized since the pack: saved_handles.py
   NOTE [A storage resized since its pack]) is over a copy of it: over the live storage, a
   `.grad` taken of it would be the user's tensor's memory.
Lookups and additions run under the hooks' lock, as the load does: autograd may unpack saves
of one storage on two threads.
Tests: tests/test_unpacked_grads.py (each case gave 5 where plain autograd gives 3, or read
a `.grad` back as a saved tensor).
"""
from __future__ import annotations

import time
import weakref

import torch

from .._ext import core_available, load_core
from ..errors import UsedAfterCloseError
from ..tiers.base import on_cuda
from ..tiers.copy_tickets import SharedReload
from ..util.never_compiled import never_compiled
from .saved_bytes import PySavedBytes, saved_bytes_meter
from .tensor_meta import ViewMeta

__all__ = ["Ledger", "Record", "PyRecord", "load", "handle_done"]


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
                 "handles_left", "cache", "cache_offset", "shared", "handed",
                 "timeline", "row", "version", "__weakref__")

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
        self.cache_offset = 0
        self.shared: SharedReload | None = None  # a CUDA storage's streams (NOTE [Unpack cache])
        self.handed: dict | None = None  # layout -> tensor (NOTE [One tensor per layout])
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
    # Only the strong cache is used again: a copy handed out earlier may be a gradient by now
    # (NOTE [One tensor per layout]), so an unpack after they all were loads afresh.
    storage = record.cache
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
        record.cache = record.handed = None
