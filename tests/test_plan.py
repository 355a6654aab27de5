"""The plan as a pure function of profile, figures and budget: decisions move the way the
figures say (slower link: more recompute; faster link: more offload; tighter budget: less
kept), the same figures give the same plan, bouncing storages stay, capacities spill."""
from __future__ import annotations

import re

import pytest
import torch

from offload.util.figures import Figures
from offload.schedule.costs import PlanParams
from offload.schedule.explain import render
from offload.schedule.search import make_plan
from offload.schedule.profile import BlockRecord, ItemRecord, OpRecord, Profile

MB = 1 << 20
N_BLOCKS = 8
FWD_S, BWD_S = 0.5, 1.0
# (op id, time s, bytes, why not storable); the saved ones become items.
OPS = [
    (("aten.native_layer_norm.default", 0), 0.001, 8 * MB, None),
    (("aten.addmm.default", 0), 0.010, 24 * MB, None),
    (("aten._scaled_dot_product_flash_attention.default", 0), 0.020, 8 * MB, None),
    (("aten.empty_like.default", 0), 0.002, 2 * MB, "changed in place later"),
    (("aten.addmm.default", 1), 0.012, 32 * MB, None),
    (("aten.gelu.default", 0), 0.002, 32 * MB, None),
    (("aten.addmm.default", 2), 0.012, 8 * MB, None),    # not saved
]
SAVED = OPS[:6]


def profile() -> Profile:
    blocks, items = [], []
    block_fwd = FWD_S * 0.9 / N_BLOCKS
    block_bwd = BWD_S * 0.9 / N_BLOCKS
    items.append(ItemRecord(("after", -1), 0, 8 * MB, ("e", 0), True, pack_s=0.01,
                            unpack_s=FWD_S + BWD_S - 0.01))
    for k in range(N_BLOCKS):
        ops = [OpRecord(op_id, t, nbytes, why) for op_id, t, nbytes, why in OPS]
        blocks.append(BlockRecord(k, ("Blk", ()), "Blk", ((((4, 8), torch.float32, "cpu"),),
                                                          ()), ops))
        start = 0.03 + k * block_fwd
        back = FWD_S + 0.05 + (N_BLOCKS - 1 - k) * block_bwd
        items.append(ItemRecord(("block", k), 0, 8 * MB, ("b", k, 0), True, None, 0,
                                pack_s=start, unpack_s=back + block_bwd * 0.9))
        for j, (op_id, _, nbytes, _) in enumerate(SAVED, start=1):
            items.append(ItemRecord(("block", k), j, nbytes, ("b", k, j), True, op_id, None,
                                    pack_s=start + j * block_fwd / 8,
                                    unpack_s=back + block_bwd * (1 - j / 8)))
    items.append(ItemRecord(("after", N_BLOCKS - 1), 0, 16 * MB, ("h", 0), True,
                            pack_s=FWD_S - 0.01, unpack_s=FWD_S + 0.005))
    total = sum(it.nbytes for it in items)
    return Profile(torch.device("cpu"), FWD_S, BWD_S, total, blocks, items)


def figures(gbps: float) -> Figures:
    return Figures(compute_gflops=100, dispatch_op_s=2e-6, nvme_write_gbps=gbps,
                   nvme_read_gbps=gbps, nvme_issue_s=5e-6)


def params(budget_fraction: float = 0.3, **kw) -> PlanParams:
    budget = int(budget_fraction * profile().saved_bytes)
    return PlanParams(budget_bytes=budget, tiers=kw.pop("tiers", ("nvme",)), **kw)


def _summary(plan):
    p = plan.prediction
    return p.recomputed_bytes, sum(p.moved_bytes.values()), p.kept_bytes


def test_same_figures_same_plan():
    a = make_plan(profile(), figures(0.3), params())
    b = make_plan(profile(), figures(0.3), params())
    assert a.item_targets == b.item_targets and a.op_targets == b.op_targets
    assert {k: bp.recompute for k, bp in a.blocks.items()} == \
        {k: bp.recompute for k, bp in b.blocks.items()}
    assert a.prediction == b.prediction


LINKS = [100.0, 10.0, 3.0, 1.0, 0.3, 0.1, 0.03, 0.01]


