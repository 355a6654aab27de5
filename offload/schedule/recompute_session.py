"""Policy `recompute`: every block (blocks.py) runs under non-reentrant
`torch.utils.checkpoint`; what the outer hooks see (block inputs, tensors outside blocks)
goes to OFFLOAD_TIERS like under `offload`. Buffers stay exact across the re-run
(buffers.py); under torch.compile blocks run as compiled (blocks.py NOTE [Wrapping], rule 3).
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves

from ..config import Config
from ..runtime.deep_graphs import nodes_made
from ..runtime.no_offload import no_offload_active
from ..runtime.placement import Placement
from .blocks import BlockWrappers, ours_innermost
from .recompute import checkpoint_block
from .session_base import Session, holds_cache, say_unrun_once

__all__ = ["RecomputeSession"]


class RecomputeSession(Session):
    def __init__(self, config: Config, blocks: list) -> None:
        super().__init__(config)
        self.blocks = blocks
        self._wrappers: BlockWrappers | None = None
        self._ran = 0
        # Blocks whose forward runs a reentrant checkpoint of its own (Hugging Face's
        # gradient checkpointing with use_reentrant=True): our wrapper comes before it, so
        # it is not seen at the call (blocks NOTE [Whose block]), and checkpointing it
        # again runs its body once more. Seen among the nodes a call made, looked at again
        # whenever a call makes another number of nodes than the one looked at (its
        # checkpoint switched on after a first step: gradient_checkpointing_enable(), or
        # only in train mode); run as it is from then on.
        self._own_checkpoint: set[int] = set()
        self._looked: dict[int, int] = {}   # block index -> nodes its looked-at call made

    def placement(self, round_trip) -> Placement:
        return Placement(self.config, round_trip, moves=True)

    def enter(self, view) -> None:
        pack = view.hooks.pack
        self._ran = 0

        def run(index, forward, args, kwargs):
            if not ours_innermost(pack) or no_offload_active():  # blocks NOTE [Whose block]
                return forward(*args, **kwargs)
            if holds_cache(args, kwargs, self.blocks) or index in self._own_checkpoint:
                return forward(*args, **kwargs)
            self._ran += 1
            first = nodes_made()
            out = checkpoint_block(forward, args, kwargs, block=self.blocks[index])
            made = nodes_made() - first
            if self._looked.get(index) != made:
                self._looked[index] = made
                if _made_a_reentrant_checkpoint(out, first):
                    self._own_checkpoint.add(index)
            return out

        self._wrappers = BlockWrappers(self.blocks, run)   # known before any is set
        self._wrappers.__enter__()

    def exit(self) -> None:
        if self._wrappers is not None:
            self._wrappers.__exit__(None, None, None)
            self._wrappers = None

    def step_done(self, report) -> None:
        if report.training and not self._ran:
            say_unrun_once(self.blocks, "recompute", "what the step saved went to "
                           "OFFLOAD_TIERS and nothing was recomputed")


def _made_a_reentrant_checkpoint(out, first: int, most: int = 10_000) -> bool:
    """Whether a node of the graph behind a block call's outputs, made by the call (its
    sequence number from `first`, what `nodes_made()` said before it, on), is a reentrant
    `torch.utils.checkpoint`'s (`CheckpointFunctionBackward`); at most `most` nodes looked
    at (all of them when this torch gives no sequence numbers)."""
    todo = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    seen: set[int] = set()
    while todo and len(seen) < most:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if first >= 0 and node._sequence_nr() < first:   # made before the call: not its
            continue
        if type(node).__name__ == "CheckpointFunctionBackward":
            return True
        todo.extend(fn for fn, _ in node.next_functions)
    return False
