"""Whether the containers a context found its blocks in changed since (blocks.py
`locate_blocks`): the context asks at each entry and finds the blocks again if so
(session.py `refreshed`)."""
from __future__ import annotations

from typing import Iterable

import torch.nn as nn

__all__ = ["StackWatch"]


class StackWatch:
    """Whether the containers the blocks were found in changed since: a block appended to
    `model.layers`, removed or replaced after the context was built (it found its blocks
    then, and would never run a new one its way), or a detected container itself replaced
    in its parent (`model.layers = nn.ModuleList(...)`: before, its new blocks ran as they
    are, and `recompute` said no block ran). The detected stacks, or the containers
    given as `blocks=`; a predicate's matches or modules given one by one are not watched
    (finding them again means walking the whole model). One tuple comparison per
    container and step, and a look into each detected container's parent."""

    __slots__ = ("_stacks", "_slots")

    def __init__(self, stacks: Iterable[nn.Module], model: nn.Module | None = None) -> None:
        self._stacks = tuple((s, tuple(s._modules.values())) for s in stacks)
        ids = {id(s) for s, _ in self._stacks}
        # (parent's submodule dict, name, the container held there) of each detected one
        self._slots = tuple((parent._modules, name, child)
                            for parent in (model.modules() if model is not None else ())
                            for name, child in parent._modules.items() if id(child) in ids)

    def changed(self) -> bool:
        return any(tuple(stack._modules.values()) != members for stack, members in self._stacks) \
            or any(modules.get(name) is not child for modules, name, child in self._slots)

    def accept(self) -> None:
        """The containers as they are now are the ones to compare with."""
        self._stacks = tuple((s, tuple(s._modules.values())) for s, _ in self._stacks)
        self._slots = tuple((modules, name, modules.get(name))
                            for modules, name, _ in self._slots)