def test_slower_link_more_recompute_faster_link_more_offload():
    plans = [make_plan(profile(), figures(g), params()) for g in LINKS]
    recomputed = [_summary(p)[0] for p in plans]
    moved = [_summary(p)[1] for p in plans]
    # Slower link (left to right): recompute never shrinks, transfers never grow.
    assert recomputed == sorted(recomputed) and moved == sorted(moved, reverse=True)
    assert recomputed[0] == 0 and recomputed[-1] > 0
    assert moved[0] > moved[-1]
    for p in plans:
        assert p.prediction.feasible and p.prediction.kept_bytes <= p.params.budget_bytes


def test_tighter_budget_less_kept():
    kept = []
    for fraction in (1.0, 0.7, 0.4, 0.2, 0.05, 0.0):
        plan = make_plan(profile(), figures(0.3), params(fraction))
        assert plan.prediction.kept_bytes <= plan.params.budget_bytes
        kept.append(plan.prediction.kept_bytes)
    assert kept == sorted(kept, reverse=True) and kept[0] > kept[-1]
    full = make_plan(profile(), figures(0.3), params(1.0))
    assert _summary(full)[0] == 0  # everything fits: nothing recomputed ...
    assert full.prediction.stall_s == 0  # ... and only what hides for free is moved


def test_the_budget_is_a_ceiling_what_hides_for_free_moves():
    roomy = params(1.0)
    fast = make_plan(profile(), figures(100.0), roomy)
    slow = make_plan(profile(), figures(0.01), roomy)
    assert sum(fast.prediction.moved_bytes.values()) > 0.5 * profile().saved_bytes
    assert fast.prediction.stall_s == 0 and fast.prediction.step_s == pytest.approx(
        fast.prediction.compute_s, rel=1e-3)
    assert sum(slow.prediction.moved_bytes.values()) < \
        sum(fast.prediction.moved_bytes.values())


def test_recompute_starts_with_the_cheapest_per_byte():
    plan = make_plan(profile(), figures(0.01), params(0.5))
    (bp,) = plan.blocks.values()
    assert bp.per_op
    # The mask (cannot be stored) and GELU (cheap, big) go first; the attention last.
    assert ("aten.empty_like.default", 0) in bp.recompute
    assert ("aten.gelu.default", 0) in bp.recompute
    assert ("aten._scaled_dot_product_flash_attention.default", 0) not in bp.recompute


def test_a_bouncing_storage_is_not_moved_while_others_can_be():
    # The logits are saved at the very end of the forward and needed at once: moving them
    # cannot hide; the budget leaves room to keep them.
    plan = make_plan(profile(), figures(1.0), params(0.5))
    assert plan.item_targets[(("after", N_BLOCKS - 1), 0)] == "keep"
    assert "nvme" in plan.item_targets.values()


def test_tier_capacity_spills_to_the_next_tier():
    gpu = Figures(compute_gflops=1e5, dispatch_op_s=2e-6, d2h_gbps=50, h2d_gbps=50,
                  copy_issue_s=5e-5, nvme_write_gbps=5, nvme_read_gbps=5, nvme_issue_s=5e-6)
    plan = make_plan(profile(), gpu, params(0.3, tiers=("host", "nvme"), device_type="cuda",
                                          capacity_bytes={"host": 100 * MB}))
    moved = plan.prediction.moved_bytes
    assert 0 < moved["host"] <= 100 * MB and moved.get("nvme", 0) > 0


def test_unreachable_budget_is_said():
    prof = profile()
    for it in prof.items:
        it.eligible = False  # e.g. every tensor below OFFLOAD_MIN_BYTES
    prof.blocks = []         # and no blocks to recompute
    plan = make_plan(prof, figures(1.0), params(0.1))
    assert plan.prediction.kept_bytes == prof.saved_bytes
    assert set(plan.item_targets.values()) == {"keep"}
    assert "the budget cannot be met" in render(plan)


def _two_micro_batches(prof: Profile) -> Profile:
    """`prof` as gradient accumulation inside one context runs it: its forward and backward
    twice in one step (profile.py NOTE [Micro-batches]), the same blocks and storage keys
    again, each micro-batch's saves freed by its backward."""
    import dataclasses

    span = prof.forward_s + prof.backward_s
    again = [dataclasses.replace(it, segment=1,
                                 pack_s=None if it.pack_s is None else it.pack_s + span,
                                 unpack_s=None if it.unpack_s is None else it.unpack_s + span)
             for it in prof.items]
    return Profile(prof.device, 2 * prof.forward_s, 2 * prof.backward_s, 2 * prof.saved_bytes,
                   prof.blocks + prof.blocks, prof.items + again)


