"""Our saved-tensor hooks on torch's hook stack, removable out of order.

torch keeps one stack of saved-tensor hooks per thread, and
`torch.autograd.graph.saved_tensors_hooks.__exit__` pops whatever is on top. Two offload
contexts exited out of order (A entered, B entered, A exited) would pop B's hooks and leave
A's, with A's closed tiers, installed for every later step. `remove` takes off our own
entry wherever it is: entries above it that belong to other offload contexts are taken off
and put back in the same order. An entry above ours that is not ours (a user's
`saved_tensors_hooks`, torch's `save_on_cpu`) cannot be moved under its owner's feet, so that
exit raises and changes nothing.
"""
from __future__ import annotations

import logging
import threading

import torch

from ..errors import OffloadError

__all__ = ["install", "remove"]

_autograd = torch._C._autograd
log = logging.getLogger("offload")


def install(hooks) -> int:
    """Push `hooks.pack` / `hooks.unpack_hook()`; returns the thread that must remove them."""
    _autograd._push_saved_tensors_default_hooks(hooks.pack, hooks.unpack_hook())
    return threading.get_ident()


def remove(hooks, thread: int, is_ours) -> None:
    """Pop `hooks`' entry from this thread's stack, wherever it is.

    Args:
        hooks: The object whose bound `pack` was pushed by `install`.
        thread: What `install` returned.
        is_ours: Tells whether an object owning a pack hook is an offload context's hooks.

    Raises:
        OffloadError: on another thread than `install`'s, or when hooks that are not
            offload's were pushed after ours and are still there (nothing is changed).
    """
    if threading.get_ident() != thread:
        raise OffloadError("offload.activations(): exited on another thread than the one that "
                           "entered it (saved-tensor hooks belong to a thread; enter and exit "
                           "each context on the same thread)")
    above = []
    try:
        while True:
            top = _autograd._top_saved_tensors_default_hooks(True)
            owner = getattr(top[0], "__self__", None) if top is not None else None
            if owner is hooks:
                _autograd._pop_saved_tensors_default_hooks()
                return
            if top is None:  # popped by someone else already: nothing of ours to remove
                log.warning("offload: this context's saved-tensor hooks were already removed "
                            "by someone else (torch's hook stack was popped by hand?)")
                return
            if not is_ours(owner):
                raise OffloadError(
                    "offload.activations(): exited while saved-tensor hooks entered after it "
                    f"({_describe(top)}) are still active; exit them first (contexts must be "
                    "exited in the reverse order they were entered, except that offload's own "
                    "may be exited in any order)")
            _autograd._pop_saved_tensors_default_hooks()
            above.append(top)
    finally:
        for pack, unpack in reversed(above):
            _autograd._push_saved_tensors_default_hooks(pack, unpack)


def _describe(top) -> str:
    pack = top[0]
    return getattr(pack, "__qualname__", None) or repr(pack)
