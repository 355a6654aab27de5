"""The saved-tensor hooks: what autograd holds instead of each saved tensor, and back.

`OffloadHooks.pack` runs when autograd saves a tensor (forward); `unpack` when backward needs
it. One `_Record` per stored storage (views share it: see tensor_meta NOTE [Storage identity]);
one `_Packed` per saved tensor, pointing at its record plus the view layout to rebuild.

NOTE [Version check] lives in offload/version_check.py: every `_Packed` holds a `detach()`ed
alias of the saved tensor (kept ones) or a zero-byte *sentinel* (moved ones), both sharing
its version counter, and unpack raises autograd's own error when the counter moved.

NOTE [Record lifetime] A record lives exactly as long as some `_Packed` of it lives, i.e. as
long as autograd holds a saved tensor of that storage. Its `__del__` releases the payload:
with backward freeing saved tensors as it goes, tier space returns during backward and usage
is back to zero when backward ends. With retain_graph the records survive and a second
backward loads again. When the context exits with an exception, `release_all` frees every
payload at once; a later unpack of such a record raises a clear error.

NOTE [Unpack cache] Several saved tensors of one storage are unpacked at different times.
The loaded bytes stay referenced by the record while some of its `_Packed` have not been
unpacked yet (so the storage is read once), then only weakly. A reloaded CUDA storage may
be unpacked on several streams (autograd runs each node on its forward's stream): every
stream after the first waits for the first one's hand-off (cuda_streams Note 12).
"""
from __future__ import annotations

import logging
import threading
import time
import weakref

import torch

from .cuda_streams import SharedReload
from .errors import TierFullError, UsedAfterCloseError
from .placement import Placement, TensorInfo
from .prefetch import Prefetcher
from .sizes import format_bytes
from .stats import Stats
from .subclasses import TRACING_TYPES, Flattened, flatten, kind_name, unmoved_bytes
from .tensor_meta import (ParamStorages, StorageIndex, ViewMeta, is_weight, layout_key, movable,
                          rebuild, snapshot, untracked_alias, view_meta)
from .tiers.base import Tier
from .version_check import SavedOrigin, version_error, version_sentinel

__all__ = ["OffloadHooks", "no_offload_active", "no_offload_depth"]

log = logging.getLogger("offload")

class _NoOffloadDepth(threading.local):
    depth = 0  # class default: no AttributeError path on threads that never set it


_local = _NoOffloadDepth()

# The id of the backward running on this thread, -1 outside one (torch >= 2.0).
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def no_offload_depth() -> int:
    return _local.depth


def no_offload_active() -> bool:
    return _local.depth > 0


def _set_no_offload_depth(depth: int) -> None:
    _local.depth = depth


class _Record:
    """One stored storage (see NOTE [Record lifetime])."""

    __slots__ = ("hooks", "payload", "nbytes", "kind", "resident", "handles_left", "cache",
                 "cache_ref", "cache_offset", "shared", "released", "timing", "meta",
                 "__weakref__")

    def __init__(self, hooks: "OffloadHooks", payload, nbytes: int, kind: str,
                 resident: bool, meta: ViewMeta | None = None) -> None:
        self.hooks = hooks
        self.payload = payload        # None when kept
        # A snapshot's layout (tensor_meta NOTE [Untracked aliases]): the payload holds only
        # those elements, so every save deduped onto this record rebuilds with it.
        self.meta = meta
        self.nbytes = nbytes
        self.kind = kind              # "keep" or a tier name
        self.resident = resident
        self.handles_left = 0         # _Packed of this record not yet unpacked
        self.cache = None             # strong reference to the loaded storage (NOTE [Unpack cache])
        self.cache_ref = None         # weak reference to it
        self.cache_offset = 0
        self.shared: SharedReload | None = None  # a CUDA storage's streams (NOTE [Unpack cache])
        self.released = False
        self.timing: list | None = None  # [key, nbytes, pack_s, unpack_s] (BouncePlan)

    def load(self) -> tuple[torch.UntypedStorage, int]:
        storage = self.cache if self.cache is not None else \
            (self.cache_ref() if self.cache_ref is not None else None)
        if storage is None:
            if self.released:
                raise UsedAfterCloseError(
                    "offload: a saved tensor was used after its offload.activations() context "
                    "released it (the block exited with an exception, or the context's close() "
                    "ran before this backward); run backward before closing the context")
            if self.timing is not None and self.timing[3] is None:
                self.timing[3] = time.perf_counter()
            flat = self.hooks.fetch(self.payload)
            storage, self.cache_offset = flat.untyped_storage(), flat.storage_offset()
            self.cache_ref = weakref.ref(storage)
            self.shared = SharedReload(storage.device) if storage.device.type == "cuda" else None
        elif self.shared is not None:
            self.shared.use_on_current_stream(storage, self.cache_offset)  # cuda_streams Note 12
        if self.handles_left > 1:
            self.cache = storage
        return storage, self.cache_offset

    def handle_done(self) -> None:
        self.handles_left -= 1
        if self.handles_left <= 0:
            self.cache = None

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.cache = None
            if self.payload is not None:
                self.payload.release()

    def __del__(self) -> None:
        try:
            self.hooks._record_freed(self)
        except Exception:  # interpreter shutdown or a closed tier: nothing left to free
            pass


