"""The cost model: what one choice of recomputed ops per block type costs, and where the
storages that remain go.

Seconds added to the profiled compute time `F + B` (forward + backward):

* recompute: the block type's re-run ops (their profiled times) per instance, plus the
  dispatch-mode cost per op in both passes (`dispatch_op_s`, probe); the backward grows
  by the same amount, which also widens its transfer window.
* transfers hide behind compute up to a share `ETA` of it. CPU (nvme only): with `W` bytes
  moved, write `w = W / write_gbps`, read `r = W / read_gbps`, one disk for both:
  `stall = max(max(0, w - ETA F - staging / write_gbps) + max(0, r - ETA B'),
  w + r - ETA (F + B'))`. GPU: the same for the disk with the nvme bytes, and PCIe both
  ways with host + nvme bytes: `max(0, out - ETA F) + max(0, in - ETA B')`; the larger of
  the two stalls counts. Each transfer also costs its issue time on the host (probe).
* keep on device (what offload/runtime/round_trip.py decides for the offload policy, folded in here): a
  storage whose measured pack→unpack gap is shorter than `ROUND_TRIP_SAFETY` round trips cannot hide
  its transfer, alone or once the transfers queue behind each other (round_trip.py's queue
  simulation); moving it costs the whole round trip.

After recompute, the storages that remain are kept or moved, those with the longest
pack→unpack gap first (the most slack per byte), until the budget holds; then the others
that still hide at no predicted cost move too (the budget is a ceiling, not a target).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

from ..runtime.round_trip import LinkSpeed, TensorTiming, keep_on_device, pays_off
from ..util.constants import ROUND_TRIP_SAFETY
from .constants import ETA
from ..util.figures import Figures
from .profile import ItemRecord, Profile
from .ranking import TypeInfo
from .readonly import ReadOnlyDict

__all__ = ["PlanParams", "Prediction", "Evaluation", "rates", "predict", "better", "op_is_stored",
           "reruns"]


@dataclass(frozen=True)
class PlanParams:
    """What the plan needs from the settings (resolved to bytes)."""

    budget_bytes: int
    tiers: tuple[str, ...]            # tiers that free device memory, in spill order
    capacity_bytes: dict = field(default_factory=dict)   # tier -> bytes it may take
    device_type: str = "cpu"
    staging_bytes: int = 0

    @classmethod
    def of(cls, config, profile: Profile, capacity: dict) -> "PlanParams":
        """The params of `config` (a Config) for `profile`, with the tiers' `capacity`
        (tier -> bytes). On a CPU the host tier frees no device memory: left out."""
        budget = 0 if config.budget is None else \
            config.budget.resolve(profile.peak_saved_bytes)   # profile.py NOTE [Micro-batches]
        cpu = profile.device.type == "cpu"
        tiers = tuple(t for t in config.tiers if not (cpu and t == "host"))
        return cls(budget_bytes=budget, tiers=tiers,
                   capacity_bytes={t: capacity[t] for t in tiers if t in capacity},
                   device_type=profile.device.type, staging_bytes=config.staging_bytes)


@dataclass(frozen=True)
class Prediction:
    step_s: float = math.inf
    compute_s: float = 0.0
    recompute_s: float = 0.0
    stall_s: float = 0.0
    issue_s: float = 0.0
    kept_bytes: int = 0
    moved_bytes: ReadOnlyDict = field(default_factory=ReadOnlyDict)   # tier -> bytes
    recomputed_bytes: int = 0
    fixed_bytes: int = 0     # kept whatever the plan does (small, no_offload, closures)
    feasible: bool = False


class Evaluation(NamedTuple):
    """One choice of recomputed ops per block type, priced, with its decisions."""

    prediction: Prediction
    targets: dict            # item key -> tier, for the storages that move
    recompute_sets: dict     # type key -> frozenset of op ids re-run per op
    per_instance_s: dict     # type key -> recompute seconds per instance
    kept_by_segment: dict    # micro-batch -> bytes it keeps (`kept_bytes` is the largest)


def rates(figures: Figures, tier: str, device_type: str) -> tuple[float, float, float]:
    """(out bytes/s, in bytes/s, issue s per round trip) of moving through `tier`."""
    if tier == "nvme":
        out, back = figures.nvme_write_gbps, figures.nvme_read_gbps
        issue = 2 * (figures.nvme_issue_s or 0.0)
        if device_type == "cuda":
            out = min(out, figures.d2h_gbps or out)
            back = min(back, figures.h2d_gbps or back)
            issue += 2 * (figures.copy_issue_s or 0.0)
    else:
        out, back = figures.d2h_gbps, figures.h2d_gbps
        issue = 2 * (figures.copy_issue_s or 0.0)
    return out * 1e9, back * 1e9, issue


def _transfer_stall(moved: dict[str, int], fwd_s: float, bwd_s: float, figures: Figures,
                    params: PlanParams) -> float:
    disk = moved.get("nvme", 0)
    stall = 0.0
    if disk:
        w = disk / (figures.nvme_write_gbps * 1e9)
        r = disk / (figures.nvme_read_gbps * 1e9)
        slack = params.staging_bytes / (figures.nvme_write_gbps * 1e9)
        stall = max(max(0.0, w - ETA * fwd_s - slack) + max(0.0, r - ETA * bwd_s),
                    w + r - ETA * (fwd_s + bwd_s))
    if params.device_type == "cuda":
        link = moved.get("host", 0) + disk
        if link:
            out = link / (figures.d2h_gbps * 1e9)
            back = link / (figures.h2d_gbps * 1e9)
            stall = max(stall, max(0.0, out - ETA * fwd_s) + max(0.0, back - ETA * bwd_s))
    return stall


def _gap_s(item: ItemRecord) -> float:
    if item.pack_s is None:
        return 0.0
    return math.inf if item.unpack_s is None else item.unpack_s - item.pack_s


def _exposed_round_trips(remaining: list[ItemRecord], targets: dict, out_bps: float,
                    in_bps: float) -> float:
    """Round trips of moved storages kept on the device once the transfers queue behind each
    other (offload/runtime/round_trip.py simulates the queues): their whole round trip is exposed."""
    timed = [it for it in remaining if it.key in targets and it.pack_s is not None]
    if not timed or out_bps <= 0 or in_bps <= 0:
        return 0.0
    link = LinkSpeed(out_bps, in_bps)
    bouncing = keep_on_device((TensorTiming(it.key, it.nbytes, it.pack_s, it.unpack_s)
                               for it in timed), link, safety=ROUND_TRIP_SAFETY)
    return sum(it.nbytes / out_bps + it.nbytes / in_bps for it in timed if it.key in bouncing)


def _hideable(item: ItemRecord, out_bps: float, in_bps: float) -> bool:
    if item.pack_s is None or item.unpack_s is None:
        return item.pack_s is not None  # never unpacked: nothing to bring back in time
    # One tensor alone on the link: the runtime's own test (round_trip.pays_off).
    return pays_off(item.unpack_s - item.pack_s, item.nbytes / out_bps, item.nbytes / in_bps,
                    safety=ROUND_TRIP_SAFETY)


def _kept_by_segment(fixed: dict[int, int], kept: Iterable[ItemRecord]) -> dict[int, int]:
    """The bytes each micro-batch keeps on the device: its fixed bytes and `kept`'s of it
    (profile.py NOTE [Micro-batches]); the plan holds the largest to the budget."""
    per = Counter(fixed)
    for it in kept:
        per[it.segment] += it.nbytes
    return dict(per)


def reruns(info: TypeInfo | None, recompute_sets: dict) -> bool:
    """Whether a block of type `info` re-runs ops (checkpointed: per op, or whole)."""
    return info is not None and bool(recompute_sets[info.type_key])


def op_is_stored(op_id: tuple | None, info: TypeInfo | None, recompute_sets: dict) -> bool:
    """Whether an op of a block of type `info` has its outputs stored: the block re-runs ops
    per op, not this one, whose saves make it one the plan decides."""
    if info is None or op_id is None:
        return False
    rset = recompute_sets[info.type_key]
    return bool(rset) and op_id not in rset and op_id in info.saved


def predict(profile: Profile, figures: Figures, params: PlanParams, infos: list[TypeInfo],
            choice: dict, items: list[ItemRecord]) -> Evaluation:
    """Predicted cost of one choice of ranking prefix per block type (type key -> length),
    and its decisions (module doc)."""
    compute_s = profile.forward_s + profile.backward_s
    recompute_s = issue_s = 0.0
    recomputed_bytes = 0
    recompute_sets: dict[tuple, frozenset] = {}
    per_instance_s: dict[tuple, float] = {}
    type_of_block: dict[int, TypeInfo] = {}
    dispatch = figures.dispatch_op_s or 0.0
    for info in infos:
        k = choice[info.type_key]
        rset = frozenset(info.ranking[:k])
        recompute_sets[info.type_key] = rset
        if k:
            stored = set(info.saved) - rset
            rerun = sum(o.time_s for o in info.ops if o.op_id not in stored)
            per_instance_s[info.type_key] = rerun + 2 * dispatch * len(info.ops)
        else:
            per_instance_s[info.type_key] = 0.0
        for index in info.instances:
            type_of_block[index] = info
        recompute_s += per_instance_s[info.type_key] * len(info.instances)
    # What remains to keep or move, after recompute.
    remaining: list[ItemRecord] = []
    fixed: Counter[int] = Counter()   # micro-batch -> bytes kept whatever (NOTE [Micro-batches])
    for it in items:
        stays = 0
        info = type_of_block.get(it.block) if it.block is not None else None
        if it.rerun_input and not reruns(info, recompute_sets):
            continue   # saved only by a re-run's checkpoint (placement.py NOTE [Inputs ...])
        if it.unsaved:   # held only by a stored op (unsaved_outputs.py NOTE [Unsaved outputs])
            if not op_is_stored(it.producer, info, recompute_sets):
                continue
            if it.eligible:
                remaining.append(it)
            else:
                fixed[it.segment] += it.nbytes
            continue
        if it.small:
            # Saves below OFFLOAD_MIN_BYTES (profile.ItemRecord.small) stay, but in a block
            # that re-runs ops (checkpointed: only stored op outputs and its inputs outlive
            # the forward) an op's stay only when its outputs are stored; the rest of a
            # block's (its inputs, tensors from outside) stay, and when it re-runs, at least
            # its small inputs (the checkpoint holds them). Fixed, as below: re-running ops
            # to free what the user let stay is not what a budget asks for, but a plan that
            # re-runs them anyway keeps less.
            rset = recompute_sets[info.type_key] if info is not None else frozenset()
            if not rset:
                stays += it.nbytes
            elif it.producer is not None:
                stored = it.producer in info.saved and it.producer not in rset
                stays += it.nbytes if stored else 0
            else:
                stays += max(it.nbytes, it.small_inputs)
            fixed[it.segment] += stays
            continue
        if reruns(info, recompute_sets):
            # (Saved again after its block: kept or moved for that save, placement.py NOTE
            # [Saved again after its block].)
            if it.producer in recompute_sets[info.type_key] and not it.saved_again:
                recomputed_bytes += it.nbytes
                continue
            if it.producer is None and it.input_index is None:
                fixed[it.segment] += it.nbytes   # held by checkpoint's closure, not our hooks
                continue
        if it.eligible:
            remaining.append(it)
        else:
            fixed[it.segment] += it.nbytes
    # Bytes no decision can free (small or no_offload tensors, tensors a checkpoint holds in
    # its closure) count against the budget, but a plan is not worse for them. The budget
    # holds for each micro-batch: its backward frees its saves before the next forward
    # (profile.py NOTE [Micro-batches]); one forward is one micro-batch.
    need = {m: f - max(params.budget_bytes, f) for m, f in fixed.items()}
    for it in remaining:
        need[it.segment] = need.get(it.segment, -params.budget_bytes) + it.nbytes
    bwd_s = profile.backward_s + recompute_s
    targets: dict[tuple, str] = {}
    moved: dict[str, int] = {t: 0 for t in params.tiers}
    exposed_s = 0.0
    if params.tiers:
        # What each tier holds per micro-batch: its capacity is for one micro-batch's
        # storages at a time (each backward frees its micro-batch's: NOTE [Micro-batches]).
        held: Counter[tuple[str, int]] = Counter()

        def tier_for(same: list[ItemRecord]) -> str | None:
            per: Counter[int] = Counter()   # micro-batch -> bytes (a block called twice in one)
            for x in same:
                per[x.segment] += x.nbytes
            for t in params.tiers:
                cap = params.capacity_bytes.get(t)
                if cap is None or all(held[(t, m)] + b <= cap for m, b in per.items()):
                    return t
            return None

        def hold(tier: str, same: list[ItemRecord], sign: int = 1) -> None:
            """Put `same` in `tier` (sign -1: take them out again)."""
            for x in same:
                held[(tier, x.segment)] += sign * x.nbytes
                moved[tier] += sign * x.nbytes

        def stall_s() -> float:
            return _transfer_stall(moved, profile.forward_s, bwd_s, figures, params)

        def queued_s() -> float:  # round trips that do not hide, alone or queued: whole trips
            return _exposed_round_trips(remaining, targets, out_bps, in_bps) if targets else 0.0

        out_bps, in_bps, _ = rates(figures, params.tiers[0], params.device_type)
        hide = [it for it in remaining if _hideable(it, out_bps, in_bps)]
        exposed = [it for it in remaining if not _hideable(it, out_bps, in_bps)]
        # Longest pack -> unpack gap first: the most slack per byte, and the queue of writes
        # does not pile up at the end of the forward, where backward needs things back first.
        hide.sort(key=lambda it: (-_gap_s(it), -it.nbytes, it.key))
        # Those that cannot hide last, the longest gaps (least exposed) first.
        exposed.sort(key=lambda it: (-((it.unpack_s or math.inf) - (it.pack_s or 0.0)), it.key))
        # One decision per storage key: each micro-batch's storage of that key takes it
        # (the plan is looked up by key), so a key moves with all its storages at once.
        twins: dict[tuple, list[ItemRecord]] = {}
        for it in remaining:
            twins.setdefault(it.key, []).append(it)
        for group in (hide, exposed):
            for it in group:
                same = twins[it.key]
                if it.key in targets or all(need[x.segment] <= 0 for x in same):
                    continue   # moved already, or its micro-batches are within the budget
                tier = tier_for(same)
                if tier is None:
                    continue
                targets[it.key] = tier
                hold(tier, same)
                for x in same:
                    need[x.segment] -= x.nbytes
                issue_s += rates(figures, tier, params.device_type)[2] * len(same)
        exposed_s = queued_s()
        # The budget is a ceiling, not a target: storages that can still move at no
        # predicted cost move too (less device memory at the same predicted step; keeping
        # more resident than needed ran slower, docs/benchmarks.md).
        before_s, extra = stall_s() + exposed_s, []
        for it in hide:
            if it.key in targets:
                continue
            same = twins[it.key]
            tier = tier_for(same)
            if tier is None:
                continue
            hold(tier, same)
            if stall_s() > before_s + 1e-9:
                hold(tier, same, -1)
                break  # the window is full: later (shorter-gap) ones would not hide either
            targets[it.key] = tier
            extra.append((it.key, tier, same))
        if extra:
            extra_exposed = queued_s()
            if stall_s() + extra_exposed > before_s + 1e-9:  # they exposed others
                for key, tier, same in extra:
                    del targets[key]
                    hold(tier, same, -1)
            else:
                exposed_s = extra_exposed
                issue_s += sum(rates(figures, t, params.device_type)[2] * len(same)
                               for _, t, same in extra)
    stall = _transfer_stall(moved, profile.forward_s, bwd_s, figures, params) + exposed_s
    kept_by = _kept_by_segment(fixed, (it for it in remaining if it.key not in targets))
    prediction = Prediction(
        step_s=compute_s + recompute_s + stall + issue_s, compute_s=compute_s,
        recompute_s=recompute_s, stall_s=stall, issue_s=issue_s,
        kept_bytes=max(kept_by.values(), default=0),
        moved_bytes=ReadOnlyDict({t: b for t, b in moved.items() if b}),
        recomputed_bytes=recomputed_bytes, fixed_bytes=max(fixed.values(), default=0),
        feasible=all(n <= 0 for n in need.values()))
    return Evaluation(prediction, targets, recompute_sets, per_instance_s, kept_by)


def better(a: Prediction, b: Prediction) -> bool:
    """Whether `a` wins over `b`: it meets the budget where `b` does not, keeps less where
    neither does, else predicts a shorter step by more than rounding (a tie keeps `b`)."""
    if a.feasible != b.feasible:
        return a.feasible
    if not a.feasible:  # neither meets the budget: the one that keeps less
        return a.kept_bytes < b.kept_bytes
    return a.step_s < b.step_s - 1e-9 * max(1.0, b.step_s)
