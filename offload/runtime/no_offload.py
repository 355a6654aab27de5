"""`offload.no_offload()`: a region whose saved tensors stay where they are.

The depth is per thread (saved-tensor hooks are per thread too); pack reads it once per
stored storage.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

__all__ = ["no_offload", "no_offload_active", "thread_depth"]


class _Depth(threading.local):
    depth = 0  # class default: no AttributeError on threads that never set it


_local = _Depth()
thread_depth = _local   # read by the core's packer as `thread_depth.depth` (hooks.py)


def no_offload_active() -> bool:
    return _local.depth > 0


@contextlib.contextmanager
def no_offload() -> Iterator[None]:
    """A region whose saved tensors stay where they are (counted as kept).

    Nests, and works as a decorator (`@offload.no_offload()`). Outside
    `offload.activations()` it does nothing.

    Example:
        >>> with offload.activations():
        ...     with offload.no_offload():
        ...         y = small_head(x)       # saved tensors of this region stay on the device
    """
    depth = _local.depth
    _local.depth = depth + 1
    try:
        yield
    finally:
        _local.depth = depth
