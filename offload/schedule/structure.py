"""A count that moves whenever a module may have gained a module or a first buffer.

NOTE [Module structure] What a block's re-run must guard (buffers.py: its modules holding
buffer slots) and whether its call may be checkpointed at all (recompute.py: its lazy
modules) is found from the block's modules once and kept per block. A module that joins
later must be seen: QAT's `prepare_qat` inserting observers after a float warm-up, a
BatchNorm set in place of an `nn.Identity` between steps, a buffer first registered on a
module that had none. torch calls global registration hooks whenever a submodule is
assigned or added, and whenever a buffer is registered or assigned; ours moves the count
for every module assignment and for a buffer under a name new to its module (not for a
forward reassigning its own buffer at every call: a rotary cache, delayed scaling's
`amax`). What was found at one count is found again at another. Not seen: a module written
into `_modules` directly (torch.ao's `convert` does); buffers.py also finds its modules
again when one of them was freed.
"""
from __future__ import annotations

import weakref
from typing import Callable

from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                     register_module_module_registration_hook)

__all__ = ["count", "KeptModules"]

_count = 0
_hooks = None   # installed at the first count(): importing offload changes nothing


def count() -> int:
    """The count now: equal to one read before, no module or first buffer joined since
    (what a caller finds after its first read is found after the hooks were installed)."""
    global _hooks
    if _hooks is None:
        _hooks = (register_module_module_registration_hook(_module_joined),
                  register_module_buffer_registration_hook(_buffer_registered))
    return _count


def _module_joined(parent, name, module) -> None:
    global _count
    _count += 1


def _buffer_registered(module, name, tensor) -> None:
    global _count
    if name not in module._buffers:
        _count += 1


class KeptModules:
    """The modules under a block that `picks(module)` chooses, found once and kept per
    block (in util/per_model.py), held weakly: the registry's entry dies with the block only
    if nothing in it refers back to it. Found again when the count moved or one of them was
    freed."""

    __slots__ = ("refs", "count", "picks")

    def __init__(self, block, picks: Callable) -> None:
        self.picks = picks
        self.learn(block)

    def learn(self, block) -> None:
        self.count = count()
        self.refs = [weakref.ref(m) for m in block.modules() if self.picks(m)]

    def modules(self, block) -> list:
        if self.count != count():
            self.learn(block)
        modules = [ref() for ref in self.refs]
        if None in modules:
            self.learn(block)
            modules = [ref() for ref in self.refs]
        return modules
