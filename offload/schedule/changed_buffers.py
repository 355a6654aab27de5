"""A block's re-run that refuses to save a buffer changed in place since its call.

buffers.py NOTE [Buffers in a re-run], rule 7. Plain autograd raises its in-place error in
backward for a tensor an op saved and something changed in place before the backward (a
`bn.running_var.mul_(2)` between forward and backward: BatchNorm saves its running
statistics, in train mode too). Under checkpoint the block's ops save nothing in the
forward, and the re-run saves what it reads then, at the version it has then: the check
autograd would make is gone (with saved-tensor hooks installed it makes none), and the
gradient silently mixes the call's values (rule 6) with the new ones.

Only a save tells: a buffer no op saved (a step counter; BatchNorm's `num_batches_tracked`,
bumped by a second call of a shared block) changes nothing backward reads, and plain
training raises nothing for it. So a re-run that reads a changed buffer runs with one more
saved-tensor hook pair on top of checkpoint's own: its pack raises autograd's error for a
save of a changed buffer or of a view of it (views share its version counter, so they
changed too) and hands every other tensor to checkpoint's pack; unpack is checkpoint's.
The error comes at the re-run, where plain autograd's comes at the op's backward a moment
later in the same backward; it differs only for an op whose output reaches no gradient
(plain autograd never unpacks its saves). A re-run that reads no changed buffer (every
re-run of plain training) runs without it.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..runtime.version_check import version_error

__all__ = ["Changed", "refusing_saves_of"]

_autograd = torch._C._autograd


class Changed:
    """A buffer changed in place since the call: what the re-run reads in its place, the
    version it had when the call returned, and how messages name it."""

    __slots__ = ("tensor", "then", "name")

    def __init__(self, tensor: torch.Tensor, then: int, name: str) -> None:
        self.tensor, self.then, self.name = tensor, then, name


@contextlib.contextmanager
def refusing_saves_of(changed: list[Changed]) -> Iterator[None]:
    """Run the body with a pack hook that raises for a save of `changed` (or a view of it) and
    hands every other save to the hooks on top now (checkpoint's re-run hooks)."""
    outer = _autograd._top_saved_tensors_default_hooks(False)
    if not changed or outer is None:   # no re-run under checkpoint: nothing saved to check
        yield
        return
    outer_pack, outer_unpack = outer
    # What the re-run reads in each changed buffer's place, and its base when it is a view
    # (views of one base share its version counter): a save of one of them, or of a view
    # of one. A tensor over the same memory with a counter of its own (another buffer
    # registered as `a.data`) is not the changed buffer: plain autograd does not raise.
    by_id = {id(t): c for c in changed for t in (c.tensor, c.tensor._base) if t is not None}

    def pack(x):
        found = by_id.get(id(x))
        if found is None and x._base is not None:
            found = by_id.get(id(x._base))
        if found is not None:
            raise _error(found)
        return outer_pack(x)

    _autograd._push_saved_tensors_default_hooks(pack, outer_unpack)
    try:
        yield
    finally:
        _autograd._pop_saved_tensors_default_hooks()


def _error(changed: Changed) -> RuntimeError:
    t = changed.tensor
    error = version_error(t.dtype, t.device, t.shape, None, changed.then, t._version,
                          t.layout, hint=False)
    return RuntimeError(
        f"{error} offload: it is {changed.name}, saved by an op of a block re-run in backward "
        f"(`recompute`, or `auto` recomputing its ops) and changed in place after the block's "
        f"forward: plain autograd raises this error in backward too. Change buffers after "
        f"the backward.")
