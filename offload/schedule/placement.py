"""`auto`'s decision point: keep, host or nvme for every storage the hooks are asked about.

The profile step (and a step whose shape class is not known yet: auto_session.py NOTE
[Shape classes]) records each storage: where in the step it was saved (region and ordinal:
the key the plan is looked up by), its size, and which op of which block made it. Planned
steps look each storage up in the plan by that key; a storage the plan does not know, or of
another size than the one planned for, moves (memory-safe).

The session (auto_session.py) says what the step runs through a `StepChoice` it owns and
hands down; the placement reads it and never calls back into the session.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Callable
from dataclasses import dataclass

import torch

from ..config import Config
from ..runtime.backward_marks import graph_task_id
from ..runtime.placement import Decision, Placement, TensorInfo
from ..runtime.tensor_meta import storage_of
from .plan import Plan
from .profile import BlockProfiler, BlockRecord, ItemRecord
from .stored_ops import output_bytes

__all__ = ["SchedulePlacement", "StepChoice"]

# Ordinals of the records of NOTE [Inputs only a re-run saves] (below those of unsaved
# outputs, unsaved_records): never a save's, so never looked up by key.
_RERUN_INPUT = -(10 ** 6)


@dataclass
class StepChoice:
    """What the current step runs, as the auto session decided it (it changes the fields
    as the step goes: the shape class is known at the first block call)."""

    plan: Plan | None = None     # None: warm-up or profile (every eligible storage moves)
    mode: str = "plan"           # the plan, or a whole-block strategy (trials.py PURE)
    recording: bool = True       # record every storage: a profile, or the class not known
    profiler: BlockProfiler | None = None   # inside blocks of a profile: who made a storage
    checkpointed: bool = False   # a block ran checkpointed whole in `checkpoint` mode


class SchedulePlacement(Placement):
    """`auto`'s decision point: a profile (and a step whose shape class is not known yet)
    records every storage it is asked about; planned steps look each storage up in the
    plan by where it was saved."""

    def __init__(self, config: Config, choice: StepChoice) -> None:
        super().__init__(config, None, moves=True)
        self.standing = None   # decided by where a storage was saved (NOTE [Standing decision])
        self.choice = choice
        self.region: tuple = ("after", -1)
        self.ordinal = 0
        self._forced: Decision | None = None
        self._inputs: dict[int, int] = {}      # storage id -> positional input (checkpoint)
        self._stand_in: int | None = None      # the planned block this one's lookups use
        self.visits: dict[tuple, int] = {}     # region -> entries so far this step
        self.beyond_profile = False            # this entry is one the profile did not make
        self._decisions: dict[tuple, Decision] = {}
        self.items: list[ItemRecord] = []
        self.unplanned = 0
        self._checkpoint_kept: dict[int, int] = {}   # micro-batch -> bytes `checkpoint` kept
        # While recording: the step's saved bytes so far (set by the session), and where the
        # current region started (saved bytes, items) to tell its small saves (note_small).
        self.saved_so_far: Callable[[], int] | None = None
        # The step's ledger, while recording (`follow`): what tells its micro-batches.
        self._ledger = None
        self._micro_batches = 0
        self._holding = False   # the step's saves held a record since the micro-batch began
        self._region_saved = 0
        self._region_items = 0
        self._region_small_inputs = 0
        self._region_segment = 0
        # While profiling: storage id -> (its weak reference, its record) of every storage
        # recorded (NOTE [Saved again after its block], NOTE [Inputs only a re-run saves]).
        self._recorded: dict[int, tuple[weakref.ref, ItemRecord]] = {}

    @contextlib.contextmanager
    def forced(self, decision: Decision):
        """The next pack uses `decision` (a stored op output, stored_ops.py)."""
        self._forced = decision
        try:
            yield
        finally:
            self._forced = None

    def follow(self, ledger) -> None:
        """Tell each save's micro-batch (`segment`) by the step's ledger: its live records."""
        self._ledger = ledger

    def segment(self) -> int:
        """The micro-batch a save belongs to (profile.py NOTE [Micro-batches]): a new one
        once every stored storage the step held was freed (its backward ran). A backward
        that left them alive (`autograd.grad(create_graph=True)` for a gradient penalty,
        `retain_graph`) did not end a micro-batch: its forward goes on. A save during a
        backward (create_graph, a checkpoint's re-run) is that micro-batch's."""
        if self._ledger is None:
            return 0
        if self._ledger.live_records:
            self._holding = True
        elif self._holding and graph_task_id() < 0:
            self._holding = False
            self._micro_batches += 1
        return self._micro_batches

    def enter_region(self, region: tuple, inputs: dict[int, int] | None = None,
                     stand_in: int | None = None, small_inputs: int = 0) -> None:
        """`small_inputs`: a block's input bytes below OFFLOAD_MIN_BYTES (while recording)."""
        self.note_small()
        # A visit beyond the profiled step's (plan.py NOTE [More calls than profiled]): its
        # "keep"s move, as a stand-in block's do.
        visits = self.visits[region] = self.visits.get(region, 0) + 1
        plan = self.choice.plan
        self.beyond_profile = plan is not None and visits > plan.visits.get(region, visits)
        if inputs and region[0] == "block" and self._recorded:
            self._note_fed(region[1], inputs)
        self._region_small_inputs = small_inputs
        self.region, self.ordinal = region, 0
        self._inputs = inputs or {}
        self._stand_in = stand_in

    def _note_fed(self, block: int, inputs: dict[int, int]) -> None:
        """NOTE [Saved again after its block] What an op of a block made and saved is often
        saved again after the block: the next block's input (a ResNet block's last ReLU;
        checkpoint holds its inputs, a block run as it is saves it in its first op), or a
        head's input (the last block's output). The step stores a storage once, at its first
        save, so the profile's record is the op's. Where the plan re-runs that op, the first
        save is the later one, and the storage stays (or moves) for it: the re-run freed
        none of it. Before, the plan counted it freed and the later save found no decision
        (kept over the budget on a CPU, moved unpriced on a GPU). So the record notes it
        (`ItemRecord.fed_to`: the later block call's input; `block_output`: one of the
        block's outputs, whose later saves outside blocks the hooks store without asking
        the placement); the search counts its bytes as kept or moved wherever its op
        re-runs, ranks the op by the bytes its re-run does free, and puts its decision in
        `input_targets` of the block it feeds. `inputs` (storage id -> input index) and
        the outputs are alive here, so a live weak reference with that id is that
        storage."""
        for storage_id, index in inputs.items():
            item = self._made_here(storage_id)
            if item is not None and item.fed_to is None:
                item.fed_to = (block, index)

    def note_inputs(self, block: int, tensors: list) -> None:
        """While profiling, at the end of a block call: its inputs (`block_inputs`, in
        checkpoint's order). NOTE [Inputs only a re-run saves] A block's input that no op
        of the step saved so far (a block that begins with `cat` or a scalar multiply, fed
        by an op that saves nothing: a U-Net's upsampling, T5's position bias) is not a
        storage of the profile. Where the plan re-runs the block, its checkpoint saves it,
        and that save found no decision (moved unpriced: on a CPU with tiers="host", kept
        over the budget). It is recorded here (`ItemRecord.rerun_input`), counted only where
        its block re-runs, and decided in `input_targets`. Saved later in the step, it is
        counted twice: more, never less. Below OFFLOAD_MIN_BYTES (the block's
        `small_inputs`) and leaves that require grad (kept as weights are) stay."""
        seen = set()
        for index, tensor in enumerate(tensors):
            storage = storage_of(tensor)
            if storage is None or id(storage) in seen or \
                    self._recorded_item(id(storage)) is not None:
                continue
            seen.add(id(storage))
            nbytes = storage.nbytes()
            if nbytes < self.config.min_bytes or (tensor.is_leaf and tensor.requires_grad):
                continue
            self.items.append(ItemRecord(("block", block), _RERUN_INPUT - index, nbytes, None,
                                         True, None, index, segment=self.segment(),
                                         rerun_input=True))

    def note_outputs(self, outputs: list) -> None:
        """While profiling: a block call's outputs (`flatten_call` leaves), NOTE [Saved
        again after its block]."""
        for leaf in outputs:
            if isinstance(leaf, torch.Tensor) and leaf.layout is torch.strided:
                item = self._made_here(id(leaf.untyped_storage()))
                if item is not None:
                    item.block_output = True

    def _made_here(self, storage_id: int) -> ItemRecord | None:
        """The record of a live storage an op of a block made, by its id."""
        item = self._recorded_item(storage_id)
        return item if item is not None and item.producer is not None else None

    def _recorded_item(self, storage_id: int) -> ItemRecord | None:
        entry = self._recorded.get(storage_id)
        if entry is None:
            return None
        storage = entry[0]()
        return entry[1] if storage is not None and id(storage) == storage_id else None

    def note_small(self) -> None:
        """While recording, one record of the bytes the current region saved below
        OFFLOAD_MIN_BYTES: what the step saved since the region began, less the storages
        the placement was asked about. They stay whatever a plan does, so the plan counts
        them against the budget (without them `ctx.plan` and the search undercounted what
        stays: a GPT's q / k / v views and LayerNorm statistics)."""
        if self.saved_so_far is None or not self.choice.recording:
            return
        now = self.saved_so_far()
        small = now - self._region_saved - sum(it.nbytes for it in
                                               self.items[self._region_items:])
        region = self.region
        profiler = self.choice.profiler
        if region[0] == "block" and profiler is not None and profiler.blocks and \
                profiler.blocks[-1].index == region[1]:
            profiler.blocks[-1].segment = self._region_segment
            # Made by the block's own ops (the profiler saw them saved): one record per op,
            # which a re-run of that op frees; the rest stays (inputs, tensors from outside).
            for op_id, nbytes in profiler.blocks[-1].small_saved.items():
                self.items.append(ItemRecord(region, -1, nbytes, None, False, op_id,
                                             small=True, segment=self._region_segment))
                small -= nbytes
        if small > 0 or self._region_small_inputs:
            self.items.append(ItemRecord(region, -1, max(small, 0), None, False, small=True,
                                         small_inputs=self._region_small_inputs,
                                         segment=self._region_segment))
        self._region_saved, self._region_items = now, len(self.items)
        self._region_segment = self.segment()

    def target(self, name: str, moved: bool = False) -> Decision:
        """Decision for a plan target: "keep" or a tier (then the tiers after it to spill).
        `moved`: a decision borrowed from another block (NOTE [Shape classes]): keep moves."""
        if moved and name == "keep":
            # The first tier that frees memory (host on a CPU is the same RAM: `_move`).
            plan = self.choice.plan
            tiers = plan.params.tiers if plan is not None else self.config.tiers
            if tiers:
                name = tiers[0]
        decision = self._decisions.get(name)
        if decision is None:
            if name == "keep":
                decision = Decision((), "plan: keep")
            else:
                tiers = self.config.tiers
                decision = Decision(tiers[tiers.index(name):] if name in tiers else tiers,
                                    f"plan: {name}")
            self._decisions[name] = decision
        return decision

    def op_decisions(self, plan: Plan, bp, stand_in: int, moved: bool) -> Callable:
        """`store(op_id, out)` for a per-op block call (recompute.run_block): the plan's
        target of each op output it stores, None for those it recomputes. `moved`: the
        decisions are borrowed from `stand_in` (a keep moves, `target`)."""
        targets, sizes, freeing, rset = plan.op_targets, plan.op_bytes, plan.params.tiers, \
            bp.recompute

        def store(op_id: tuple, out) -> Decision | None:
            if op_id in rset:
                return None
            name = targets.get((stand_in, op_id))
            if name is None or not moved and name not in freeing and \
                    output_bytes(out) > sizes.get((stand_in, op_id), 0):
                return None   # plan.py NOTE [Op outputs of another size]
            return self.target(name, moved)

        return store

    def decide(self, info: TensorInfo) -> Decision:
        if self._forced is not None:
            return self._forced
        ordinal = self.ordinal
        self.ordinal += 1
        base = super().decide(info)  # no_offload, small: kept whatever the plan says
        eligible = not base.keep
        choice = self.choice
        region = self.region
        if choice.recording:
            producer = input_index = made_by = None
            if info.storage is not None and choice.profiler is not None:
                made_by = choice.profiler.note_saved(info.storage)   # NOTE [Unsaved outputs]
                if region[0] == "block":
                    producer, input_index = choice.profiler.producer_of(info.storage)
            item = ItemRecord(region, ordinal, info.nbytes, info.key, eligible, producer,
                              input_index, segment=self.segment(), made_by=made_by)
            self.items.append(item)
            if info.storage is not None and choice.profiler is not None:   # the two NOTEs
                self._recorded[id(info.storage)] = (weakref.ref(info.storage), item)
        if not eligible:
            return base
        plan = choice.plan
        if plan is None:
            return base   # warm-up, profile: every eligible storage moves
        if choice.mode != "plan":
            # A whole-block strategy (trials.py NOTE [Trials]) moves every eligible storage,
            # but those of the blocks `checkpoint` runs as they are, up to what they kept in
            # the profile (Plan.checkpoint_keep_bytes): within the budget.
            if choice.mode == "checkpoint" and region[0] == "block" \
                    and region[1] in plan.checkpoint_keeps and not self.beyond_profile:
                segment = self.segment()
                kept = self._checkpoint_kept.get(segment, 0) + info.nbytes
                if kept <= plan.checkpoint_keep_bytes:
                    self._checkpoint_kept[segment] = kept
                    return self.target("keep")
            return self._move(plan, base)
        moved = False
        if region[0] == "block":
            block = self._stand_in
            moved = block != region[1]
            if block is None:
                name = None
            elif info.storage is not None and id(info.storage) in self._inputs:
                name = plan.input_targets.get((block, self._inputs[id(info.storage)]))
            else:
                name = self._item(plan, (("block", block), ordinal), info.nbytes)
        else:
            name = self._item(plan, (region, ordinal), info.nbytes)
        moved = moved or self.beyond_profile
        if name is None:
            self.unplanned += 1
            return self._move(plan, base)  # not in the plan (another step shape): memory-safe
        return self.target(name, moved)

    def _move(self, plan: Plan, base: Decision) -> Decision:
        """Where a storage the plan did not decide moves: to the first tier that frees
        memory, the plan's `params.tiers` (on a CPU, host is the same RAM and frees none,
        so `tiers="host,nvme"` moves to nvme); `base` when no tier frees any."""
        tiers = plan.params.tiers
        return self.target(tiers[0]) if tiers else base

    @staticmethod
    def _item(plan, key: tuple, nbytes: int) -> str | None:
        name = plan.item_targets.get(key)
        if name is None or plan.item_bytes.get(key, nbytes) != nbytes:
            return None   # another storage than the one planned for (NOTE [Shape classes])
        return name

    def unsaved_records(self, blocks: list[BlockRecord]) -> list[ItemRecord]:
        """Besides the step's records (`items`, timed by now): one per op of each profiled
        block call, and per side of OFFLOAD_MIN_BYTES, of the bytes it made that no save
        used (unsaved_outputs.py NOTE [Unsaved outputs]). Keyed apart from the saves
        (ordinals below -1, by the op's place in the block: a micro-batch's same op shares
        the key), timed as the op's first save in that call (pack with the op, unpack at
        the re-run)."""
        timing: dict[tuple, tuple] = {}
        for it in self.items:
            if it.producer is not None and not it.small and it.block is not None:
                timing.setdefault((it.block, it.segment, it.producer), (it.pack_s, it.unpack_s))
        out = []
        for b in blocks:
            place = {o.op_id: i for i, o in enumerate(b.ops)}
            for (op_id, small), nbytes in sorted(b.unsaved.items()):
                if nbytes <= 0 or op_id not in place:
                    continue
                pack_s, unpack_s = timing.get((b.index, b.segment, op_id), (None, None))
                out.append(ItemRecord(("block", b.index), -2 - 2 * place[op_id] - small,
                                      nbytes, None, not small, op_id, segment=b.segment,
                                      pack_s=pack_s, unpack_s=unpack_s, unsaved=True))
        return out
