"""`make_plan`: the search for the plan with the lowest predicted step.

`make_plan(profile, figures, params)` is a pure function: the same profile, figures and
settings give the same plan (tests rely on it). It minimises the predicted step time
(costs.py) subject to `kept bytes <= budget` and the tiers' capacities.

Per block type, each prefix of the recompute ranking (ranking.py) is one candidate; for
each, the storages that remain are kept or moved as costs.py decides. The candidate with
the lowest predicted step wins (ties: less recompute, the shorter prefix being tried first).
Several block types: coordinate descent, one type at a time, from both ends (NOTE [Two
starts]).

Measured, not only predicted: the plan also prices two whole-block strategies (trials.py
PURE: `offload`, every eligible storage moved, blocks as they are; `checkpoint`, every block
checkpointed whole, no per-op machinery, except the last blocks whose storages fit the
budget, which run as they are and keep them). Those predicted within TRIAL_MARGIN of the
plan become `Plan.trials`: the session runs each of them and the plan for a few steps,
alternating, and keeps whichever step was fastest (trials.py NOTE [Trials]); the cost model
is a model, and a whole-block strategy has beaten a mixed plan it was predicted to lose to
(docs/benchmarks.md). One that would keep more than the budget (the plan's own bytes,
where the plan cannot meet it either) is not tried, so the budget holds whichever wins:
with no tier that frees memory (host on a CPU is the same RAM) moving everything keeps it
all, and checkpointing whole blocks keeps their inputs.
"""
from __future__ import annotations

import bisect
import dataclasses
from collections import Counter

from ..util.sizes import format_bytes
from .constants import SLOW_READ_SHARE, TRIAL_MARGIN
from .costs import Evaluation, PlanParams, better, op_is_stored, predict, rates, reruns
from ..util.figures import Figures
from .plan import BlockPlan, OpRow, Plan
from .profile import ItemRecord, Profile
from .ranking import TypeInfo, candidates, type_infos
from .readonly import ReadOnlyDict

__all__ = ["make_plan"]

_ro = ReadOnlyDict


def make_plan(profile: Profile, figures: Figures, params: PlanParams,
              notes: tuple[str, ...] = ()) -> Plan:
    """Plan the next steps from one profiled step (module doc); `notes` are the caller's,
    said after the plan's own in `ctx.plan`."""
    items = sorted(profile.items, key=lambda it: (it.region, it.ordinal))
    infos = type_infos(profile, items)
    best = _search(profile, figures, params, infos, items)
    pred = best.prediction
    alternatives, kept, checkpoint_keeps, keep_bytes = _pure_predictions(
        profile, figures, params, infos, items)
    # A trial keeps no more than the budget (the plan's own bytes where it cannot meet it):
    # a strategy that would keep more is not run, even for one step (trials.py NOTE [Trials]).
    limit = max(params.budget_bytes, pred.kept_bytes)
    over = [name for name in alternatives if kept[name] > limit]
    trials = tuple(name for name, step_s in alternatives.items()
                   if pred.feasible and name not in over
                   and step_s <= (1 + TRIAL_MARGIN) * pred.step_s)
    own = []
    if over:
        own.append(f"not measured against the plan: {', '.join(over)}, which would keep "
                   f"{' and '.join(format_bytes(kept[n]) for n in over)} on the device, over "
                   "the budget (what no tier of OFFLOAD_TIERS frees stays: on a CPU, host "
                   "memory is the same RAM)")
    if not pred.feasible:
        own.append(f"the budget cannot be met: {format_bytes(pred.kept_bytes)} stay on the "
                   f"device ({_why_kept(profile, params)})")
    elif pred.fixed_bytes > params.budget_bytes:
        own.append(f"the budget cannot be met: {format_bytes(pred.fixed_bytes)} stay on the "
                   "device whatever the plan does (below OFFLOAD_MIN_BYTES, no_offload(), "
                   "saved during a backward (create_graph: a gradient penalty), or held by a "
                   "checkpoint's closure; a lower OFFLOAD_MIN_BYTES lets small tensors move)")
    changed = sorted({b.type_name for b in profile.blocks if b.inputs_changed})
    if changed:
        own.append(f"{', '.join(changed)}: an input is changed in place after the block runs, "
                   "so it runs as it is (a re-run would not see the input the block saw)")
    refused = sorted({b.type_name for b in profile.blocks if b.rerun_refused})
    if refused:
        own.append(f"{', '.join(refused)}: its backward reads a saved tensor twice (a custom "
                   "Function reading ctx.saved_tensors twice), or runs under vmap and the "
                   "block draws random numbers: torch's checkpoint refuses both, so it runs "
                   "as it is")
    learned = sorted({b.type_name for b in profile.blocks if b.learned_as_is})
    if learned:
        own.append(f"{', '.join(learned)}: a planned step found it must run as it is (its "
                   "re-run refused by torch's checkpoint, or a collective its profile did "
                   "not see; logged then)")
    collective = sorted({b.type_name for b in profile.blocks if b.collective})
    if collective:
        own.append(f"{', '.join(collective)}: calls a collective (torch.distributed), so it "
                   "runs as it is in every step: every rank must run it alike, and each rank "
                   "plans on its own")
    opaque = sorted({b.type_name for b in profile.blocks if b.opaque})
    if opaque:
        own.append(f"{', '.join(opaque)}: compiled with torch.compile, so run whole (as they "
                   "are, or checkpointed whole); per-op recompute cannot see inside compiled "
                   "code")
    plan = _assemble(profile, figures, params, infos, items, best, (*own, *notes))
    return dataclasses.replace(plan, alternatives=_ro(alternatives), trials=trials,
                               checkpoint_keeps=checkpoint_keeps,
                               checkpoint_keep_bytes=keep_bytes)


