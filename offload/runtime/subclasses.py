"""Saved tensors of a tensor subclass: moved through their inner tensors, or counted.

NOTE [Subclasses] A traceable wrapper subclass (DTensor for tensor / sequence parallel,
float8 training tensors, TwoTensor, ...) holds no bytes itself: its data are the plain
tensors `__tensor_flatten__` names, and `__tensor_unflatten__(inner, ctx, size, stride)`
rebuilds it from them. That pair is the round trip torch.compile's AOTAutograd relies on, so
moving the inner tensors through the tiers (each one an ordinary saved tensor: parameter
check, dedup, placement, version check) and rebuilding at unpack gives back an equal tensor.
Entries that `__tensor_flatten__` names but are not tensors (DTensor's device mesh) are held
as they are, and so are inner tensors whose identity is part of a shape (`held_as_is`): a
jagged nested tensor's offsets name its ragged size (torch's nested int registry is keyed
by the tensor object), so a rebuilt copy would give the unpacked tensor another size and
the backward a shape mismatch; they are a few integers per batch. Inner tensors without
elements or bytes (its sequence-length caches) are held too: there is nothing to move.

The version check must follow the *outer* tensor: an in-place op on it bumps its counter in
the autograd layer, while the inner tensors are changed below autograd, where no counter
moves. The outer tensor's `detach()` shares its counter; with its inner tensors swapped for
empty ones it holds no bytes (`sentinel`), like the plain tensors' sentinel (NOTE [Version
check] in version_check.py).

Anything else (a subclass that cannot be flattened, sparse, quantized, nested tensors, other
devices) stays where it is and is counted by type in `Stats.unmoved_bytes_by_type`, with one
warning per type per process (`note_unmoved`).
"""
from __future__ import annotations

import functools
import logging
import threading
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["Flattened", "flatten", "held_as_is", "kind_name", "unmoved_bytes", "note_unmoved",
           "TRACING_TYPES", "forget_warnings"]

log = logging.getLogger("offload")

# Tensors that only exist while a compiler traces: no memory to count.
TRACING_TYPES = frozenset({"FakeTensor", "FunctionalTensor"})

_warned: set[str] = set()
_warned_lock = threading.Lock()


class Flattened:
    """A wrapper subclass split into its inner tensors (NOTE [Subclasses])."""

    __slots__ = ("cls", "names", "inner", "ctx", "size", "stride")

    def __init__(self, t: torch.Tensor, names: list[str], ctx: Any) -> None:
        self.cls = type(t)
        self.names = names
        self.inner = [getattr(t, name) for name in names]
        self.ctx = ctx
        self.size = t.size()
        self.stride = t.stride()

    def sentinel(self, t: torch.Tensor) -> torch.Tensor:
        """A byte-less alias sharing `t`'s version counter."""
        alias = t.detach()
        for name, value in zip(self.names, self.inner):
            if isinstance(value, torch.Tensor):
                setattr(alias, name, torch.empty(0, dtype=value.dtype, device=value.device))
        return alias

    def rebuild(self, inner: list) -> torch.Tensor:
        return self.cls.__tensor_unflatten__(dict(zip(self.names, inner)), self.ctx,
                                             self.size, self.stride)


def flatten(t: torch.Tensor) -> Flattened | None:
    """`t` as inner tensors, or None when it is not a traceable wrapper subclass."""
    if not is_traceable_wrapper_subclass(t):
        return None
    names, ctx = t.__tensor_flatten__()
    return Flattened(t, list(names), ctx)


@functools.cache
def _nested_int_registry():
    """torch's map from a jagged nested tensor's offsets (or lengths) to the nested int that
    sizes its ragged dimension; None where this torch has none. Looked up once: the map
    itself is torch's one object for the process."""
    try:
        from torch.nested._internal import nested_tensor
    except ImportError:
        return None
    return getattr(nested_tensor, "_tensor_symint_registry", None)


def held_as_is(inner: torch.Tensor) -> bool:
    """Whether an inner tensor of a flattened subclass is held as the very tensor (NOTE
    [Subclasses]): its identity sizes a nested tensor, or it has neither elements nor bytes."""
    if inner.numel() == 0 and type(inner) is torch.Tensor and inner.layout is torch.strided \
            and inner.untyped_storage().nbytes() == 0:
        return True
    registry = _nested_int_registry()
    return registry is not None and inner in registry


def kind_name(t: torch.Tensor) -> str:
    """How `t` is named in `unmoved_*_by_type`: its class, and for plain tensors what makes
    them unmovable (`Tensor(sparse_coo)`, `Tensor(nested)`, `Tensor(quantized)`, `Tensor(mps)`,
    `Tensor(cpu, no elements)`: an empty view still holds its storage; `Tensor(cpu, zeros)`:
    a zero tensor holds none)."""
    cls = type(t)
    if cls is not torch.Tensor and cls is not torch.nn.Parameter:
        return cls.__name__
    if t.is_nested:
        what = "nested"
    elif t.layout is torch.strided and t.numel() == 0:
        what = f"{t.device.type}, no elements"   # nothing to move; its storage stays with it
    elif t._is_zerotensor():
        what = f"{t.device.type}, zeros"   # forward-mode AD's: a size, no memory
    elif t.is_quantized:
        what = "quantized"
    elif t.layout is not torch.strided:
        what = str(t.layout).replace("torch.", "")
    else:
        what = t.device.type
    return f"{cls.__name__}({what})"


def unmoved_bytes(t: torch.Tensor) -> int:
    """What a tensor left in place holds (its storage; for sparse ones their parts)."""
    try:
        if t.is_meta or (type(t) is torch.Tensor and t._is_zerotensor()):
            return 0   # its storage's size is nominal: no memory behind it
        if t.layout is torch.strided and not t.is_nested:
            return t.untyped_storage().nbytes()
        if t.is_sparse:
            return unmoved_bytes(t._values()) + unmoved_bytes(t._indices())
    except (RuntimeError, NotImplementedError):  # no storage (a functional wrapper, meta)
        pass
    try:
        return t.numel() * t.element_size()
    except (RuntimeError, NotImplementedError):
        return 0


def forget_warnings() -> None:
    """Warn about every type again (offload.process.reset)."""
    with _warned_lock:
        _warned.clear()


# Kinds (kind_name) that have nothing to move when they hold no bytes: a zero tensor, and
# a tensor with no elements (an empty view of a storage with bytes still pins them: warned).
_NOTHING_TO_MOVE = (", zeros)", ", no elements)")


def note_unmoved(type_name: str, nbytes: int, count: int) -> None:
    """One warning per type per process: what stayed and why (none for what holds no
    memory: zero tensors, and tensors with no elements over no bytes)."""
    if nbytes == 0 and type_name.endswith(_NOTHING_TO_MOVE):
        return
    with _warned_lock:
        if type_name in _warned:
            return
        _warned.add(type_name)
    from ..util.sizes import format_bytes

    log.warning("offload: %d saved tensor(s) of type %s (%s) stayed where they are: the runtime "
                "moves plain strided CPU/CUDA tensors with elements and traceable wrapper "
                "subclasses (their inner tensors); see ctx.stats.unmoved_bytes_by_type",
                count, type_name,
                format_bytes(nbytes))
