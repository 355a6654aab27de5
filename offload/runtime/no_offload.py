"""`offload.no_offload()`: a region whose saved tensors stay where they are.

The depth is per thread (saved-tensor hooks are per thread too: a thread starts with its
own context, at depth 0); pack reads it once per stored storage, so it is a context
variable (a read costs half a `threading.local` attribute's).
"""
from __future__ import annotations

import contextlib
import contextvars

__all__ = ["no_offload", "no_offload_active"]

_depth: contextvars.ContextVar[int] = contextvars.ContextVar("offload_no_offload_depth",
                                                            default=0)


def no_offload_active() -> bool:
    return _depth.get() > 0


@contextlib.contextmanager
def no_offload():
    """A region whose saved tensors stay where they are (counted as kept).

    Nests, and works as a decorator. Outside `offload.activations()` it does nothing.

    Example:
        >>> with offload.activations():
        ...     with offload.no_offload():
        ...         y = small_head(x)       # saved tensors of this region stay on the device
    """
    depth = _depth.get()
    _depth.set(depth + 1)
    try:
        yield
    finally:
        _depth.set(depth)   # not a token: a token refuses a reset from another context
