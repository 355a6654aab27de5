"""What a saved tensor *is*, apart from its bytes: storage identity, view layout, parameters.

NOTE [Storage identity] Autograd often saves several views of one storage (q, k, v split
from one qkv output; `weight.t()`). We key by the storage's Python object: torch keeps that
object alive exactly as long as the storage itself, so a weak reference to it dies with the
storage, and its id cannot be reused while it is alive. The record is that weak reference
(records.py: `Record` is a `weakref.ref` of its storage), and a hit counts only when it
still names the very storage looked up. A plain `data_ptr()` key is unsafe: once an
offloaded storage is freed, the allocator hands the same address to the next tensor.

NOTE [Versions] Views share their base's version counter. Two saves of one storage at
different versions hold different data (an in-place op ran in between), so the dedup key is
(storage, version).

NOTE [Untracked aliases] Both notes above assume that every tensor over a storage shares one
version counter: a fresh tensor, its views (`_base`) and `detach()`. Some aliases do not:
`unsafe_split` / `unsafe_chunk` outputs (the CPU RNN cells split one gate buffer this way
and change the chunks in place one after the other), `.data`, `set_`. Each such alias has a
counter of its own, so two chunks of one buffer are both "version 1", and a write of the
whole storage started at the first chunk's pack reads the other chunks while they change.
A saved tensor whose *counter owner* (`_base`, else itself) does not span its storage from
offset 0 to the end is such an alias: `untracked_alias` says so. Its record then holds a
private copy of just its elements, made at pack in stream order (`snapshot`), and dedups
only with a save of exactly the same layout, through the same counter owner, at the same
version: such saves read the same elements under one counter, so a change of those
elements between the two would have bumped it. Aliases with counters of their own over
the same elements (two unsafe chunks of one buffer, each changed and then saved) do not
share a copy: each save comes back as it was saved. Which aliases share a counter torch
does not say, so the owner is the Python object: two `detach()`es of one view (which do
share one) are two owners and get a copy each (memory, not exactness).
A tensor whose owner spans its storage keeps the whole-storage record and the (storage,
version) key. What that cannot see: bytes changed through an alias autograd does not track
(`.data`, or an unsafe chunk that is never itself saved) between two saves of *different*
parts of one owner; without offload the second save sees the change, with offload it may
not. That is the class of change through `.data` the README documents; torch's own ops do
not do it (docs/design.md lists what was checked).

NOTE [Saved attributes] A tensor's Python attributes (`s.scale = 3.0`) live in its object's
`__dict__`. Plain autograd hands a saved input back as the very object it saved, so backward
sees them, as they are when it reads them. A tier that hands back a new tensor (every
`Moved`: nvme, host on a GPU, a snapshot) would lose them, and `getattr(s, "scale", 1.0)`
would silently compute another gradient. So a `Moved` holds the saved object's attribute
dict itself, not a copy, and its unpack gives the new tensor that same dict: an attribute
changed or added before backward is seen, as on the object autograd would have returned.
A tensor without attributes has no dict until something reads `__dict__`, which would make
one per saved tensor (time and memory on every save), so pack only looks (`instance_attrs`;
the core reads the slot in C) and holds nothing when there is none: an attribute first set
after the forward on a tensor that had none is not seen. Where autograd itself makes a new
tensor of what unpack returns (one that requires grad), the attributes are lost under any
saved-tensor hooks, torch's own included; that is not ours to change.
"""
from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch
from torch.nn.parameter import is_lazy

_UNSET: Any = object()

__all__ = ["ViewMeta", "SnapshotMeta", "storage_of", "view_meta", "snapshot_meta", "rebuild",
           "movable", "movable_strided", "untracked_alias", "snapshot", "snapshot_nbytes",
           "instance_attrs",
           "StorageIndex", "ParamStorages", "is_weight"]