def _search(profile: Profile, figures: Figures, params: PlanParams, infos: list[TypeInfo],
            items: list[ItemRecord]) -> Evaluation:
    """NOTE [Two starts] Coordinate descent over block types, one type's prefix at a time,
    from each end: every block as it is, and every type re-running all its ranking allows.
    Types are not independent: they share the budget. Where storages no plan can move
    (below OFFLOAD_MIN_BYTES) exceed it, every movable storage must move, and only a
    re-run of their block frees them; when only all types' re-runs together bring them
    under the budget, no one type's change helps from "as they are", and a descent from
    there stops at a plan that moves everything (seen: a GRU model's two GRUs, two
    types). From the other end it starts within the budget and shortens
    each type's re-runs while that pays. The better of the two wins (a tie: the first)."""
    as_is = {info.type_key: 0 for info in infos}
    best = _descend(profile, figures, params, infos, items, as_is)
    every = {info.type_key: candidates(info)[-1] for info in infos}
    if len(infos) > 1 and every != as_is:   # (one type: the descent tried every candidate)
        result = _descend(profile, figures, params, infos, items, every)
        if better(result.prediction, best.prediction):
            best = result
    return best


def _descend(profile: Profile, figures: Figures, params: PlanParams, infos: list[TypeInfo],
             items: list[ItemRecord], choice: dict) -> Evaluation:
    """Coordinate descent from `choice` (type key -> ranking prefix length)."""
    best = predict(profile, figures, params, infos, choice, items)
    for _ in range(3):
        changed = False
        for info in infos:
            for k in candidates(info):
                if k == choice[info.type_key]:
                    continue
                trial = {**choice, info.type_key: k}
                result = predict(profile, figures, params, infos, trial, items)
                if better(result.prediction, best.prediction):
                    best, choice, changed = result, trial, True
        if not changed:
            break
    return best