class _Packed:
    """What autograd holds for one saved tensor."""

    __slots__ = ("record", "meta", "tensor", "version", "sentinel", "origin", "unpacked")

    def __init__(self, record: _Record | None, meta: ViewMeta | None,
                 tensor: torch.Tensor | None, version: int, sentinel: torch.Tensor | None,
                 origin: SavedOrigin) -> None:
        self.record = record
        self.meta = meta
        # Set when the tensor stays where it is: a detach()ed alias (same storage, same
        # version counter). The tensor itself would tie a cycle the garbage collector cannot
        # see when it is an output of the node saving it (node -> _Packed -> tensor ->
        # grad_fn -> node): a graph dropped without backward would never be freed. Autograd
        # rebuilds the autograd metadata of whatever unpack returns.
        self.tensor = tensor
        self.version = version
        self.sentinel = sentinel      # moved tensors: shares its version counter
        self.origin = origin          # for autograd's message
        self.unpacked = False

    def check_version(self) -> None:
        """NOTE [Version check]: raise autograd's error if the tensor changed since pack."""
        holder = self.tensor if self.tensor is not None else self.sentinel
        seen = holder._version
        if seen != self.version:
            if self.meta is not None:
                dtype, size = self.meta.dtype, self.meta.size
            else:
                dtype, size = holder.dtype, holder.shape
            raise version_error(dtype, holder.device, size, self.origin, self.version, seen)

    def mark_unpacked(self) -> None:
        if not self.unpacked:
            self.unpacked = True
            if self.record is not None:
                self.record.handle_done()

    def __del__(self) -> None:
        if not self.unpacked and self.record is not None:
            self.unpacked = True
            self.record.handle_done()


class _PackedSubclass:
    """What autograd holds for a saved wrapper subclass: its inner tensors, packed each."""

    __slots__ = ("flat", "inner", "version", "sentinel", "origin")

    def __init__(self, flat: Flattened, inner: list, version: int, sentinel: torch.Tensor,
                 origin: SavedOrigin) -> None:
        self.flat = flat
        flat.inner = None  # the inner tensors live on only as `inner`'s packed entries
        self.inner = inner
        self.version = version
        self.sentinel = sentinel
        self.origin = origin

    def check_version(self) -> None:
        seen = self.sentinel._version
        if seen != self.version:
            raise version_error(self.sentinel.dtype, self.sentinel.device, self.flat.size,
                                self.origin, self.version, seen)


