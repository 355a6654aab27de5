"""What a copy or a pickle of an `offload.activations()` context is.

A copy or a pickle (a model holding its context, copied for an EMA or saved with
torch.save) is a new context of the same class, settings, model and blocks, never entered:
steps, figures and plans are not copied (they hold stores, arenas and threads). Inside a
deepcopy of the model it is on the copied model, which is still being built when the
context is: its blocks are found, and its settings checked, at first use. A context
deep-copied on its own keeps its model (the one you train).
"""
from __future__ import annotations

import torch

from .config import Config

__all__ = ["CopiedAsNew"]


class CopiedAsNew:
    """The copy and pickle protocol of a context class. The class sets `config`, `_model`,
    `_blocks` and `_memo` (None, or a deep copy's memo until its first use) in
    `_fresh(config, model, blocks)`, which builds a context that was never entered."""

    config: Config
    _model: torch.nn.Module | None
    _blocks: object
    _memo: dict | None

    def _fresh(self, config: Config, model: torch.nn.Module | None, blocks) -> None:
        raise NotImplementedError

    def __reduce__(self):
        self._from_memo()
        return (_copied_context, (type(self), self.config), (self._model, self._blocks))

    def __deepcopy__(self, memo: dict):
        self._from_memo()   # a copy of a copy: of what the first copy stands for
        ctx = _copied_context(type(self), self.config)
        ctx.__setstate__((self._model, self._blocks))
        # `memo` holds each object being copied from before its attributes are: the model's
        # copy, if the model is copied in this deepcopy, is there now or, when the context
        # came first (`deepcopy((ctx, model))`), by the end: looked up again at first use.
        ctx._memo = memo
        ctx._from_memo()
        return ctx

    def _from_memo(self) -> None:
        """A deep copy's model and blocks: their copies where the deepcopy made them. The
        memo (which keeps the deepcopy's originals alive) is let go once the model's copy
        is found there."""
        memo = self._memo
        if memo is None:
            return
        if self._model is None or id(self._model) in memo:
            self._memo = None
        self._model = memo.get(id(self._model), self._model)
        if isinstance(self._blocks, list):
            self._blocks = [memo.get(id(b), b) for b in self._blocks]

    @property
    def model(self) -> torch.nn.Module | None:
        """The model given as `model=` (a deep copy's: the copied one, `__deepcopy__`)."""
        self._from_memo()
        return self._model

    @model.setter
    def model(self, model: torch.nn.Module | None) -> None:
        self._model = model

    def __setstate__(self, state: tuple) -> None:
        self.model, self._blocks = state


def _copied_context(cls: type, config: Config) -> CopiedAsNew:
    """A copy's context before `__setstate__` gives it its model (`__reduce__`). Pickles
    name it as `offload.context._copied_context` too (made before this module existed)."""
    ctx = cls.__new__(cls)
    ctx._fresh(config, None, None)
    return ctx
