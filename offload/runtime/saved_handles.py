"""What autograd holds for each saved tensor (the saved-tensor hooks' packed objects).

* `Kept`: a saved tensor that stays where it is: a `detach()`ed alias (same storage, same
  version counter) plus what autograd's error message needs (NOTE [Version check] in
  version_check.py). The alias, not the tensor: an output saved by its own node would tie
  a cycle the garbage collector cannot see (node -> Kept -> tensor -> grad_fn -> node), and a
  graph dropped without backward would never be freed. Autograd rebuilds the autograd
  metadata of whatever unpack returns.
* `Moved`: a saved tensor whose storage went to a tier: its `Record` (records.py), the view
  layout to rebuild and a zero-byte sentinel sharing its version counter. The compiled
  core's `MovedSave` (csrc/moved_save.cpp) is the same, made by the core's packer (hooks.py
  NOTE [Move path in C]); its unpack calls records.`load` for what it does not do in C.
* `SmallSave` (the compiled core's, csrc/saved_handles.cpp) or, without the core, `SmallKept`:
  a saved tensor below OFFLOAD_MIN_BYTES; the core's `KeptSave` is the `Kept` of a tensor
  that stays, made in C (hooks.py NOTE [Handles in C]).
* `PackedSubclass`: a wrapper subclass, its inner tensors packed each (subclasses NOTE
  [Subclasses]).

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
"""
from __future__ import annotations

import time
from typing import Any

import torch

from .._ext import core_available, load_core
from ..util.never_compiled import never_compiled
from .records import Ledger, Record, handle_done, load
from .tensor_meta import ViewMeta, instance_attrs, rebuild, rebuild_as_resized, view_meta
from .version_check import NOBODY, SavedOrigin, next_sequence_nr as _next_sequence_nr, \
    node_at_unpack, version_error, version_sentinel

__all__ = ["Kept", "SmallKept", "Moved", "PackedSubclass", "held_tensor_error",
           "changed_since_pack"]

_UNSET: Any = object()


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
                         _KeptOrigin(tensor, node_name, output_nr), expected, tensor._version,
                         tensor.layout)


def changed_since_pack(save) -> bool:
    """Whether the tensor of a handle (any of this module's, or the core's SmallSave /
    KeptSave / MovedSave) was changed in place since its pack: its version counter moved
    (NOTE [Version check]). Reads only: nothing is raised, loaded or marked."""
    held = save.sentinel if hasattr(save, "sentinel") else save.tensor
    return held._version != save.version


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
        meta = view_meta(t) if record.meta is None else record.meta[:6]
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
        # Under the lock, as the load: autograd may unpack saves of one storage on two
        # threads, and each must find what the other handed out.
        with lock:
            if live is not None and live.nbytes() != self.record.nbytes:
                # Copied: a tensor over the live storage taken as a `.grad` would be the
                # user's tensor's memory (autograd copies its own, which the user holds).
                out = self._handed_out(live, lambda over: rebuild_as_resized(over, self),
                                       own=True)
            else:
                storage, offset = load(self.record)
                handed_stride = None if self.record.meta is None else \
                    self.record.meta.handed_stride   # tensor_meta NOTE [Snapshot strides]
                out = self._handed_out(storage,
                                       lambda over: rebuild(over, offset, self, handed_stride))
        if not self.unpacked:
            self.unpacked = True
            handle_done(self.record)
        return out

    def _handed_out(self, storage: torch.UntypedStorage, build, own: bool = False
                    ) -> torch.Tensor:
        """`build(storage)`: the tensor handed out for this layout while other saves of the
        storage are still to be unpacked, else a new one over `storage`, or over a copy of
        it when another layout was handed it or `own` asks for one (records.py NOTE [One
        tensor per layout]; csrc/moved_save.cpp `handed_out`)."""
        record = self.record
        handed = record.handed
        key = (self.dtype, self.size, self.stride, self.storage_offset, self.conj, self.neg,
               id(self.attrs))
        if handed and key in handed:
            return handed[key]
        out = build(storage.clone() if handed or own else storage)   # (its layout: class doc)
        if self.attrs is not None:
            out.__dict__ = self.attrs   # shared, not copied: tensor_meta NOTE [Saved attributes]
        if record.handles_left > (0 if self.unpacked else 1):   # others to come get this one
            if handed is None:
                handed = record.handed = {}
            handed[key] = out
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
    load_core().configure_moved(load=load, empty=torch.empty,
                                empty_strided=torch.empty_strided, neg_view=torch._neg_view,
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
