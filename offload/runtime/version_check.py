"""Autograd's "modified by an inplace operation" check, redone for tensors we hold as bytes.

NOTE [Version check] Once saved-tensor hooks are installed autograd no longer checks the
version counter of saved tensors (torch 2.13: the error silently disappears), so the hooks
redo it. A saved tensor and every alias autograd tracks (views of one base, `detach()`, the
base of a saved view, sibling views) share one *version counter*; an in-place op anywhere
on them bumps it. The check must see a bump made at any time before unpack, also after the
saved tensor itself died: the normal life of an intermediate inside a `forward` is "saved,
changed in place (ReLU(inplace=True)), dropped". A weak reference to the tensor loses the
counter with the tensor, and then the gradient would be computed from whatever bytes the
transfer had copied (the CPU write-behind reads the tensor's memory after pack returns;
a GPU D2H runs on a side stream while the compute stream goes on).

So every saved tensor we move holds a *sentinel*: a `detach()` alias (which shares the
counter) whose data is then swapped for an empty tensor (`.data =` keeps the alias's own
counter). It holds no bytes of the storage, costs ~0.6 us, and its `_version` follows every
in-place change, for as long as we hold it. Unpack compares it with the version seen at pack
and raises autograd's own error; no gradient is computed from bytes that may have changed
between pack and the end of their transfer.

A change through `.data` (or any alias made outside autograd: `set_`, numpy, DLPack) is
invisible to the counter, exactly as it is to autograd itself; see the README.

The message is autograd's (torch/csrc/autograd/saved_variable.cpp), so code and tests that
match on it keep working with offload on: for a tensor saved as an *output* of the node that
saved it (tanh, exp, relu save their result), autograd names that node; for an input, the
tensor's grad_fn when backward runs (the in-place op, or AsStrided for a view whose base
changed). The first is only known at pack time (an in-place op rewrites the tensor's
grad_fn), so pack records the grad_fn's name and whether it is the saving node: that node
was created last, so its sequence number is the one just before the thread's next. One
difference remains: an *input* changed in place and then dropped before backward is named
by its producer (autograd, which keeps the tensor alive, names the last in-place op); the
error is raised all the same.
"""
from __future__ import annotations

import re
import threading
import warnings
import weakref

import torch

__all__ = ["SavedOrigin", "version_sentinel", "sentinel_data", "version_error",
           "node_at_unpack", "NOBODY"]

# Thread-local next sequence number of autograd nodes (torch >= 2.1); without it every saved
# tensor is named like an input, which only changes the op named in the message.
next_sequence_nr = _next_sequence_nr = getattr(torch._C._autograd, "_get_sequence_nr", None)

_BACKWARD_SUFFIX = re.compile(r"Backward\d*$")  # autograd prints TanhBackward0 as Tanh
# autograd's own C++ nodes (not generated per op) print with their namespace
_NAMESPACED = frozenset({"CopySlices", "CopyBackwards", "AccumulateGrad"})

_empty_by_device: dict[torch.device, torch.Tensor] = {}


def sentinel_data(device: torch.device) -> torch.Tensor:
    """The zero-byte tensor on `device` that sentinels take as their data."""
    empty = _empty_by_device.get(device)
    if empty is None:
        empty = _empty_by_device.setdefault(
            device, torch.empty(0, dtype=torch.uint8, device=device))
    return empty


def version_sentinel(t: torch.Tensor) -> torch.Tensor:
    """A zero-byte tensor sharing `t`'s version counter (NOTE [Version check])."""
    sentinel = t.detach()               # shares storage and version counter
    sentinel.data = sentinel_data(t.device)   # drops the storage, keeps the counter
    return sentinel


class _Nobody:
    """What a SavedOrigin refers to when there is no input to name at unpack."""


NOBODY = _NOBODY = _Nobody()   # alive for the whole process: a weak reference to it never dies


def node_at_unpack(tensor, node_name: str | None, is_view: bool) -> str | None:
    """The grad_fn autograd would name (see the module doc). `tensor`: an input as it is
    now (None once it died), or `NOBODY` for an output (the saving node, `node_name`) or a
    leaf (none)."""
    if tensor is _NOBODY:
        return node_name
    if tensor is not None:
        node = tensor.grad_fn
        return type(node).__name__ if node is not None else None
    # An input that died after the change. A view's grad_fn is regenerated when its
    # base changed: as_strided, unless torch replays views. For a plain tensor autograd
    # would name the last in-place op, which nothing records: we name its producer.
    if is_view and not _view_replay_enabled():
        return "AsStridedBackward0"
    return node_name


