"""`offload.no_offload()`: a region whose saved tensors stay where they are.

The depth is per thread (saved-tensor hooks are per thread too); pack reads it once per
stored storage.

NOTE [no_offload under torch.compile] A compiled graph saves its tensors when it returns
(AOTAutograd's forward), so a region inside one cannot tell its saves from the rest; and
dynamo traced the depth's change: it happened after the graph (the region kept nothing)
and its guard on the thread-local failed on the next call ("Guard failed on the same frame
it was created"). The depth changes in two functions dynamo does not trace: it ends the
graph at the region's entry, and the region and the rest of the function run eagerly (dynamo
resumes after a graph break only inside the context managers it knows), so what the region
saves is saved inside it; functions and modules called from there are compiled on their own.
Under `fullgraph=True` dynamo refuses the break, with the reason below.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from ..util.never_compiled import never_compiled

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
    depth = _deepen()
    try:
        yield
    finally:
        _restore(depth)


@never_compiled
def _deepen() -> int:
    depth = _local.depth
    _local.depth = depth + 1
    return depth


@never_compiled
def _restore(depth: int) -> None:
    _local.depth = depth


# NOTE [no_offload under torch.compile]: dynamo's mark of a `torch.compiler.disable`d
# function (a graph break at each call), set here as importing dynamo costs ~1 s.
for _f in (_deepen, _restore):
    _f._torchdynamo_disable = True
    _f._torchdynamo_disable_msg = (
        "offload.no_offload() inside compiled code ends the graph at its entry (what its "
        "region saves must be saved inside it); under fullgraph=True, put it around the "
        "compiled call instead")
del _f