def _pure_predictions(profile: Profile, figures: Figures, params: PlanParams,
                      infos: list[TypeInfo], items: list[ItemRecord]
                      ) -> tuple[dict, dict, frozenset, int]:
    """Predicted step and kept bytes of each PURE strategy, the blocks `checkpoint`
    keeps, and what they keep (in the micro-batch where they keep most).

    `offload`: the budget at 0, blocks as they are. `checkpoint`: every op of every block
    re-run without the per-op dispatch modes, less the re-run of the last blocks whose
    storages (as a plain forward saves them) fit the budget next to what stays anyway;
    those run as they are and keep their storages."""
    bare = PlanParams(0, params.tiers, params.capacity_bytes, params.device_type,
                      params.staging_bytes)
    moved = predict(profile, figures, bare, infos, {i.type_key: 0 for i in infos},
                    items).prediction
    out = {"offload": moved.step_s}
    kept = {"offload": moved.kept_bytes}
    keeps: frozenset = frozenset()
    keep_bytes = 0
    # A block that cannot be re-run rules out checkpointing every block (its trial would
    # raise autograd's in-place error in the user's step).
    if any(i.ranking for i in infos) and all(i.rerunnable for i in infos):
        full = predict(profile, figures, bare, infos,
                       {i.type_key: len(i.ranking) for i in infos}, items).prediction
        dispatch = 2 * (figures.dispatch_op_s or 0.0) * sum(
            len(i.ops) * len(i.instances) for i in infos)
        rerun = {index: sum(o.time_s for o in i.ops) for i in infos for index in i.instances}
        calls = Counter(index for i in infos for index in i.instances)   # one per micro-batch
        # What a block run as it is keeps (its small saves too), in the micro-batch where it
        # keeps most (profile.py NOTE [Micro-batches]: the budget holds for each).
        per_batch: Counter[tuple[int, int]] = Counter()
        for it in items:
            if it.block is not None and (it.eligible or it.small) and not it.unsaved \
                    and not it.rerun_input:   # (a block run as it is does not save those)
                per_batch[(it.block, it.segment)] += it.nbytes
                if it.fed_to is not None and it.eligible:
                    # The block before it re-runs, so this block's input is saved first here,
                    # and kept with it (placement.py NOTE [Saved again after its block]);
                    # counted twice when both run as they are: more, never less.
                    per_batch[(it.fed_to[0], it.segment)] += it.nbytes
        block_bytes: dict[int, int] = {}
        for (index, _), nbytes in per_batch.items():
            block_bytes[index] = max(block_bytes.get(index, 0), nbytes)
        room = params.budget_bytes - full.kept_bytes
        chosen = []
        for index in sorted(rerun, reverse=True):   # the last blocks: backward needs them first
            need = block_bytes.get(index, 0)
            if need > room:
                break
            room -= need
            chosen.append(index)
        keeps = frozenset(chosen)
        keep_bytes = sum(block_bytes.get(i, 0) for i in keeps)
        out["checkpoint"] = full.step_s - dispatch - sum(rerun[i] * calls[i] for i in keeps)
        kept["checkpoint"] = full.kept_bytes + keep_bytes
    return out, kept, keeps, keep_bytes


