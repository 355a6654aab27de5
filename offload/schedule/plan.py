"""The plan: keep, host, nvme or recompute for every saved storage and block op.

`make_plan(profile, figures, params)` is a pure function: the same profile, figures and
settings give the same plan (tests rely on it). It minimises the predicted step time
subject to `kept bytes <= budget` and the tiers' capacities.

Cost model (seconds added to the profiled compute time `F + B`, forward + backward):

* recompute: the block type's re-run ops (their profiled times) per instance, plus the
  dispatch-mode cost per op in both passes (`dispatch_op_s`, probe); the backward grows
  by the same amount, which also widens its transfer window.
* transfers hide behind compute up to a share `ETA` of it. CPU (nvme only): with `W` bytes
  moved, write `w = W / write_gbps`, read `r = W / read_gbps`, one disk for both:
  `stall = max(max(0, w - ETA F - staging / write_gbps) + max(0, r - ETA B'),
  w + r - ETA (F + B'))`. GPU: the same for the disk with the nvme bytes, and PCIe both
  ways with host + nvme bytes: `max(0, out - ETA F) + max(0, in - ETA B')`; the larger of
  the two stalls counts. Each transfer also costs its issue time on the host (probe).
* don't bounce (what offload/runtime/round_trip.py decides for the offload policy, folded in here): a
  storage whose measured pack→unpack gap is shorter than `SAFETY` round trips cannot hide
  its transfer, alone or once the transfers queue behind each other (bounce.py's queue
  simulation); moving it costs the whole round trip.

Search: per block type the ops that may be recomputed are ranked by recompute time per
byte freed, cheapest first (ops whose output cannot be stored, e.g. dropout masks written
in place, come first: any per-op recompute of the block re-runs them). Each prefix of that
ranking is one candidate (the empty one: the block runs as it is, "plain"); for each
candidate the storages that remain are kept or moved, those with the longest pack→unpack
gap first (the most slack per byte), until the budget holds; then the others that still
hide at no predicted cost move too (the budget is a ceiling). The candidate with the lowest predicted time wins (ties: less
recompute). Several block types: coordinate descent, one type at a time.

Measured, not only predicted: the plan also prices two whole-block strategies (`offload`:
every eligible storage moved, blocks as they are; `checkpoint`: every block checkpointed
whole, no per-op machinery, except the last blocks whose storages fit the budget, which run
as they are and keep them). Those predicted within `TRIAL_MARGIN` of the plan become
`Plan.trials`: the session runs each of them and the plan for a few steps, alternating,
and keeps whichever step was fastest (offload/schedule/session.py, NOTE [Trials]). The
cost model is a model: on the dev VM at a 300 MB/s disk it predicted the mixed plan at
7.8 s, which ran 8.5 s, where checkpointing every block ran 7.7 s. Both keep no more than
the budget, so it holds whichever wins.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from ..util.sizes import format_bytes
from .figures import Figures
from .profile import ItemRecord, OpRecord, Profile

__all__ = ["PlanParams", "Plan", "BlockPlan", "Prediction", "make_plan", "ETA", "SAFETY",
           "TRIAL_MARGIN", "TRIAL_ROUNDS", "TRIAL_WIN", "PURE"]

# The whole-block strategies a plan is measured against (module doc), as the session runs
# them.
PURE = {"offload": "every eligible storage moved, blocks as they are",
        "checkpoint": "every block checkpointed whole but the last ones the budget keeps, "
                      "the rest moved"}

log = logging.getLogger("offload")

ETA = 0.8      # share of compute that transfers may hide behind (DESIGN cost model)
SAFETY = 1.5   # a moved storage's gap must hold this many round trips (offload/runtime/round_trip.py)
# A pure strategy predicted within this share of the plan is measured against it (module
# doc): the predictions missed by 6-9 % on the dev VM (helper runs of issue 11, and the
# 300 MB/s run above), so 15 % leaves room for a miss on either side.
TRIAL_MARGIN = 0.15
TRIAL_ROUNDS = 2    # steps each candidate runs (session.py NOTE [Trials])
TRIAL_WIN = 0.02    # a pure strategy replaces the plan when this much faster


@dataclass(frozen=True)
class PlanParams:
    """What the plan needs from the settings (resolved to bytes)."""

    budget_bytes: int
    tiers: tuple[str, ...]            # tiers that free device memory, in spill order
    capacity_bytes: dict = field(default_factory=dict)   # tier -> bytes it may take
    device_type: str = "cpu"
    staging_bytes: int = 0


@dataclass
class Prediction:
    step_s: float = math.inf
    compute_s: float = 0.0
    recompute_s: float = 0.0
    stall_s: float = 0.0
    issue_s: float = 0.0
    kept_bytes: int = 0
    moved_bytes: dict = field(default_factory=dict)
    recomputed_bytes: int = 0
    fixed_bytes: int = 0     # kept whatever the plan does (small, no_offload, closures)
    feasible: bool = False


@dataclass
class OpRow:
    """One op of a block type, for explain()."""

    op: OpRecord
    saved_bytes: int                 # bytes of saved storages it makes, per block
    decision: str                    # recompute, store (keep/host/nvme), or "re-run"
    rank: int | None = None          # position in the recompute ranking


@dataclass
class BlockPlan:
    type_key: tuple
    type_name: str
    instances: list[int]
    recompute: frozenset = frozenset()   # op ids re-run (per-op mode); empty: plain
    rows: list[OpRow] = field(default_factory=list)
    recompute_s: float = 0.0             # per instance, dispatch cost included
    # op id -> its position in the profiled op sequence (recompute.py Rule 5)
    positions: dict = field(default_factory=dict)

    @property
    def per_op(self) -> bool:
        return bool(self.recompute)


@dataclass
class Plan:
    """Decisions for the next steps; `explain()` renders them (offload/schedule/explain.py)."""

    item_targets: dict            # (region, ordinal) -> "keep" | tier (plain blocks, outside)
    op_targets: dict              # (block index, op id) -> "keep" | tier (stored op outputs)
    input_targets: dict           # (block index, input index) -> "keep" | tier
    blocks: dict                  # type key -> BlockPlan
    block_type: dict              # block index -> type key
    prediction: Prediction
    params: PlanParams
    figures: Figures
    profile_summary: dict
    signatures: dict              # block index -> call signature it was planned for
    notes: list = field(default_factory=list)
    # (block index or None, producing op id or None, bytes, target) per profiled storage
    # that the plan decided ("recompute" for the recomputed ones): for explain().
    decided: list = field(default_factory=list)
    # Read-ahead the planned steps need (0: the configured one will do); see _readahead.
    readahead_bytes: int = 0
    # Predicted step of each PURE strategy, and those to measure against the plan.
    alternatives: dict = field(default_factory=dict)
    trials: tuple = ()
    # Blocks `checkpoint` runs as they are, keeping what they save (within the budget).
    checkpoint_keeps: frozenset = frozenset()
    # What the next steps run, filled by the session as the trials run (NOTE [Trials]):
    # `pending` the trial steps still to run, then `mode` ("plan" or a PURE name), chosen
    # from `measured` (step seconds per candidate).
    pending: list = field(default_factory=list)
    mode: str = "plan"
    measured: dict = field(default_factory=dict)
    # (region, ordinal) -> bytes profiled there: a storage of another size at that key is
    # not the one planned for (moved, memory-safe), e.g. before the step's shapes are known.
    item_bytes: dict = field(default_factory=dict)
    _stand_in: dict = field(default_factory=dict, repr=False)

    @property
    def settled(self) -> bool:
        """No trial step left: every further step runs `mode`."""
        return not self.pending

    @property
    def running(self) -> str:
        """What the next step runs: the next trial, or `mode`."""
        return self.pending[0] if self.pending else self.mode

    def trial_done(self, mode: str, step_s: float) -> bool:
        """Record a step of `mode` if it was the pending trial; after the last one choose
        `mode` (NOTE [Trials]). True when this step settled the choice."""
        if not self.pending or self.pending[0] != mode:
            return False
        self.pending.pop(0)
        self.measured.setdefault(mode, []).append(step_s)
        if self.pending:
            return False
        best = {m: min(t) for m, t in self.measured.items()}
        fastest = min(best, key=best.get)
        if fastest != "plan" and best[fastest] < (1 - TRIAL_WIN) * best["plan"]:
            self.mode = fastest
        return True

    def block_plan(self, index: int) -> BlockPlan | None:
        key = self.block_type.get(index)
        return None if key is None else self.blocks[key]

    def stand_in(self, index: int, type_key: tuple) -> int | None:
        """The profiled block whose decisions block `index` uses: itself when profiled; else
        the nearest profiled block of its type (a block the profiled step skipped, layer
        drop); None when no block of its type was profiled."""
        if index in self.signatures:
            return index
        if index not in self._stand_in:
            same = [i for i, key in self.block_type.items()   # any op sequence of the type
                    if key[:len(type_key)] == type_key]
            self._stand_in[index] = min(same, key=lambda i: (abs(i - index), i)) \
                if same else None
        return self._stand_in[index]

    def summary(self) -> str:
        p = self.prediction
        gib = 2 ** 30
        moved = ", ".join(f"{t} {b / gib:.2f} GiB" for t, b in p.moved_bytes.items() if b)
        per_op = [bp for bp in self.blocks.values() if bp.per_op]
        runs = "" if self.mode == "plan" else \
            f"; measured faster and run instead: {self.mode} ({PURE[self.mode]})"
        return (f"kept {p.kept_bytes / gib:.2f} GiB (budget "
                f"{self.params.budget_bytes / gib:.2f} GiB), {moved or 'nothing moved'}, "
                f"recomputed {p.recomputed_bytes / gib:.2f} GiB in {len(per_op)} of "
                f"{len(self.blocks)} block types; predicted step {p.step_s:.3g} s against "
                f"{p.compute_s:.3g} s of compute (recompute {p.recompute_s:.3g} s, stall "
                f"{p.stall_s:.3g} s){runs}")

    def explain(self) -> str:
        from .explain import render

        return render(self)

    def __str__(self) -> str:
        return self.explain()


# ---------------------------------------------------------------------------- model
def _rates(figures: Figures, tier: str, device_type: str) -> tuple[float, float, float]:
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


def _queued_bounces(remaining: list[ItemRecord], targets: dict, out_bps: float,
                    in_bps: float) -> float:
    """Round trips of moved storages that bounce once the transfers queue behind each
    other (offload/runtime/round_trip.py simulates the queues): their whole round trip is exposed."""
    from ..runtime.round_trip import LinkSpeed, TensorTiming, keep_on_device

    timed = [it for it in remaining if it.key in targets and it.pack_s is not None]
    if not timed or out_bps <= 0 or in_bps <= 0:
        return 0.0
    link = LinkSpeed(out_bps, in_bps)
    bouncing = keep_on_device((TensorTiming(it.key, it.nbytes, it.pack_s, it.unpack_s)
                               for it in timed), link, safety=SAFETY)
    return sum(it.nbytes / out_bps + it.nbytes / in_bps for it in timed if it.key in bouncing)


def _hideable(item: ItemRecord, out_bps: float, in_bps: float) -> bool:
    if item.pack_s is None or item.unpack_s is None:
        return item.pack_s is not None  # never unpacked: nothing to bring back in time
    roundtrip = item.nbytes / out_bps + item.nbytes / in_bps
    return item.unpack_s - item.pack_s >= SAFETY * roundtrip


@dataclass
class _TypeInfo:
    type_key: tuple
    name: str
    instances: list[int]
    ops: list[OpRecord]
    saved: dict                  # op id -> saved bytes per instance (max over instances)
    ranking: list[tuple]         # op ids, recompute order
    forced: int                  # how many of the ranking's first entries are forced


def _type_infos(profile: Profile, items: list[ItemRecord]) -> list[_TypeInfo]:
    by_block: dict[int, list[ItemRecord]] = {}
    for it in items:
        if it.block is not None:
            by_block.setdefault(it.block, []).append(it)
    infos = []
    for type_key, records in profile.block_types().items():
        ops = profile.op_table(type_key)
        saved: dict[tuple, int] = {}
        for b in records:
            per: dict[tuple, int] = {}
            for it in by_block.get(b.index, []):
                if it.producer is not None:
                    per[it.producer] = per.get(it.producer, 0) + it.nbytes
            for op_id, nbytes in per.items():
                saved[op_id] = max(saved.get(op_id, 0), nbytes)
        by_id = {o.op_id: o for o in ops}
        producers = [o for o in saved if o in by_id]
        forced = sorted((o for o in producers if by_id[o].not_storable), key=lambda o: o)
        free = [o for o in producers if not by_id[o].not_storable]
        # Cheapest recompute per byte first; ties by op id (deterministic).
        free.sort(key=lambda o: ((by_id[o].time_s + by_id[o].chain_s) / max(saved[o], 1), o))
        name = records[0].type_name
        if type_key != records[0].type_key:   # profile.py NOTE [Op identity]
            name += f" ({type_key[-1][0]} {type_key[-1][1] + 1})"
        infos.append(_TypeInfo(type_key, name, [b.index for b in records],
                               ops, saved, forced + free, len(forced)))
    return infos


def _candidates(info: _TypeInfo) -> list[int]:
    """Prefix lengths of the ranking worth trying: 0 (plain), then every per-op mode."""
    first = max(info.forced, 1)
    return [0] + list(range(first, len(info.ranking) + 1))


def _evaluate(profile: Profile, figures: Figures, params: PlanParams,
              infos: list[_TypeInfo], choice: dict, items: list[ItemRecord]):
    """Predicted cost of one choice of prefix per block type, and its decisions."""
    pred = Prediction(compute_s=profile.forward_s + profile.backward_s)
    recompute_sets: dict[tuple, frozenset] = {}
    per_instance_s: dict[tuple, float] = {}
    type_of_block: dict[int, _TypeInfo] = {}
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
        pred.recompute_s += per_instance_s[info.type_key] * len(info.instances)
    # What remains to keep or move, after recompute.
    remaining: list[ItemRecord] = []
    kept_fixed = 0
    for it in items:
        info = type_of_block.get(it.block) if it.block is not None else None
        if info is not None and recompute_sets[info.type_key]:
            if it.producer in recompute_sets[info.type_key]:
                pred.recomputed_bytes += it.nbytes
                continue
            if it.producer is None and it.input_index is None:
                kept_fixed += it.nbytes  # held by checkpoint's closure, not by our hooks
                continue
        if it.eligible:
            remaining.append(it)
        else:
            kept_fixed += it.nbytes
    # Bytes no decision can free (small or no_offload tensors, tensors a checkpoint holds in
    # its closure) count against the budget, but a plan is not worse for them.
    need = kept_fixed + sum(it.nbytes for it in remaining) - max(params.budget_bytes,
                                                                 kept_fixed)
    bwd_s = profile.backward_s + pred.recompute_s
    targets: dict[tuple, str] = {}
    moved: dict[str, int] = {t: 0 for t in params.tiers}
    exposed_s = 0.0
    if params.tiers:
        def tier_for(nbytes: int) -> str | None:
            for t in params.tiers:
                cap = params.capacity_bytes.get(t)
                if cap is None or moved[t] + nbytes <= cap:
                    return t
            return None

        def stall_s() -> float:
            return _transfer_stall(moved, profile.forward_s, bwd_s, figures, params)

        def bounced_s() -> float:  # what bounces, alone or behind the queue: whole trips
            return _queued_bounces(remaining, targets, out_bps, in_bps) if targets else 0.0

        out_bps, in_bps, _ = _rates(figures, params.tiers[0], params.device_type)
        hide = [it for it in remaining if _hideable(it, out_bps, in_bps)]
        bounce = [it for it in remaining if not _hideable(it, out_bps, in_bps)]
        # Longest pack -> unpack gap first: the most slack per byte, and the queue of writes
        # does not pile up at the end of the forward, where backward needs things back first.
        hide.sort(key=lambda it: (-_gap_s(it), -it.nbytes, it.key))
        # Bouncing ones last, the longest gaps (least exposed) first.
        bounce.sort(key=lambda it: (-((it.unpack_s or math.inf) - (it.pack_s or 0.0)), it.key))
        for group in (hide, bounce):
            for it in group:
                if need <= 0:
                    break
                tier = tier_for(it.nbytes)
                if tier is None:
                    continue
                targets[it.key] = tier
                moved[tier] += it.nbytes
                need -= it.nbytes
                pred.issue_s += _rates(figures, tier, params.device_type)[2]
        exposed_s = bounced_s()
        # The budget is a ceiling, not a target: storages that can still move at no
        # predicted cost move too (less device memory at the same predicted step; on the
        # dev VM keeping 30% resident where offloading all hid fully ran 5-8% slower).
        before_s, extra = stall_s() + exposed_s, []
        for it in hide:
            if it.key in targets:
                continue
            tier = tier_for(it.nbytes)
            if tier is None:
                continue
            moved[tier] += it.nbytes
            if stall_s() > before_s + 1e-9:
                moved[tier] -= it.nbytes
                break  # the window is full: later (shorter-gap) ones would not hide either
            targets[it.key] = tier
            extra.append((it, tier))
        if extra:
            extra_exposed = bounced_s()
            if stall_s() + extra_exposed > before_s + 1e-9:  # they made others bounce
                for it, tier in extra:
                    del targets[it.key]
                    moved[tier] -= it.nbytes
            else:
                exposed_s = extra_exposed
                pred.issue_s += sum(_rates(figures, t, params.device_type)[2] for _, t in extra)
    pred.feasible = need <= 0
    pred.fixed_bytes = kept_fixed
    pred.moved_bytes = {t: b for t, b in moved.items() if b}
    pred.kept_bytes = kept_fixed + sum(it.nbytes for it in remaining if it.key not in targets)
    pred.stall_s = _transfer_stall(moved, profile.forward_s, bwd_s, figures, params) + exposed_s
    pred.step_s = pred.compute_s + pred.recompute_s + pred.stall_s + pred.issue_s
    return pred, targets, recompute_sets, per_instance_s


def _better(a: Prediction, b: Prediction) -> bool:
    if a.feasible != b.feasible:
        return a.feasible
    if not a.feasible:  # neither meets the budget: the one that keeps less
        return a.kept_bytes < b.kept_bytes
    return a.step_s < b.step_s - 1e-9 * max(1.0, b.step_s)


def make_plan(profile: Profile, figures: Figures, params: PlanParams) -> Plan:
    """Plan the next steps from one profiled step (see module doc)."""
    items = sorted(profile.items, key=lambda it: (it.region, it.ordinal))
    infos = _type_infos(profile, items)
    choice = {info.type_key: 0 for info in infos}
    best = _evaluate(profile, figures, params, infos, choice, items)
    for _ in range(3):  # coordinate descent over block types
        changed = False
        for info in infos:
            for k in _candidates(info):
                if k == choice[info.type_key]:
                    continue
                trial = {**choice, info.type_key: k}
                result = _evaluate(profile, figures, params, infos, trial, items)
                if _better(result[0], best[0]):
                    best, choice, changed = result, trial, True
        if not changed:
            break
    pred, targets, recompute_sets, per_instance_s = best
    alternatives, checkpoint_keeps = _pure_predictions(profile, figures, params, infos, items)
    trials = tuple(name for name, step_s in alternatives.items()
                   if pred.feasible and step_s <= (1 + TRIAL_MARGIN) * pred.step_s)
    notes = []
    if not pred.feasible:
        notes.append(f"the budget cannot be met: {format_bytes(pred.kept_bytes)} stay on the "
                     "device (the tiers are full, or there is no block to recompute)")
    elif pred.fixed_bytes > params.budget_bytes:
        notes.append(f"the budget cannot be met: {format_bytes(pred.fixed_bytes)} stay on the "
                     "device whatever the plan does (below OFFLOAD_MIN_BYTES, no_offload(), or "
                     "held by a checkpoint's closure)")
    opaque = sorted({b.type_name for b in profile.blocks if b.opaque})
    if opaque:
        notes.append(f"{', '.join(opaque)}: compiled with torch.compile, so run whole (as they "
                     "are, or checkpointed); per-op recompute cannot see inside compiled code")
    plan = _assemble(profile, figures, params, infos, items, pred, targets, recompute_sets,
                     per_instance_s, notes)
    plan.alternatives, plan.trials = alternatives, trials
    plan.checkpoint_keeps = checkpoint_keeps
    plan.pending = [m for _ in range(TRIAL_ROUNDS) for m in ("plan", *trials)] if trials else []
    return plan


def _pure_predictions(profile: Profile, figures: Figures, params: PlanParams,
                      infos: list, items: list[ItemRecord]) -> tuple[dict, frozenset]:
    """Predicted step of each PURE strategy, and the blocks `checkpoint` keeps.

    `offload`: the budget at 0, blocks as they are. `checkpoint`: every op of every block
    re-run without the per-op dispatch modes, less the re-run of the last blocks whose
    storages (as a plain forward saves them) fit the budget next to what stays anyway;
    those run as they are and keep their storages."""
    bare = PlanParams(0, params.tiers, params.capacity_bytes, params.device_type,
                      params.staging_bytes)
    out = {"offload": _evaluate(profile, figures, bare, infos,
                                {i.type_key: 0 for i in infos}, items)[0].step_s}
    keeps: frozenset = frozenset()
    if any(i.ranking for i in infos):
        full = _evaluate(profile, figures, bare, infos,
                         {i.type_key: len(i.ranking) for i in infos}, items)[0]
        dispatch = 2 * (figures.dispatch_op_s or 0.0) * sum(
            len(i.ops) * len(i.instances) for i in infos)
        rerun = {index: sum(o.time_s for o in i.ops) for i in infos for index in i.instances}
        block_bytes: dict[int, int] = {}
        for it in items:
            if it.block is not None and it.eligible:
                block_bytes[it.block] = block_bytes.get(it.block, 0) + it.nbytes
        room = params.budget_bytes - full.kept_bytes
        chosen = []
        for index in sorted(rerun, reverse=True):   # the last blocks: backward needs them first
            need = block_bytes.get(index, 0)
            if need > room:
                break
            room -= need
            chosen.append(index)
        keeps = frozenset(chosen)
        out["checkpoint"] = full.step_s - dispatch - sum(rerun[i] for i in keeps)
    return out, keeps


def _assemble(profile, figures, params, infos, items, pred, targets, recompute_sets,
              per_instance_s, notes) -> Plan:
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
        blocks[info.type_key] = BlockPlan(info.type_key, info.name, info.instances, rset, rows,
                                          per_instance_s[info.type_key],
                                          {op.op_id: i for i, op in enumerate(info.ops)})
        for index in info.instances:
            block_type[index] = info.type_key
            info_of[index] = info
    for b in profile.blocks:
        signatures[b.index] = b.signature
    op_outputs = []   # (position in decided, item) of stored op outputs
    for it in items:
        target = targets.get(it.key, "keep")
        info = info_of.get(it.block) if it.block is not None else None
        recomputed = info is not None and it.producer in recompute_sets[info.type_key]
        decided.append((it.block, it.producer, it.nbytes, "recompute" if recomputed else target))
        if info is not None and recompute_sets[info.type_key]:
            if it.producer is not None and it.producer not in recompute_sets[info.type_key]:
                # A stored op output: one decision per op (its storages are packed
                # together); a tier wins over keep, memory-safe.
                key = (it.block, it.producer)
                if key not in op_targets or target != "keep":
                    op_targets[key] = target
                op_outputs.append((len(decided) - 1, it))
            elif it.input_index is not None:
                input_targets[(it.block, it.input_index)] = target
            continue
        item_targets[it.key] = target
        item_bytes[it.key] = it.nbytes
        if it.input_index is not None:
            input_targets[(it.block, it.input_index)] = target
    # A storage the search kept whose op moves: it moves too (the prediction follows, so
    # `kept_bytes` is what stays; test_auto's resident check holds it to that).
    for pos, it in op_outputs:
        op_target = op_targets[(it.block, it.producer)]
        if decided[pos][3] == "keep" and op_target != "keep":
            decided[pos] = (it.block, it.producer, it.nbytes, op_target)
            pred.kept_bytes -= it.nbytes
            pred.moved_bytes[op_target] = pred.moved_bytes.get(op_target, 0) + it.nbytes
    per_block: dict = {}
    largest = 0
    for block, _, nbytes, target in decided:
        if target not in ("keep", "recompute"):
            largest = max(largest, nbytes)
            if block is not None:
                per_block[block] = per_block.get(block, 0) + nbytes
    summary = {"forward_s": profile.forward_s, "backward_s": profile.backward_s,
               "saved_bytes": profile.saved_bytes, "items": len(items),
               "blocks": len(profile.blocks)}
    return Plan(item_targets, op_targets, input_targets, blocks, block_type, pred, params,
                figures, summary, signatures, notes, decided,
                _readahead(profile, figures, params, per_block, largest, pred.recompute_s),
                item_bytes=item_bytes)


# A block's reads are slow next to its backward when they take more than this share of it.
SLOW_READ_SHARE = 0.25


def _readahead(profile: Profile, figures: Figures, params: PlanParams, per_block: dict,
               largest: int, recompute_s: float) -> int:
    """Read-ahead of one block's moved bytes, when the link is slow next to the backward.

    Backward wants a block's storages together at its start. Where reading them takes a
    good share of a block's backward, a read-ahead shorter than one block's bytes cannot run
    the link ahead (measured on the reference GPT at OFFLOAD_NVME_MAX_BW=500MB: 1.0 s of
    stall in a 13 s step with the 64 MiB default, 0.01 s with one block's 336 MiB). The
    bytes read ahead are part of the "one block's working set" on top of the budget.
    Reads that do not fit the staging arena land in fresh memory, whose page faults cost
    more than the stall they save on a CPU (measured: a 336 MiB read-ahead against the
    256 MiB arena made the capped-disk step 4-45% slower than offloading everything, with
    no stall): at most the arena less one payload, and nothing on a fast link.
    """
    if not per_block or not params.tiers or not profile.blocks:
        return 0
    biggest = max(per_block.values())
    in_bps = _rates(figures, params.tiers[0], params.device_type)[1]
    block_backward_s = (profile.backward_s + recompute_s) / len(profile.blocks)
    if biggest / in_bps <= SLOW_READ_SHARE * block_backward_s:
        return 0
    return max(0, min(biggest, params.staging_bytes - largest))
