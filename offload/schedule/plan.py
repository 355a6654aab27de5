"""The plan: keep, host, nvme or recompute for every saved storage and block op.

A `Plan` is what search.py's `make_plan` decided from one profiled step (the same profile,
figures and settings give the same plan), as lookup tables for the steps that run it:
`SchedulePlacement` (placement.py) looks each storage up by where it was saved, the auto
session (auto_session.py) each block's per-op recompute. It is immutable once made (a
frozen dataclass over read-only dicts and tuples): one plan can be shared, logged and
printed from any thread while steps run. What changes as steps run, the trial steps
(trials.py NOTE [Trials]), the session keeps next to it (plan_cache.py); explain.py renders
both.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .costs import PlanParams, Prediction
from ..util.figures import Figures
from .profile import OpRecord
from .readonly import ReadOnlyDict

__all__ = ["Plan", "BlockPlan", "OpRow"]


@dataclass(frozen=True)
class OpRow:
    """One op of a block type, for explain.py."""

    op: OpRecord
    saved_bytes: int                 # bytes of saved storages it makes, per block
    decision: str                    # recompute, store (keep/host/nvme), or "re-run"
    rank: int | None = None          # position in the recompute ranking


@dataclass(frozen=True)
class BlockPlan:
    type_key: tuple
    type_name: str
    instances: tuple[int, ...]
    recompute: frozenset = frozenset()   # op ids re-run (per-op mode); empty: plain
    rows: tuple[OpRow, ...] = ()
    recompute_s: float = 0.0             # per instance, dispatch cost included
    # op id -> its position in the profiled op sequence (stored_ops.py Rule 5)
    positions: ReadOnlyDict = field(default_factory=ReadOnlyDict)

    @property
    def per_op(self) -> bool:
        return bool(self.recompute)


@dataclass(frozen=True)
class Plan:
    """Decisions for the next steps of one shape class (module doc)."""

    # Targets ("keep" or a tier): (region, ordinal) -> target for the storages of plain
    # blocks and outside blocks; (block index, op id) -> target for stored op outputs;
    # (block index, input index) -> target for block inputs.
    item_targets: ReadOnlyDict
    op_targets: ReadOnlyDict
    input_targets: ReadOnlyDict
    blocks: ReadOnlyDict         # type key -> BlockPlan
    block_type: ReadOnlyDict     # block index -> type key
    prediction: Prediction
    params: PlanParams
    figures: Figures
    profile_summary: ReadOnlyDict
    signatures: ReadOnlyDict     # block index -> the call signatures planned for (frozenset)
    notes: tuple[str, ...] = ()
    # (block index or None, producing op id or None, bytes, target) per profiled storage
    # that the plan decided ("recompute" for the recomputed ones): for explain.py.
    decided: tuple[tuple, ...] = ()
    # Read-ahead the planned steps need (0: the configured one will do); search.py
    # `_readahead`.
    readahead_bytes: int = 0
    # Predicted step of each whole-block strategy (trials.py PURE), and those to measure
    # against the plan (NOTE [Trials]).
    alternatives: ReadOnlyDict = field(default_factory=ReadOnlyDict)
    trials: tuple[str, ...] = ()
    # Blocks `checkpoint` runs as they are, keeping what they save (within the budget), and
    # the most they keep in a micro-batch (what they saved in the profile): a trial step
    # whose kept blocks save more (dropout switched on, a branch taken) moves the rest.
    checkpoint_keeps: frozenset = frozenset()
    checkpoint_keep_bytes: int = 0
    # (region, ordinal) -> bytes profiled there: a storage of another size at that key is
    # not the one planned for (moved, memory-safe), e.g. before the step's shapes are known.
    item_bytes: ReadOnlyDict = field(default_factory=ReadOnlyDict, repr=False)
    # (block index, op id) -> the most bytes that op's output took in the profiled calls,
    # for the ops `op_targets` stores. NOTE [Op outputs of another size] An op whose output
    # is larger now, where the block's inputs are not (a mixture of experts' expert given
    # more tokens than in the profile), is recomputed rather than kept: the plan counted
    # the profiled bytes (kept 2.9x the budget, ctx.plan saying it held). Moving to a tier
    # frees memory whatever the size: those are stored.
    op_bytes: ReadOnlyDict = field(default_factory=ReadOnlyDict, repr=False)
    # Region -> how many times the profiled step entered it. NOTE [More calls than
    # profiled] A block called more times in a step than in the profiled one (a stack
    # repeated a data-dependent number of times, more micro-batches in one entry), and the
    # code after it (a head, a loss, an op between repeats), would look their decisions up
    # again: kept once more per visit, over the budget with `ctx.plan` saying it held (1.5x
    # for a stack run twice, 2x for two micro-batches). A visit beyond the profiled ones
    # moves what the plan keeps, as a stand-in block does (`SchedulePlacement.enter_region`:
    # `beyond_profile`), and such a block call runs checkpointed.
    visits: ReadOnlyDict = field(default_factory=ReadOnlyDict, repr=False)
    # Blocks the profiled step ran as is (they needed no gradient: frozen): one trained now
    # (progressive unfreezing) makes the class profile again, as other shapes do; run on a
    # stand-in's decisions it kept over the budget where no tier frees memory (2.6x).
    ran_as_is: frozenset = frozenset()

    def block_plan(self, index: int) -> BlockPlan | None:
        key = self.block_type.get(index)
        return None if key is None else self.blocks[key]

    def stand_in(self, index: int, type_key: tuple) -> int | None:
        """The profiled block whose decisions block `index` uses: itself when profiled; else
        the nearest profiled block of its type (a block the profiled step skipped, layer
        drop); None when no block of its type was profiled."""
        if index in self.signatures:
            return index
        same = [i for i, key in self.block_type.items()   # any op sequence of the type
                if key[:len(type_key)] == type_key]
        return min(same, key=lambda i: (abs(i - index), i)) if same else None
