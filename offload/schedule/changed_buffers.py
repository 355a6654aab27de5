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

__all__ = ["Changed", "BufferVersions", "refusing_saves_of", "changed_in_place_error"]

_autograd = torch._C._autograd


class Changed:
    """A buffer changed in place since the call: what the re-run reads in its place, the
    version it had when the call returned, and how messages name it."""

    __slots__ = ("tensor", "then", "name")

    def __init__(self, tensor: torch.Tensor, then: int, name: str) -> None:
        self.tensor, self.then, self.name = tensor, then, name


class BufferVersions:
    """The version of each buffer of a call's guarded modules when the call returned,
    moved on by what each re-run bumps itself (put back through `.data`, those are no
    user's change; a user's change stays one: a second backward of a retained graph after
    the first raised raises too).

    Args:
        modules: The guarded modules.
        objects: Per module, its buffer slots at the call (name -> buffer).
        at_call: Per module, name -> the copy taken at the call (the buffer itself for
            one that requires grad, which is not copied nor looked at).
    """

    def __init__(self, modules: list, objects: list[dict], at_call: list[dict]) -> None:
        self._modules, self._objects, self._at_call = modules, objects, at_call
        self._noted = self.now()

    def now(self) -> list[dict]:
        return [{name: buf._version for name, buf in slots.items()
                 if buf is not None and buf is not at_call[name]}
                for slots, at_call in zip(self._objects, self._at_call)]

    def changed(self, reads) -> list[Changed]:
        """The buffers changed in place since, each with `reads(buffer, its copy)`: what
        the re-run reads in its place."""
        return [Changed(reads(buf, at_call[name]), noted[name],
                        f"the buffer `{name}` of a {type(module).__name__}")
                for module, slots, at_call, noted in zip(self._modules, self._objects,
                                                         self._at_call, self._noted)
                for name, buf in slots.items()
                if name in noted and buf._version != noted[name]]

    def move_on(self, start: list[dict]) -> None:
        """A re-run ran since `start` (`now()` before it): its bumps are its own."""
        self._noted = [{name: then + end[name] - began[name] for name, then in noted.items()}
                       for noted, began, end in zip(self._noted, start, self.now())]


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
    return changed_in_place_error(
        changed.tensor, changed.then, f"{changed.name}, saved by an op of",
        "plain autograd raises this error in backward too. Change buffers after the backward.")


def changed_in_place_error(t: torch.Tensor, then: int, what: str, why: str) -> RuntimeError:
    """Autograd's in-place error for `t` (at version `then` when the block's forward
    returned), with what offload's re-run makes of it: `what` it is, as "X, read by" /
    "X, saved by an op of" (a block re-run), and `why` it raises and what to do."""
    error = version_error(t.dtype, t.device, t.shape, None, then, t._version, t.layout,
                          hint=False)
    return RuntimeError(
        f"{error} offload: it is {what} a block re-run in backward (`recompute`, or `auto` "
        f"recomputing its ops), and changed in place after the block's forward: {why}")