@pytest.mark.parametrize("capacity", [None, 400 * MB], ids=["room", "tier-capacity"])
@pytest.mark.parametrize("gbps", [0.05, 1.0])
def test_micro_batches_are_planned_as_one_is(gbps, capacity):
    """The budget and a tier's capacity hold per micro-batch (each backward frees its
    micro-batch's storages): two micro-batches in one step get the decisions of one, keep
    what one keeps, and a percentage is of one's saves."""
    one = profile()
    two = _two_micro_batches(one)
    assert two.peak_saved_bytes == one.saved_bytes
    room = {} if capacity is None else {"capacity_bytes": {"nvme": capacity}}
    single = make_plan(one, figures(gbps), params(0.3, **room))
    double = make_plan(two, figures(gbps), params(0.3, **room))
    assert double.prediction.kept_bytes == single.prediction.kept_bytes
    assert double.prediction.recomputed_bytes == 2 * single.prediction.recomputed_bytes
    assert double.op_targets == single.op_targets and double.item_targets == single.item_targets
    assert double.prediction.feasible
    # Eight blocks called twice each: counted as eight, not as sixteen blocks.
    assert "block Blk x8: " in render(single) and "block Blk x8 (16 calls): " in render(double)


def test_a_storage_key_saved_twice_in_a_forward_fits_a_tier_with_both():
    """A block called twice in one forward (a shared layer) saves its storages under the same
    keys twice, and a key's decision is both's: a tier takes the key only with room for
    both."""
    def twice(region):
        return [ItemRecord(region, 0, 10 * MB, ("x", k), True, pack_s=0.01 + k * 0.01,
                           unpack_s=FWD_S + BWD_S - 0.1) for k in range(2)]
    prof = Profile(torch.device("cpu"), FWD_S, BWD_S, 20 * MB, [], twice(("after", 0)))
    plan = make_plan(prof, figures(1.0), params(0.0, capacity_bytes={"nvme": 15 * MB}))
    assert plan.prediction.moved_bytes.get("nvme", 0) == 0
    assert not plan.prediction.feasible
    roomy = make_plan(prof, figures(1.0), params(0.0, capacity_bytes={"nvme": 20 * MB}))
    assert roomy.prediction.moved_bytes["nvme"] == 20 * MB


def test_an_unmet_budget_says_what_keeps_the_bytes():
    """With no tier that frees memory (a CPU run's host tier), recompute alone cannot free
    the blocks' inputs and what is saved outside blocks: the plan says that, not that tiers
    are full or blocks missing; with a full tier it names the size to raise."""
    no_tier = render(make_plan(profile(), figures(1.0), params(0.01, tiers=())))
    assert "the budget cannot be met" in no_tier
    assert "no tier of OFFLOAD_TIERS frees device memory" in no_tier
    assert "tiers are full" not in no_tier and "no block" not in no_tier
    full = render(make_plan(profile(), figures(1.0),
                            params(0.01, capacity_bytes={"nvme": 1 * MB})))
    assert "the tiers are full: raise OFFLOAD_NVME_BYTES" in full


@pytest.mark.parametrize("gbps", [0.01, 1.0])
def test_explain_names_every_saved_op_and_the_figures(gbps):
    text = render(make_plan(profile(), figures(gbps), params()))
    for op_id, *_ in SAVED:
        assert f"{op_id[0].removeprefix('aten.')} #{op_id[1]}" in text
    assert f"nvme_write_gbps={gbps:.3g} GB/s" in text and "block Blk x8" in text
    # Every op row's columns line up; an op's reason it cannot be stored comes after its
    # decision (it overflowed the name column, a helper's report).
    rows = [line for line in text.splitlines() if re.match(r"    \S+ #\d", line)]
    assert len(rows) == len(SAVED)
    assert len({line.index(" MiB") for line in rows}) == 1, "\n".join(rows)
    assert any(line.endswith("(changed in place later)") for line in rows)