def _assemble(profile: Profile, figures: Figures, params: PlanParams, infos: list[TypeInfo],
              items: list[ItemRecord], best: Evaluation, notes: tuple[str, ...]) -> Plan:
    """The chosen evaluation as the plan's lookup tables."""
    pred, targets, recompute_sets, per_instance_s, kept_by_segment = best
    item_targets, op_targets, input_targets, item_bytes = {}, {}, {}, {}
    decided = []
    blocks, block_type, signatures = {}, {}, {}
    info_of = {}
    for info in infos:
        rset = recompute_sets[info.type_key]
        rank = {o: i for i, o in enumerate(info.ranking)}
        rows = []
        for op in info.ops:
            saved = info.saved.get(op.op_id, 0)
            if not rset:
                decision = "as is"
            elif op.op_id in rset:
                decision = "recompute"
            elif op.op_id in info.saved:
                decision = "store"
            else:
                decision = "re-run"
            rows.append(OpRow(op, saved, decision, rank.get(op.op_id)))
        blocks[info.type_key] = BlockPlan(
            info.type_key, info.name, tuple(info.instances), rset, tuple(rows),
            per_instance_s[info.type_key],
            _ro({op.op_id: i for i, op in enumerate(info.ops)}))
        for index in info.instances:
            block_type[index] = info.type_key
            info_of[index] = info
    for b in profile.blocks:   # every call the step made (micro-batches of other lengths)
        signatures.setdefault(b.index, set()).add(b.signature)
    signatures = {index: frozenset(seen) for index, seen in signatures.items()}
    op_outputs = []   # (position in decided, its op's key, micro-batch) of stored op outputs
    followers = []    # (item, its op's key): later saves of a stored op's output

    def join_op(key: tuple, target: str, segment: int) -> None:
        # A stored op output: one decision per op (its storages are packed together); a
        # tier wins over keep, memory-safe.
        if key not in op_targets or target != "keep":
            op_targets[key] = target
        op_outputs.append((len(decided) - 1, key, segment))

    for it in items:
        info = info_of.get(it.block) if it.block is not None else None
        if it.small or it.unsaved and not (
                it.eligible and op_is_stored(it.producer, info, recompute_sets)):
            continue   # no decision of the plan's (the prediction counts them)
        if it.rerun_input and not reruns(info, recompute_sets):
            continue   # saved only by a re-run's checkpoint (placement.py NOTE [Inputs ...])
        target = targets.get(it.key, "keep")
        recomputed = info is not None and it.producer in recompute_sets[info.type_key]
        # Its op re-runs, but it is saved again after its block: decided there (placement.py
        # NOTE [Saved again after its block]; a later block's input by `input_targets`).
        fed = recomputed and it.saved_again
        decided.append((it.block, it.producer, it.nbytes,
                        "recompute" if recomputed and not fed else target))
        if it.made_by is not None and it.eligible and op_is_stored(
                it.made_by[1], info_of.get(it.made_by[0]), recompute_sets):
            join_op(it.made_by, target, it.segment)   # unsaved_outputs.py NOTE [...] 5
            followers.append((it, it.made_by))
        if reruns(info, recompute_sets):
            if fed:
                if it.fed_to is not None and input_targets.get(it.fed_to, "keep") == "keep":
                    input_targets[it.fed_to] = target   # a tier wins over keep
            elif it.producer is not None and it.producer not in recompute_sets[info.type_key]:
                join_op((it.block, it.producer), target, it.segment)
            elif it.input_index is not None:
                input_targets[(it.block, it.input_index)] = target
            continue
        item_targets[it.key] = target
        item_bytes[it.key] = it.nbytes
        if it.input_index is not None:
            input_targets[(it.block, it.input_index)] = target
    # A storage the search kept whose op moves: it moves too (the prediction follows, so
    # `kept_bytes` is what stays, in the micro-batch that keeps most; test_auto's resident
    # check holds it to that).
    kept_by, moved_bytes = dict(kept_by_segment), dict(pred.moved_bytes)
    for pos, key, segment in op_outputs:
        op_target = op_targets[key]
        block, producer, nbytes, target = decided[pos]
        if target == "keep" and op_target != "keep":
            decided[pos] = (block, producer, nbytes, op_target)
            kept_by[segment] -= nbytes
            moved_bytes[op_target] = moved_bytes.get(op_target, 0) + nbytes
    kept_bytes = max(kept_by.values(), default=0)
    # A follower's storage is stored by its op first, so a planned step never asks about
    # that save (the hooks store a storage once): it gets the op's decision, and the later
    # saves of its region are asked one place earlier than the profile saw them (BART's
    # head after a post-norm block found no decision: moved, unpriced).
    skipped: dict[tuple, list[int]] = {}
    for it, key in followers:
        if it.input_index is not None:
            input_targets[(it.block, it.input_index)] = op_targets[key]
        if item_targets.pop(it.key, None) is not None:
            item_bytes.pop(it.key, None)
            skipped.setdefault(it.region, []).append(it.ordinal)
    item_targets, item_bytes = _renumbered(item_targets, skipped), _renumbered(item_bytes, skipped)
    pred = dataclasses.replace(pred, kept_bytes=kept_bytes, moved_bytes=_ro(moved_bytes))
    op_bytes: dict = {}   # plan.py NOTE [Op outputs of another size]
    for b in profile.blocks:
        for op in b.ops:
            key = (b.index, op.op_id)
            if key in op_targets:
                op_bytes[key] = max(op.out_bytes, op_bytes.get(key, 0))
    per_block: dict = {}
    largest = 0
    for block, _, nbytes, target in decided:
        if target not in ("keep", "recompute"):
            largest = max(largest, nbytes)
            if block is not None:
                per_block[block] = per_block.get(block, 0) + nbytes
    summary = {"forward_s": profile.forward_s, "backward_s": profile.backward_s,
               "saved_bytes": profile.saved_bytes,
               "items": sum(not (it.small or it.unsaved or it.rerun_input) for it in items),
               "blocks": len(profile.blocks)}
    return Plan(_ro(item_targets), _ro(op_targets), _ro(input_targets), _ro(blocks),
                _ro(block_type), pred, params, figures, _ro(summary), _ro(signatures),
                notes, tuple(decided),
                _readahead(profile, figures, params, per_block, largest, pred.recompute_s),
                item_bytes=_ro(item_bytes), op_bytes=_ro(op_bytes),
                visits=_ro(profile.visits), ran_as_is=profile.ran_as_is)


