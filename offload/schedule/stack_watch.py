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
    then, and would never run a new one its way), or a detected container no longer where
    it was found in the model (`model.layers = nn.ModuleList(...)`, or a module above it
    replaced: `model.encoder = Encoder()`), whose new blocks would run as they are. The detected
    stacks, or the containers given as `blocks=`; a predicate's matches or modules given
    one by one are not watched (finding them again means walking the whole model). Per
    container and step: one tuple comparison, and a walk down its path from the model."""

    __slots__ = ("_stacks", "_model", "_paths")

    def __init__(self, stacks: Iterable[nn.Module], model: nn.Module | None = None) -> None:
        self._stacks = tuple((s, tuple(s._modules.values())) for s in stacks)
        self._model = model
        ids = {id(s) for s, _ in self._stacks}
        # (its path's names from the model, the container found there) of each detected one
        self._paths = tuple((tuple(path.split(".")), module)
                            for path, module in (model.named_modules() if model is not None
                                                 else ()) if id(module) in ids and path)

    def changed(self) -> bool:
        return any(tuple(stack._modules.values()) != members for stack, members in self._stacks) \
            or any(self._at(path) is not stack for path, stack in self._paths)

    def accept(self) -> None:
        """The containers as they are now are the ones to compare with."""
        self._stacks = tuple((s, tuple(s._modules.values())) for s, _ in self._stacks)
        self._paths = tuple((path, self._at(path)) for path, _ in self._paths)

    def _at(self, path: tuple[str, ...]) -> nn.Module | None:
        module = self._model
        for name in path:
            module = module._modules.get(name) if module is not None else None
        return module