def test_pure_strategies_are_priced_and_the_close_ones_measured():
    """Plan.alternatives prices `offload` (all moved, blocks as they are) and `checkpoint`
    (every block checkpointed but the last ones the budget keeps); those within
    TRIAL_MARGIN of the plan are its trials, in a queue of TRIAL_ROUNDS rounds (trials.py
    NOTE [Trials]); a plan that is itself no better than a pure strategy by the margin
    measures it, and the same inputs give the same trials."""
    from offload.schedule.constants import TRIAL_MARGIN, TRIAL_ROUNDS
    from offload.schedule.trials import TrialSteps

    for gbps in (1000.0, 1.0, 0.05, 1e-4):
        plan = make_plan(profile(), figures(gbps), params())
        assert set(plan.alternatives) == {"offload", "checkpoint"}
        within = tuple(n for n, t in plan.alternatives.items()
                       if t <= (1 + TRIAL_MARGIN) * plan.prediction.step_s)
        assert plan.trials == within
        steps = TrialSteps(plan.trials)
        # each TRIAL_ROUNDS steps in a row (trials.py NOTE [Trials])
        assert steps.pending == ([m for m in ["plan", *within] for _ in range(TRIAL_ROUNDS)]
                                 if within else [])
        assert steps.running == "plan" and steps.settled == (not within)
        again = make_plan(profile(), figures(gbps), params())
        assert again.trials == plan.trials and again.alternatives == plan.alternatives
    fast = make_plan(profile(), figures(1000.0), params())
    assert "offload" in fast.trials            # moving everything is (about) the plan
    slow = make_plan(profile(), figures(1e-4), params())
    assert slow.alternatives["offload"] > 10 * slow.prediction.step_s   # cannot hide at all
    assert "offload" not in slow.trials


def test_the_explanation_says_when_a_pure_strategy_runs_instead_of_the_plan():
    """Once a trial chose a whole-block strategy, the per-block lines still describe the
    plan ("runs as is"): the text says they do not run (a reader took them for what ran)."""
    from offload.schedule.trials import TrialSteps

    plan = make_plan(profile(), figures(1.0), params())
    steps = TrialSteps(("checkpoint",))
    assert "do not run" not in render(plan, steps)    # the plan runs (trials pending)
    steps.pending, steps.mode = [], "checkpoint"
    text = render(plan, steps).splitlines()
    said = [i for i, line in enumerate(text) if "the plan's decisions below do not run: "
            "every step runs checkpoint (every block checkpointed whole" in line]
    first_block = next(i for i, line in enumerate(text) if line.startswith("  block "))
    assert said and said[0] < first_block


def test_a_pure_strategy_that_would_keep_more_than_the_budget_is_not_tried(monkeypatch):
    """No tier frees memory (a CPU with `tiers="host"`: host is the same RAM): moving
    everything keeps it all. Before, `offload` was still tried against the plan, a trial
    step holding every saved byte against a budget the plan met by recomputing. Now it is
    left out (a note says why) however close its predicted step, and what is tried keeps no
    more than the budget."""
    from offload.schedule import search as search_mod

    monkeypatch.setattr(search_mod, "TRIAL_MARGIN", float("inf"))
    plan = make_plan(profile(), figures(0.05), params(tiers=()))
    assert plan.prediction.feasible and plan.prediction.kept_bytes <= plan.params.budget_bytes
    assert plan.trials == ("checkpoint",)   # its block inputs stay, and they fit
    assert [n for n in plan.notes if n.startswith("not measured")] == [
        "not measured against the plan: offload, which would keep 936 MiB on the device, "
        "over the budget (what no tier of OFFLOAD_TIERS frees stays: on a CPU, host memory "
        "is the same RAM)"]
    moving = make_plan(profile(), figures(0.05), params())   # nvme frees memory: tried
    assert moving.trials == ("offload", "checkpoint") and not any(
        n.startswith("not measured") for n in moving.notes)


def test_checkpoint_strategy_keeps_last_blocks_within_the_budget():
    """More budget, more blocks kept as they are (always the last ones), never over the
    budget; each kept block takes its re-run out of the prediction."""
    prof = profile()
    per_block: dict = {}
    for it in prof.items:
        if it.block is not None and it.eligible:
            per_block[it.block] = per_block.get(it.block, 0) + it.nbytes
    last = max(per_block)
    kept, predicted = [], []
    for fraction in (0.0, 0.3, 0.6, 1.0):
        plan = make_plan(prof, figures(0.05), params(fraction))
        keeps = plan.checkpoint_keeps
        assert keeps == set(range(last + 1 - len(keeps), last + 1))
        assert sum(per_block[b] for b in keeps) <= plan.params.budget_bytes
        kept.append(len(keeps))
        predicted.append(plan.alternatives["checkpoint"])
    assert kept == sorted(kept) and kept[0] == 0 and kept[-1] > 0
    assert predicted == sorted(predicted, reverse=True) and predicted[-1] < predicted[0]