class ViewMeta(NamedTuple):
    """Enough to rebuild a tensor over its storage's bytes."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int  # in elements of `dtype`, as torch reports it
    conj: bool
    neg: bool


class SnapshotMeta(NamedTuple):
    """A snapshot's layout (NOTE [Untracked aliases]): `ViewMeta`'s fields, of the copy, and
    the saved tensor's own stride when the copy's differs.

    NOTE [Snapshot strides] A snapshot holds its tensor's elements only: an alias with gaps
    between them (q, k and v of one qkv buffer, as a compiled graph saves them) is copied
    dense, in the same order of dimensions. Eager backward formulas take any strides, but
    a compiled backward checks the strides it was traced with (inductor's
    `assert_size_stride`) and failed on the dense copy. So unpack hands it back in a fresh
    tensor with the saved strides (`torch.empty_strided`: the span they reach, up to the
    whole buffer, for as long as backward holds it); the tiers still move only the elements.
    Not a tensor whose strides also read elements more than once (a stride of 0 next to
    one with gaps): no tensor can be written with those strides, so it comes back dense.
    """

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    conj: bool
    neg: bool
    handed_stride: tuple[int, ...] | None   # the saved tensor's, when the copy's differs


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """`t`'s storage, or None where torch has none to give: a sparse, mkldnn or jagged
    tensor (`untyped_storage()` raises "Cannot access storage of SparseTensorImpl"), or a
    wrapper subclass with no storage of its own. Such a tensor is never moved (README,
    *Limits*: counted in `unmoved_bytes_by_type`); what watches storages passes it over."""
    if t.layout is not torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def view_meta(t: torch.Tensor) -> ViewMeta:
    return ViewMeta(t.dtype, tuple(t.shape), t.stride(), t.storage_offset(),
                    t.is_conj(), t.is_neg())


def snapshot_meta(copy: torch.Tensor, saved: torch.Tensor) -> SnapshotMeta:
    """The layout of `copy`, `snapshot(saved)` (NOTE [Snapshot strides])."""
    stride = saved.stride()
    restore = copy.stride() != stride and not _reads_twice(saved.shape, stride)
    return SnapshotMeta(*view_meta(copy), stride if restore else None)


def _reads_twice(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a layout reads some element more than once (`empty_strided` of it could not
    be written: `copy_` refuses). Dimensions by stride, smallest first: each must step past
    everything the smaller ones reach."""
    reach = 0
    for step, n in sorted((s, n) for n, s in zip(size, stride) if n > 1):
        if step <= reach:
            return True
        reach += (n - 1) * step
    return False


