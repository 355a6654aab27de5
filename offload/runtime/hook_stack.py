"""Our saved-tensor hooks on torch's hook stack, removable out of order.

torch keeps one stack of saved-tensor hooks per thread, and
`torch.autograd.graph.saved_tensors_hooks.__exit__` pops whatever is on top. Two offload
contexts exited out of order (A entered, B entered, A exited) would pop B's hooks and leave
A's, with A's closed tiers, installed for every later step. `remove` takes off our own
entry wherever it is: the entries above it are taken off and put back in the same order,
offload's and anyone else's alike (a user's `saved_tensors_hooks` left entered by an
`ExitStack`, torch's `save_on_cpu`, a checkpoint's). Every owner's exit pops the top entry
and never looks at its position, so each still pops its own.

A thread cannot reach another's stack. A context exited on another thread than it entered on
(a training-step generator resumed on a worker) retires its hooks there: they hold every
later save as it is, for no step, so that thread trains as without them; the first save,
block call or `install` on that thread that meets them on top takes them off (`top`; the
`retired` flag on the hooks is all that marks them): an outer context or a user's
`saved_tensors_hooks` entered before it then gets that thread's saves again. Else they
stayed for good: later plain steps on the entering thread packed into the ended step, or
raised once its tiers were closed. Not covered: a user's `saved_tensors_hooks` whose exit
comes first on that thread pops the retired entry, and its own stays installed (torch pops
the top, whoever's it is).
"""
from __future__ import annotations

import logging
import threading

import torch

from ..errors import OffloadError

__all__ = ["install", "remove", "discard", "top", "exited_on_another_thread"]

_autograd = torch._C._autograd
log = logging.getLogger("offload")


def install(hooks) -> int:
    """Push `hooks.pack` / `hooks.unpack_hook()` (retired entries on top taken off first);
    returns the thread that must remove them."""
    top()
    _autograd._push_saved_tensors_default_hooks(hooks.pack, hooks.unpack_hook())
    return threading.get_ident()


def remove(hooks, thread: int) -> bool:
    """Pop `hooks`' entry from this thread's stack, wherever it is; on another thread than
    `install`'s, retire them (module doc) and return False.

    Args:
        hooks: The object whose bound `pack` was pushed by `install`.
        thread: What `install` returned.
    """
    if threading.get_ident() != thread:
        hooks.retire()
        return False
    if not _pop(hooks):   # popped by someone else already: nothing of ours to remove
        log.warning("offload: this context's saved-tensor hooks were already removed by "
                    "someone else (torch's hook stack was popped by hand?)")
    return True


def top():
    """This thread's innermost saved-tensor hooks, retired entries taken off first."""
    entry = _autograd._top_saved_tensors_default_hooks(False)
    while entry is not None and getattr(getattr(entry[0], "__self__", None), "retired",
                                        False) is True:
        _autograd._pop_saved_tensors_default_hooks()
        entry = _autograd._top_saved_tensors_default_hooks(False)
    return entry


def exited_on_another_thread(entered: int) -> OffloadError:
    """What a context exited on another thread than `entered` raises (after `remove`)."""
    return OffloadError(
        f"offload.activations(): exited on thread {threading.get_ident()} "
        f"({threading.current_thread().name}), not on thread {entered}, which entered it. "
        "Saved-tensor hooks belong to a thread: enter and exit each context on the same one "
        "(a training step written as a generator must be resumed on the thread that started "
        "it). The step ended; the hooks left on the entering thread hold what it saves as "
        "it is until its next save or context entry takes them off")


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