def test_one_safety_for_the_plan_and_the_round_trip_plan():
    """The plan predicts what the runtime's round-trip plan does only with the same safety:
    one value under one name (util/constants.py), which both use."""
    import inspect

    from offload.runtime import round_trip
    from offload.schedule import constants, costs
    from offload.util.constants import ROUND_TRIP_SAFETY

    assert costs.ROUND_TRIP_SAFETY is ROUND_TRIP_SAFETY
    assert round_trip.RoundTripPlan().safety is ROUND_TRIP_SAFETY
    for fn in (round_trip.pays_off, round_trip.keep_on_device):
        assert inspect.signature(fn).parameters["safety"].default is ROUND_TRIP_SAFETY
    # No second name for it anywhere.
    for module in (round_trip, constants, costs):
        assert not hasattr(module, "SAFETY") and not hasattr(module, "DEFAULT_SAFETY")


def test_the_plan_hides_a_storage_exactly_when_the_round_trip_plan_would_move_it():
    """costs._hideable is the runtime's pays_off for one tensor alone on the link, at the
    boundary too (a gap of exactly ROUND_TRIP_SAFETY round trips hides)."""
    from offload.runtime.round_trip import pays_off
    from offload.schedule import costs
    from offload.schedule.profile import ItemRecord
    from offload.util.constants import ROUND_TRIP_SAFETY

    out_bps, in_bps, nbytes = 1e9, 2e9, 3_000_000
    roundtrip = nbytes / out_bps + nbytes / in_bps
    for factor in (0.5, 0.999, 1.0, 1.001, 3.0):
        gap = ROUND_TRIP_SAFETY * roundtrip * factor
        item = ItemRecord(region=("block", 0), ordinal=0, nbytes=nbytes, hooks_key=0,
                          eligible=True, pack_s=0.0, unpack_s=gap)
        assert costs._hideable(item, out_bps, in_bps) == pays_off(
            gap, nbytes / out_bps, nbytes / in_bps) == (factor >= 1.0), factor