def rebuild(storage: torch.UntypedStorage, byte_offset: int, meta: Any,
            handed_stride: tuple[int, ...] | None = None) -> torch.Tensor:
    """A tensor with `meta`'s layout over `storage`, whose bytes start at `byte_offset`.

    `meta`: a `ViewMeta`, or any object with its fields (saved_handles.py: a `Moved` holds them).
    `handed_stride`: a snapshot's saved strides (NOTE [Snapshot strides]).

    Zero-copy without `handed_stride`: the result shares `storage` and keeps it alive.
    """
    itemsize = meta.dtype.itemsize
    if byte_offset % itemsize:
        raise ValueError(f"byte offset {byte_offset} is not a multiple of {meta.dtype}'s size")
    out = torch.empty(0, dtype=meta.dtype, device=storage.device)
    out.set_(storage, byte_offset // itemsize + meta.storage_offset, meta.size, meta.stride)
    if handed_stride is not None:   # the bytes as they lie: the bits are set after
        out = torch.empty_strided(meta.size, handed_stride, dtype=meta.dtype,
                                  device=storage.device).copy_(out)
    return _with_bits(out, meta)


def _with_bits(out: torch.Tensor, meta: Any) -> torch.Tensor:
    """`out` with `meta`'s conjugate / negative bits: lazy flags on top of the same bytes."""
    if meta.conj:
        out = out.conj()
    if meta.neg:
        out = torch._neg_view(out)
    return out


def rebuild_as_resized(storage: torch.UntypedStorage, meta: Any) -> torch.Tensor:
    """`meta`'s layout over `storage` as it is now, which a resize changed since the save
    (saved_handles.py NOTE [A storage resized since its pack]). Not grown to fit, as `set_` with
    the layout would: torch's own bounds check raises autograd's error where it no longer
    fits."""
    out = torch.empty(0, dtype=meta.dtype, device=storage.device)
    out.set_(storage, 0, (0,), (1,))
    return _with_bits(out.as_strided(meta.size, meta.stride, meta.storage_offset), meta)


# object.__getstate__ (Python 3.11+) returns an object's attribute dict itself, or None when
# it has none or an empty one, without making one; `t.__dict__` would make one.
_object_state = getattr(object, "__getstate__", None)


def instance_attrs(t: torch.Tensor) -> dict | None:
    """`t`'s attribute dict when it has attributes, else None; never makes one (NOTE [Saved
    attributes]). Python 3.10 has no way to look without making one: None there (the
    core's handles read the slot in C on every version)."""
    if _object_state is None:
        return None
    state = _object_state(t)
    if type(state) is tuple:   # a class with __slots__: (its dict or None, its slots)
        state = state[0]
    return state


def movable_strided(t: torch.Tensor) -> bool:
    """`movable` for a plain strided tensor (the caller checked type and layout)."""
    return (t.is_cpu or t.is_cuda) and not t.is_quantized and not t.is_nested \
        and t.numel() > 0 and not t._is_zerotensor()


def movable(t: torch.Tensor) -> bool:
    """Whether our byte-level storage round trip can represent `t` exactly.

    Subclasses (FakeTensor, DTensor, ...), sparse, quantized and nested tensors, devices
    other than CPU/CUDA, and torch's zero tensors (forward-mode AD's missing tangents: a
    size and no memory, their storage has no data to read) stay where they are.
    """
    return (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) \
        and t.layout is torch.strided and not t.is_quantized and not t.is_nested \
        and t.device.type in ("cpu", "cuda") and t.numel() > 0 and not t._is_zerotensor()


def untracked_alias(t: torch.Tensor, storage_nbytes: int, base: Any = _UNSET) -> bool:
    """Whether other tensors over `t`'s storage (of `storage_nbytes`) may have version
    counters of their own. `base`: `t._base`, when the caller has it.

    NOTE [Untracked aliases]: true when `t`'s counter owner (its `_base`, else `t`) does not
    span the storage exactly (an unsafe chunk, a `detach()` or `.data` of a part, a tensor
    `resize_`d down); an expanded or overlapping owner spans it when the elements it reads
    run from the storage's start to its end.
    """
    owner = _counter_owner(t, base)
    if owner.storage_offset() != 0:
        return True
    nbytes = owner.nbytes
    if nbytes < storage_nbytes:
        return True
    if nbytes == storage_nbytes and owner.is_contiguous():   # the common case, at once
        return False
    # An expanded or overlapping owner (a `.detach()` of an expanded view, `np.broadcast_to`,
    # strides set by `set_`) spans its storage if the elements it reads reach its end.
    return _reach_bytes(owner) != storage_nbytes


def _counter_owner(t: torch.Tensor, base: Any) -> torch.Tensor:
    """The tensor whose version counter `t` uses: its `_base` (`base`, when the caller
    has it), else itself."""
    owner = t._base if base is _UNSET else base
    return t if owner is None else owner


def _reach_bytes(t: torch.Tensor) -> int:
    """The bytes from `t`'s storage offset to the end of the last element it reads."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def snapshot_nbytes(t: torch.Tensor) -> int:
    """The bytes `snapshot(t)` holds."""
    return min(t.nbytes, _reach_bytes(t))


def snapshot(t: torch.Tensor) -> torch.Tensor:
    """A private copy of `t`'s elements, ordered after every op already issued on the
    current stream (NOTE [Untracked aliases]); no autograd history. With `t`'s strides
    where its elements are dense (a transpose stays one), else contiguous; a tensor that
    reads elements more than once (expanded, overlapping strides) is copied as the span it
    reads, with its strides kept, not its elements written out one by one (an
    `expand(n, n)` of a row would grow n-fold). The copy holds the bytes as they lie and
    carries `t`'s lazy conjugate / negative bits: `clone` would write them into the bytes,
    and backward would get a tensor whose `is_conj()` differs from the one saved."""
    t = t.detach()
    conj, neg = t.is_conj(), t.is_neg()
    if conj:
        t = t.conj()   # the same bytes, the bit off
    if neg:
        t = torch._neg_view(t)
    nbytes = snapshot_nbytes(t)
    if nbytes == t.nbytes:   # dense (strides kept), with gaps between elements, or empty
        copy = t.clone(memory_format=torch.preserve_format)
    else:
        span = t.as_strided((nbytes // t.element_size(),), (1,)).clone()
        copy = span.as_strided(t.shape, t.stride())
    if neg:
        copy = torch._neg_view(copy)
    return copy.conj() if conj else copy


class _CounterOwner:
    """The tensor whose version counter an untracked alias uses (its `_base`, else itself),
    as part of a dedup key: equal only to a key of that very tensor while it lives. Two
    unsafe chunks over the same elements have counters of their own, so both can be at
    "version 1" with different bytes (one changed in place, saved, then the other changed
    and saved): the same storage, version and layout alone would hand the second save the
    first one's copy. Held weakly: the key keeps no storage alive, and a dead owner's id
    reused by a new tensor does not match."""

    __slots__ = ("_ref", "_id")

    def __init__(self, owner: torch.Tensor) -> None:
        self._ref = weakref.ref(owner)
        self._id = id(owner)

    def __hash__(self) -> int:
        return self._id

    def __eq__(self, other: object) -> bool:
        if type(other) is not _CounterOwner:
            return NotImplemented
        owner = self._ref()
        return owner is not None and owner is other._ref()


def layout_key(t: torch.Tensor, base: Any = _UNSET) -> tuple:
    """The elements `t` reads from its storage, how it reads them (its lazy conjugate /
    negative bits: `x` and `x.conj()` of one untracked alias share the counter owner and
    the rest, and must not share a copy) and the owner of its version counter (the dedup
    key of an untracked alias). `base`: `t._base`, when the caller has it."""
    return (t.dtype, t.storage_offset(), tuple(t.shape), t.stride(), t.is_conj(), t.is_neg(),
            _CounterOwner(_counter_owner(t, base)))


class StorageIndex:
    """Storages already stored during this step → their record (latest version; untracked
    aliases per layout).

    One entry per storage: aliases autograd tracks share one version counter, which only
    grows, so a save never comes back to an older version of a storage; aliases with
    counters of their own dedup by layout (NOTE [Untracked aliases]). An entry holds the
    record weakly (a record whose saved tensors are all gone is not kept alive) and the
    record holds its storage weakly: a storage that died never matches again, even when its
    id is reused (NOTE [Storage identity]). Dead entries stay until the step ends: no
    callback per entry (a closure per stored storage, and more for the garbage collector).
    """

    __slots__ = ("_map",)

    def __init__(self) -> None:
        self._map: dict[Any, weakref.ref] = {}   # id(storage) or (id, layout) -> record

    def lookup(self, storage: torch.UntypedStorage, version: int,
               layout: tuple | None = None) -> Any | None:
        """The record of `storage` at `version` (and, for an untracked alias, `layout`)."""
        ref = self._map.get(id(storage) if layout is None else (id(storage), layout))
        if ref is None:
            return None
        record = ref()
        if record is None or record.version != version or record() is not storage:
            return None
        return record

    def add(self, storage: torch.UntypedStorage, version: int, record: Any,
            layout: tuple | None = None) -> None:
        """Index `record`: a weak reference to `storage` (records.Record) with a `version`
        slot."""
        record.version = version
        self._map[id(storage) if layout is None else (id(storage), layout)] = weakref.ref(record)

    def clear(self) -> None:
        self._map.clear()

    def __len__(self) -> int:
        return len(self._map)


class ParamStorages:
    """Storages of parameters and buffers: never moved (they live for the whole run).

    Filled from `model=`. Independently of it, parameters are recognised by what they are
    (`is_weight`): buffers are not (nothing marks them), so without `model=` they are
    treated like activations. No process-wide module hook fills it:
    one breaks torch.compile (dynamo asserts on the first compiled call inside the context)
    and makes every compile warn.
    """

    def __init__(self) -> None:
        self._ids: dict[int, weakref.ref] = {}

    @property
    def by_storage_id(self) -> dict[int, weakref.ref]:
        """id(storage) -> a weak reference to it (the core's packer looks ids up here)."""
        return self._ids

    def add_tensor(self, t: torch.Tensor) -> None:
        storage = storage_of(t)   # a sparse buffer (a graph's adjacency) has none: never moved
        if storage is not None:
            self._ids[id(storage)] = weakref.ref(storage)

    def add_module(self, module: torch.nn.Module, recurse: bool = True) -> None:
        # A lazy module's (LazyLinear's) parameters and buffers have no storage until its
        # first forward; once materialised, its parameters are recognised by what they
        # are (`is_weight`) and its buffers are found at the next context entry.
        for p in module.parameters(recurse=recurse):
            if not is_lazy(p):
                self.add_tensor(p)
        for b in module.buffers(recurse=recurse):
            if b is not None and not is_lazy(b):
                self.add_tensor(b)

    def is_param(self, t: torch.Tensor, storage: torch.UntypedStorage | None,
                 node: Any = _UNSET, base: Any = _UNSET) -> bool:
        """Whether `t` is a parameter / buffer of `model=`, or one by what it is (below;
        `node`, `base`: `t.grad_fn`, `t._base`, when the caller has them)."""
        if storage is not None and self._ids:
            ref = self._ids.get(id(storage))
            if ref is not None and ref() is storage:
                return True
        return is_weight(t, node, base)

    def clear(self) -> None:
        self._ids.clear()


def is_weight(t: torch.Tensor, node: Any = _UNSET, base: Any = _UNSET) -> bool:
    """A parameter by what it is, without `model=`: a leaf requiring grad, an `nn.Parameter`
    (frozen ones too: LoRA's base weights, FSDP2's unsharded parameters), or a view of one
    (`weight.t()`). `node`, `base`: `t.grad_fn`, `t._base`, when the caller has them."""
    if node is _UNSET:
        node = t.grad_fn
    if base is _UNSET:
        base = t._base
    if node is not None:  # an activation, or a view of a trainable weight
        return base is not None and base.is_leaf and base.requires_grad
    if t.requires_grad or isinstance(t, torch.nn.Parameter):
        return True
    return base is not None and (base.requires_grad or isinstance(base, torch.nn.Parameter))