def _renumbered(table: dict, skipped: dict[tuple, list[int]]) -> dict:
    """`table`'s keys (region, ordinal) as a planned step asks them: one place earlier for
    each save of the region before it that the step does not ask about (`skipped`)."""
    if not skipped:
        return table
    gone = {region: sorted(ordinals) for region, ordinals in skipped.items()}
    out = {}
    for (region, ordinal), value in table.items():
        if region in gone and ordinal >= 0:
            ordinal -= bisect.bisect_left(gone[region], ordinal)
        out[(region, ordinal)] = value
    return out


def _readahead(profile: Profile, figures: Figures, params: PlanParams, per_block: dict,
               largest: int, recompute_s: float) -> int:
    """Read-ahead of one block's moved bytes, when the link is slow next to the backward.

    Backward wants a block's storages together at its start. Where reading them takes more
    than SLOW_READ_SHARE of a block's backward, a read-ahead shorter than one block's bytes
    cannot run the link ahead, and the step stalls. The bytes read ahead are part of the
    "one block's working set" on top of the budget. Reads that do not fit the staging arena
    land in fresh memory, whose page faults cost more than the stall they save on a CPU: at
    most the arena less one payload, and nothing on a fast link (docs/benchmarks.md has the
    measurements).
    """
    if not per_block or not params.tiers or not profile.blocks:
        return 0
    biggest = max(per_block.values())
    in_bps = rates(figures, params.tiers[0], params.device_type)[1]
    block_backward_s = (profile.backward_s + recompute_s) / len(profile.blocks)
    if biggest / in_bps <= SLOW_READ_SHARE * block_backward_s:
        return 0
    return max(0, min(biggest, params.staging_bytes - largest))


def _why_kept(profile: Profile, params: PlanParams) -> str:
    """Why an unmet budget is unmet: what keeps the bytes no recompute frees (a block's
    inputs, what is saved outside blocks) on the device."""
    why = []
    if not params.tiers:
        why.append("no tier of OFFLOAD_TIERS frees device memory here (on a CPU, host memory "
                   "is the same RAM): the blocks' inputs and what is saved outside blocks, "
                   "which recompute does not free, stay; add 'nvme' to move them")
    else:
        sizes = " / ".join(f"OFFLOAD_{t.upper()}_BYTES" for t in params.tiers)
        why.append(f"the tiers are full: raise {sizes}")
    if not profile.blocks:
        why.append("no block was found to recompute: pass model= or blocks=")
    return "; ".join(why)