def test_a_plan_is_immutable_and_holds_no_trial_state():
    """A plan can be shared (shape classes, threads printing ctx.plan): nothing of it can be
    changed, and what the trials run and measure is not in it (trials.py)."""
    import dataclasses

    plan = make_plan(profile(), figures(0.05), params())
    bp = next(iter(plan.blocks.values()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.notes = ("changed",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.prediction.kept_bytes = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        bp.recompute = frozenset()
    for mapping in (plan.item_targets, plan.op_targets, plan.input_targets, plan.blocks,
                    plan.prediction.moved_bytes, bp.positions, plan.alternatives):
        with pytest.raises(TypeError):
            mapping["x"] = "keep"
    assert isinstance(plan.notes, tuple) and isinstance(plan.decided, tuple)
    assert not any(hasattr(plan, name) for name in ("pending", "measured", "mode"))


def test_class_plans_sharing_a_plan_keep_their_own_trials():
    """ctx.plan is a ClassPlan: the plan's attributes read through, the trial steps are the
    class's own, and printing shows both."""
    from offload.schedule.plan_cache import ClassPlan

    plan = make_plan(profile(), figures(1000.0), params())
    assert plan.trials                      # moving everything is (about) the plan
    a, b = ClassPlan(plan), ClassPlan(plan)
    assert a.trial_steps.done("plan", 1.0) is False
    assert a.measured == {"plan": [1.0]} and b.measured == {} and a.pending != b.pending
    assert a.blocks is plan.blocks and a.prediction is plan.prediction and a.mode == "plan"
    assert "auto plan:" in str(a) and "measured step" in str(a) and "measured step" not in str(b)


def test_a_plan_pickles_and_copies_as_it_is():
    """Read-only tables still pickle, copy and serialise like the dicts they are."""
    import copy
    import json
    import pickle

    from offload.schedule.plan_cache import ClassPlan

    plan = make_plan(profile(), figures(0.05), params())
    for again in (pickle.loads(pickle.dumps(plan)), copy.deepcopy(plan), copy.copy(plan)):
        assert again == plan and render(again) == render(plan)
        with pytest.raises(TypeError):
            again.item_targets.clear()
    entry = pickle.loads(pickle.dumps(ClassPlan(plan)))
    assert entry.plan == plan and entry.pending == ClassPlan(plan).pending
    assert json.loads(json.dumps(dict(plan.prediction.moved_bytes))) == \
        dict(plan.prediction.moved_bytes)


def _chained_profile(op_id: tuple) -> Profile:
    """profile() with each block's input an output of `op_id` in the block before (a
    post-norm block's LayerNorm, BERT's): a later save of that op's output (`made_by`)."""
    p = profile()
    for it in p.items:
        if it.input_index == 0 and it.block:
            it.made_by = (it.block - 1, op_id)
    return p


@pytest.mark.parametrize("budget", [0.1, 0.2, 0.3, 0.5])
@pytest.mark.parametrize("gbps", LINKS)
def test_a_later_save_of_a_stored_op_s_output_gets_the_op_s_decision(gbps, budget):
    """unsaved_outputs.py NOTE [Unsaved outputs] rule 5: the op packs the storage first and
    a storage is stored once, so the next block's input that is a stored op's output
    gets that op's decision, in the plan's lookups and in what it counts as kept. (The
    attention op: stored in most of these plans, where LayerNorm is re-run.)"""
    attention = OPS[2][0]
    plan = make_plan(_chained_profile(attention), figures(gbps), params(budget))
    followed = 0
    for k in range(1, N_BLOCKS):
        op = (k - 1, attention)
        if op in plan.op_targets:
            followed += 1
            assert plan.input_targets[(k, 0)] == plan.op_targets[op], (k, render(plan))
    kept = sum(nbytes for _, _, nbytes, target in plan.decided if target == "keep")
    assert plan.prediction.kept_bytes == kept, render(plan)
    if followed:
        assert plan.prediction.kept_bytes <= plan.params.budget_bytes


def _types_that_pay_off_together() -> Profile:
    """Two block types, each keeping a storage below OFFLOAD_MIN_BYTES (a GRU's small gate
    tensors) that only a per-op re-run of its block frees, with a budget that either alone
    leaves exceeded: while it is, everything movable must move (a slow link: a long stall),
    so re-running one type costs its recompute and saves little; re-running both meets the
    budget with nothing moved. (Seen on CI: a GRU language model whose two GRUs are two
    types ran a plan ten times slower than the one that re-ran both.)"""
    blocks, items = [], []
    for k, name in enumerate(("A", "B")):
        ops = [OpRecord(("aten.mm.default", 0), 0.5, 4 << 10, None),
               OpRecord(("aten.sigmoid.default", 0), 0.001, 5 * MB, None)]
        blocks.append(BlockRecord(k, (name, ()), name, ((((4, 8), torch.float32, "cpu"),),
                                                         ()), ops))
        items.append(ItemRecord(("block", k), 0, 4 << 10, ("b", k), True,
                                ("aten.mm.default", 0), pack_s=0.1 + k * 0.1,
                                unpack_s=1.4 - k * 0.3))
        items.append(ItemRecord(("block", k), -1, 5 * MB, None, False,
                                ("aten.sigmoid.default", 0), small=True))
    items.append(ItemRecord(("after", 1), 0, 3 * MB, ("h", 0), True, pack_s=0.45,
                            unpack_s=0.55))
    total = sum(it.nbytes for it in items)
    return Profile(torch.device("cpu"), FWD_S, BWD_S, total, blocks, items)


def test_block_types_whose_re_runs_pay_off_only_together_are_found():
    """The search is not stuck where no one type's change helps (coordinate descent from
    "every block as it is" alone was): it also starts from every type re-running all it
    can."""
    prof = _types_that_pay_off_together()
    plan = make_plan(prof, figures(0.001), PlanParams(budget_bytes=4 * MB, tiers=("nvme",)))
    assert all(bp.per_op for bp in plan.blocks.values()), render(plan)
    assert plan.prediction.kept_bytes <= 4 * MB and not plan.prediction.moved_bytes, \
        render(plan)