def _flat_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage's bytes as a 1-D uint8 tensor (zero-copy, keeps the storage alive)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class OffloadHooks:
    """pack / unpack for `torch.autograd.graph.saved_tensors_hooks`, plus bookkeeping."""

    def __init__(self, placement: Placement, tiers: dict[str, Tier], stats: Stats,
                 prefetcher: Prefetcher, params: ParamStorages, strict: bool) -> None:
        self.placement = placement
        self.tiers = tiers
        self.stats = stats
        self.prefetcher = prefetcher
        self.params = params
        self.strict = strict
        self.index = StorageIndex()
        # Records holding tier space (kept ones hold none), for release_all and live_records.
        self._live: weakref.WeakSet[_Record] = weakref.WeakSet()
        self._param_ids: set[int] = set()
        self._warned_full = False
        self._lock = threading.RLock()
        # Set by the step once its block exited with saved tensors alive: called at the end
        # of every backward that unpacked one of them (step.py NOTE [End of step]).
        self.on_backward_end = None
        self._queued_task = -1
        self.idle_since_s: float | None = None  # when the last record holding space died
        self.first_unpack_s: float | None = None  # where the backward starts (trace, bounce)
        self.on_first_unpack = None  # auto marks the device clock there (schedule/session.py)
        self._stored = 0  # storages decided so far: their position is the BouncePlan key
        # [key, nbytes, pack_s, unpack_s] per moved or bounce-kept storage (BouncePlan)
        self.timings: list[list] = []

    # ---------------------------------------------------------------- pack
    def pack(self, t: torch.Tensor) -> _Packed:
        stats = self.stats
        stats.packed_tensors += 1
        version = t._version
        origin = SavedOrigin(t)  # now: an in-place op would rewrite t.grad_fn
        if not movable(t):
            return self._pack_other(t, version, origin)
        return self._pack_plain(t, version, origin)

    def _pack_plain(self, t: torch.Tensor, version: int, origin: SavedOrigin) -> _Packed:
        stats = self.stats
        storage = t.untyped_storage()
        if self.params.is_param(t, storage):
            stats.param_tensors += 1
            if id(storage) not in self._param_ids:
                self._param_ids.add(id(storage))
                stats.param_bytes += storage.nbytes()
            return _Packed(None, None, t.detach(), version, None, origin)
        # A save inside no_offload() or during a backward must stay even if the same
        # storage was moved earlier in the step, so it neither reuses nor enters the index.
        in_backward = _graph_task_id() >= 0
        keep_here = in_backward or no_offload_active()
        # tensor_meta NOTE [Untracked aliases]: such a tensor dedups by its exact layout.
        layout = layout_key(t) if untracked_alias(t, storage) else None
        with self._lock:
            record = None if keep_here else self.index.lookup(storage, version, layout)
            if record is None:
                record = self._store(t, storage, in_backward, layout is not None)
                if not keep_here:
                    self.index.add(storage, version, record, layout)
            record.handles_left += 1
        if record.payload is None:
            return _Packed(record, None, t.detach(), version, None, origin)
        stats.offloaded_tensors += 1
        if record.meta is not None:  # a snapshot: its own layout
            return _Packed(record, record.meta, None, version, version_sentinel(t), origin)
        if record.payload.resident:
            # The payload *is* the tensor's storage (host tier on a CPU run): holding an
            # alias of it costs nothing and carries its version counter.
            return _Packed(record, None, t.detach(), version, None, origin)
        return _Packed(record, view_meta(t), None, version, version_sentinel(t), origin)

    def _pack_other(self, t: torch.Tensor, version: int, origin: SavedOrigin):
        """A tensor our byte round trip cannot hold as it is (subclasses NOTE [Subclasses])."""
        if is_weight(t):  # a DTensor / quantized weight: never moved, like any parameter
            self.stats.param_tensors += 1
            return _Packed(None, None, t.detach(), version, None, origin)
        flat = flatten(t)
        if flat is not None:
            inner = [self._pack_plain(x, x._version, SavedOrigin(x)) if movable(x)
                     else (self._pack_other(x, x._version, SavedOrigin(x))
                           if isinstance(x, torch.Tensor) else x) for x in flat.inner]
            return _PackedSubclass(flat, inner, version, flat.sentinel(t), origin)
        name = kind_name(t)
        if name not in TRACING_TYPES:
            self._count_unmoved(t, name)
        return _Packed(None, None, t.detach(), version, None, origin)

    def _count_unmoved(self, t: torch.Tensor, name: str) -> None:
        nbytes = unmoved_bytes(t)
        stats = self.stats
        stats.unmoved_tensors_by_type[name] = stats.unmoved_tensors_by_type.get(name, 0) + 1
        stats.unmoved_bytes_by_type[name] = stats.unmoved_bytes_by_type.get(name, 0) + nbytes
        stats.saved_bytes += nbytes
        stats.kept_bytes += nbytes

    def _store(self, t: torch.Tensor, storage: torch.UntypedStorage,
               in_backward: bool = False, untracked: bool = False) -> _Record:
        # An untracked alias is moved as a private copy of its own elements (tensor_meta
        # NOTE [Untracked aliases]): a tier must never read its storage after pack returns.
        nbytes = t.nbytes if untracked else storage.nbytes()
        key = (self._stored, nbytes)
        self._stored += 1
        info = TensorInfo(nbytes, t.device, t.dtype, no_offload=no_offload_active(), key=key,
                          in_backward=in_backward, storage=storage)
        placement = self.placement
        decision = placement.decide(info)
        bounce_kept = decision is placement.bounce_decision
        if bounce_kept:
            self.stats.bounce_kept_bytes += nbytes
        elif decision is placement.backward_decision:
            self.stats.backward_kept_bytes += nbytes
        payload, kind, meta = None, "keep", None
        if not decision.keep:
            if untracked:
                copy = snapshot(t)
                meta = view_meta(copy)
                flat = _flat_bytes(copy.untyped_storage())
            else:
                flat = _flat_bytes(storage)
            nbytes = flat.numel()
            for i, name in enumerate(decision.targets):
                payload = self.tiers[name].store(flat)
                if payload is not None:
                    kind = name
                    if i:
                        self.stats.spilled_bytes += nbytes
                    break
            if payload is None:
                self._all_full(nbytes, decision.targets)
        resident = payload is None or payload.resident
        record = _Record(self, payload, nbytes, kind, resident,
                         meta if payload is not None else None)
        if payload is not None or bounce_kept:
            # A storage the plan kept is timed too: otherwise the next plan, learning from
            # moved storages only, forgets it and moves it again (keep/move every other step).
            record.timing = [key, nbytes, time.perf_counter(), None]
            self.timings.append(record.timing)
        self._account(record)
        if payload is not None:
            if payload.prefetchable:
                self.prefetcher.register(payload)
            self._live.add(record)
        return record

    def _account(self, record: _Record) -> None:
        stats = self.stats
        stats.unique_storages += 1
        stats.saved_bytes += record.nbytes
        if record.kind == "keep":
            stats.kept_bytes += record.nbytes
        elif record.kind == "host":
            stats.host_bytes += record.nbytes
        else:
            stats.nvme_bytes += record.nbytes
        if record.resident:
            stats.add_resident(record.nbytes)

    def _all_full(self, nbytes: int, targets: tuple[str, ...]) -> None:
        usage = ", ".join(self.tiers[name].usage_text() for name in targets)
        if self.strict:
            raise TierFullError(
                f"offload: every tier is full ({usage}) and OFFLOAD_STRICT=1, so a "
                f"{format_bytes(nbytes)} activation cannot be placed (raise OFFLOAD_HOST_BYTES / "
                "OFFLOAD_NVME_BYTES, add a tier to OFFLOAD_TIERS, or unset OFFLOAD_STRICT to "
                "keep such tensors on the device)")
        self.stats.full_kept_bytes += nbytes
        if not self._warned_full:
            self._warned_full = True
            log.warning("offload: every tier is full (%s); a %s activation stays on the "
                        "device, and so will every later one that does not fit (smaller ones "
                        "still move while there is room; ctx.stats.full_kept_bytes counts "
                        "what stayed). Raise OFFLOAD_HOST_BYTES / OFFLOAD_NVME_BYTES or add a "
                        "tier; OFFLOAD_STRICT=1 makes this an error", usage,
                        format_bytes(nbytes))

    # ---------------------------------------------------------------- unpack
    def unpack(self, packed: _Packed) -> torch.Tensor:
        if type(packed) is _PackedSubclass:
            return self._unpack_subclass(packed)
        packed.check_version()  # NOTE [Version check]
        if self.first_unpack_s is None:
            self.first_unpack_s = time.perf_counter()
            # Read-ahead starts with the backward, not at the first moved payload's fetch:
            # when the end of the forward stayed on the device (the don't-bounce plan,
            # auto's plan), the link would otherwise idle while backward works through it.
            self.prefetcher.start()
            if self.on_first_unpack is not None:
                self.on_first_unpack()
        if self.on_backward_end is not None:
            task = _graph_task_id()
            if task != self._queued_task and task >= 0:
                # Once per backward: step.py NOTE [End of step], point 2.
                self._queued_task = task
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)
        if packed.tensor is not None:
            timing = packed.record.timing if packed.record is not None else None
            if timing is not None and timing[3] is None:
                timing[3] = time.perf_counter()
            packed.mark_unpacked()
            return packed.tensor
        with self._lock:
            storage, offset = packed.record.load()
        out = rebuild(storage, offset, packed.meta)
        packed.mark_unpacked()
        return out

    def _unpack_subclass(self, packed: "_PackedSubclass") -> torch.Tensor:
        packed.check_version()  # the outer tensor's counter (NOTE [Subclasses])
        inner = [self.unpack(x) if isinstance(x, (_Packed, _PackedSubclass)) else x
                 for x in packed.inner]
        return packed.flat.rebuild(inner)

    def fetch(self, payload) -> torch.Tensor:
        for tier in self.tiers.values():
            tier.poll()
        if payload.prefetchable:
            return self.prefetcher.fetch(payload)
        return payload.fetch()

    def _backward_ended(self) -> None:
        callback = self.on_backward_end
        if callback is not None:
            callback()

    # ---------------------------------------------------------------- lifetime
    @property
    def live_records(self) -> int:
        return len(self._live)

    def _record_freed(self, record: _Record) -> None:
        # Under the lock: `__del__` runs on whichever thread drops the last reference
        # (autograd's device threads too), and `resident_bytes -=` is a read-modify-write
        # racing pack's `add_resident`.
        with self._lock:
            if record.resident:
                self.stats.resident_bytes -= record.nbytes
            if record.payload is None:
                return
            record.release()
            self._live.discard(record)
            if not self._live:
                # Only noted: the step ends at a defined point (step.py NOTE [End of step]).
                self.idle_since_s = time.perf_counter()

    def release_all(self) -> None:
        """Free every payload now (the context exits with an exception)."""
        with self._lock:
            for record in list(self._live):
                record.release()
            self.index.clear()