class SavedOrigin(weakref.ref):
    """What autograd's message says about a saved tensor, captured at pack (one per save).

    The base class of what the hooks hand autograd (records.py). It *is* the weak reference
    to the saved tensor that an input's message needs at unpack (an output or a leaf refers
    to `_NOBODY`): one object per save, not two (every object a save keeps alive costs the
    garbage collector; docs/benchmarks.md *Hook cost*). Subclasses are made as
    `Cls(t, ...)`: `__new__` captures the origin, their `__init__` the rest.
    """

    __slots__ = ("output_nr", "node_name", "is_output", "is_view")

    def __new__(cls, t: torch.Tensor, *args, **kwargs) -> "SavedOrigin":
        node = t.grad_fn
        is_output = node is not None and _next_sequence_nr is not None \
            and node._sequence_nr() == _next_sequence_nr() - 1
        # An input's message names its grad_fn at unpack, when the tensor still lives.
        self = super().__new__(cls, _NOBODY if is_output or node is None else t)
        self.output_nr = t.output_nr
        self.node_name = type(node).__name__ if node is not None else None
        self.is_output = is_output
        self.is_view = t._base is not None
        return self

    def __init__(self, t: torch.Tensor, *args, **kwargs) -> None:
        pass   # weakref.ref's own __init__ would take the arguments for (ob, callback)

    def node_at_unpack(self) -> str | None:
        """The grad_fn autograd would name (see the module doc)."""
        return node_at_unpack(self(), self.node_name, self.is_view)


def _view_replay_enabled() -> bool:
    check = getattr(torch._C, "_is_view_replay_enabled", None)
    return bool(check()) if check is not None else False


class _SavesOne(torch.autograd.Function):
    """Saves its second input for backward: the tensor autograd's message names."""

    @staticmethod
    def forward(ctx, x, saved):
        ctx.save_for_backward(saved)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors
        return grad, None


_type_names: dict[tuple[torch.dtype, torch.device, torch.layout], str] = {}


def _type_name(dtype: torch.dtype, device: torch.device,
               layout: torch.layout = torch.strided) -> str:
    """How autograd's message names a tensor's type: `torch.FloatTensor` for the types that
    have a legacy name, `torch.sparse.FloatTensor` for a sparse one, `CPUBoolType`,
    `CUDABFloat16Type`, `CPUComplexFloatType` for the others. Read once per (dtype, device,
    layout) from autograd's own message, so it follows torch."""
    if layout in (torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc):
        layout = torch.sparse_csr   # one name for the compressed layouts, as autograd says
    key = (dtype, device, layout)
    name = _type_names.get(key)
    if name is not None:
        return name
    said: list[str] = []
    # An empty tensor of the layout (a compressed sparse one is 2-d at least), made here: the
    # warning filter (sparse CSR's "beta" notice) is not one to change on another thread.
    shape = (0,) if layout in (torch.strided, torch.sparse_coo) else (0, 0)
    marker = f" {list(shape)}]"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            saved = torch.empty(shape, dtype=dtype, device=device, layout=layout)
        except RuntimeError:
            saved = None

    def provoke() -> None:
        # On a thread of its own: no saved-tensor hooks (ours are this thread's), so
        # autograd checks the version itself and says the name.
        try:
            out = _SavesOne.apply(torch.zeros((), requires_grad=True), saved)
            torch.autograd.graph.increment_version(saved)
            out.backward()
        except RuntimeError as e:
            text = str(e)
            start, end = text.find("operation: ["), text.find(marker)
            if 0 <= start < end:
                said.append(text[start + len("operation: ["):end])

    if saved is not None:
        thread = threading.Thread(target=provoke, name="offload-type-name")
        thread.start()
        thread.join()
    # If autograd did not say (another torch's wording), its legacy name, or the dtype's.
    name = said[0] if said else saved.type() if saved is not None else str(dtype)
    _type_names[key] = name
    return name


def version_error(dtype: torch.dtype, device: torch.device, size, origin: SavedOrigin | None,
                  expected: int, seen: int, layout: torch.layout = torch.strided,
                  hint: bool = True) -> RuntimeError:
    """Autograd's error for a saved tensor changed in place, word for word (`origin` None:
    a leaf, for which autograd names no node; `hint`: with autograd's hint, which points at
    anomaly detection)."""
    type_name = _type_name(dtype, device, layout)
    text = (f"one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{type_name} {list(size)}]")
    name = None if origin is None else origin.node_at_unpack()
    if name is not None:
        name = f"torch::autograd::{name}" if name in _NAMESPACED else _BACKWARD_SUFFIX.sub("", name)
        text += f", which is output {origin.output_nr} of {name},"
    return RuntimeError(text + f" is at version {seen}; expected version {expected} instead."
                        + (_autograd_hint() if hint else ""))


_hint_cache: list[str] = []


def _autograd_hint() -> str:
    """The hint autograd appends to its version error (its wording changes across releases).

    Provoked once on a one-element graph in a fresh thread: saved-tensor hooks are
    thread-local, so ours cannot interfere there.
    """
    if not _hint_cache:
        found: list[str] = []

        def provoke() -> None:
            a = torch.ones(1, requires_grad=True)
            b = a * 1
            c = b.sin()
            b.add_(1)
            try:
                c.backward()
            except RuntimeError as exc:
                msg = str(exc)
                found.append(msg[msg.index(" Hint:"):] if " Hint:" in msg else "")

        worker = threading.Thread(target=provoke, name="offload-hint")
        worker.start()
        worker.join()
        _hint_cache.append(found[0] if found else "")
    return _hint_cache[0]
