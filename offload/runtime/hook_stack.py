"""Our saved-tensor hooks on torch's hook stack, removable out of order.

torch keeps one stack of saved-tensor hooks per thread, and
`torch.autograd.graph.saved_tensors_hooks.__exit__` pops whatever is on top. Two offload
contexts exited out of order (A entered, B entered, A exited) would pop B's hooks and leave
A's, with A's closed tiers, installed for every later step. `remove` takes off our own
entry wherever it is: the entries above it are taken off and put back in the same order,
offload's and anyone else's alike (a user's `saved_tensors_hooks` left entered by an
`ExitStack`, torch's `save_on_cpu`, a checkpoint's). Every owner's exit pops the top entry
and never looks at its position, so each still pops its own.
"""
from __future__ import annotations

import logging
import threading

import torch

from ..errors import OffloadError

__all__ = ["install", "remove", "discard"]

_autograd = torch._C._autograd
log = logging.getLogger("offload")


def install(hooks) -> int:
    """Push `hooks.pack` / `hooks.unpack_hook()`; returns the thread that must remove them."""
    _autograd._push_saved_tensors_default_hooks(hooks.pack, hooks.unpack_hook())
    return threading.get_ident()


def remove(hooks, thread: int) -> None:
    """Pop `hooks`' entry from this thread's stack, wherever it is.

    Args:
        hooks: The object whose bound `pack` was pushed by `install`.
        thread: What `install` returned.

    Raises:
        OffloadError: on another thread than `install`'s (nothing is changed).
    """
    if threading.get_ident() != thread:
        raise OffloadError("offload.activations(): exited on another thread than the one that "
                           "entered it (saved-tensor hooks belong to a thread; enter and exit "
                           "each context on the same thread)")
    if not _pop(hooks):   # popped by someone else already: nothing of ours to remove
        log.warning("offload: this context's saved-tensor hooks were already removed by "
                    "someone else (torch's hook stack was popped by hand?)")


def discard(hooks) -> None:
    """Pop `hooks`' entry from this thread's stack if it is there (an enter interrupted
    around `install`)."""
    if hooks is not None:
        _pop(hooks)


def _pop(hooks) -> bool:
    """Take `hooks`' entry off this thread's stack wherever it is, the entries above it put
    back in their order; whether it was there."""
    above = []
    try:
        while (top := _autograd._top_saved_tensors_default_hooks(True)) is not None:
            _autograd._pop_saved_tensors_default_hooks()
            if getattr(top[0], "__self__", None) is hooks:
                return True
            above.append(top)
        return False
    finally:
        for pack, unpack in reversed(above):
            _autograd._push_saved_tensors_default_hooks(pack, unpack)
