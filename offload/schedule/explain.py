"""`ctx.plan` as text: the decisions per block type and op, what each option would cost, and
the figures they were made from. Rendering only: it reads the plan (plan.py) and the trial
steps (trials.py) it is handed; search.py decides."""
from __future__ import annotations

from collections import Counter, defaultdict

from ..util.sizes import format_bytes
from .costs import rates
from .plan import Plan
from .profile import WHOLE_BLOCK
from .trials import PURE, TrialSteps

__all__ = ["render", "summary"]


def _s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"


def _targets(counter: Counter) -> str:
    if len(counter) == 1:
        return next(iter(counter))
    return ", ".join(f"{t} x{n}" for t, n in sorted(counter.items()))


def _count(instances: tuple[int, ...]) -> str:
    """How many blocks of a type, and how often they ran when that differs: an instance is
    one call, so gradient accumulation inside one context (profile.py NOTE [Micro-batches])
    or a layer shared across positions calls a block more than once."""
    blocks = len(set(instances))
    calls = len(instances)
    return f"x{blocks}" if calls == blocks else f"x{blocks} ({calls} calls)"


def summary(plan: Plan, mode: str = "plan") -> str:
    """One line: what the plan keeps, moves and recomputes, its predicted step, and what runs
    instead when a trial chose a whole-block strategy (`mode`)."""
    p = plan.prediction
    moved = ", ".join(f"{t} {format_bytes(b)}" for t, b in p.moved_bytes.items() if b)
    per_op = [bp for bp in plan.blocks.values() if bp.per_op]
    runs = "" if mode == "plan" else \
        f"; measured faster and run instead: {mode} ({PURE[mode]})"
    return (f"kept {format_bytes(p.kept_bytes)} (budget "
            f"{format_bytes(plan.params.budget_bytes)}), {moved or 'nothing moved'}, "
            f"recomputed {format_bytes(p.recomputed_bytes)} in {len(per_op)} of "
            f"{len(plan.blocks)} block types; predicted step {p.step_s:.3g} s against "
            f"{p.compute_s:.3g} s of compute (recompute {p.recompute_s:.3g} s, stall "
            f"{p.stall_s:.3g} s){runs}")


def render(plan: Plan, trials: TrialSteps | None = None) -> str:
    """Every decision of `plan` and what it was based on; with `trials`, what they measured
    and what runs."""
    params, figures, prof = plan.params, plan.figures, plan.profile_summary
    trials = trials or TrialSteps()
    lines = [
        f"auto plan: {summary(plan, trials.mode)}",
        f"  profile: forward {_s(prof['forward_s'])}, backward {_s(prof['backward_s'])} of "
        f"compute; {format_bytes(prof['saved_bytes'])} saved in {prof['items']} storages; "
        f"{prof['blocks']} blocks",
        f"  figures: {figures.describe()}",
        f"  budget {format_bytes(params.budget_bytes)} kept; tiers that free memory: "
        f"{', '.join(params.tiers) or 'none'}; read-ahead: "
        + (f"{format_bytes(plan.readahead_bytes)} (one block's moved bytes: slow link)"
           if plan.readahead_bytes else "OFFLOAD_PREFETCH_BYTES"),
    ]
    lines += [f"  note: {n}" for n in plan.notes]
    if plan.alternatives:
        lines.append("  pure strategies, predicted: " + ", ".join(
            f"{name} {_s(step_s)}" for name, step_s in plan.alternatives.items())
            + (f"; measured against the plan: {', '.join(plan.trials)}" if plan.trials
               else " (none within reach: not measured)"))
    if trials.measured:
        lines.append("  measured step (mean of its trial steps): " + ", ".join(
            f"{mode} {_s(seconds)}" for mode, seconds in trials.means().items())
            + ("" if trials.settled else " (trials still running)")
            + f"; runs: {'the plan' if trials.mode == 'plan' else trials.mode}")
    if trials.failed:
        lines.append(f"  trial steps that raised (not run again): {', '.join(trials.failed)}")
    if trials.mode != "plan":   # the header says so too; the blocks below are the plan's
        lines.append(f"  the plan's decisions below do not run: every step runs "
                     f"{trials.mode} ({PURE[trials.mode]}), measured faster")
    move = params.tiers[0] if params.tiers else None
    link = rates(figures, move, params.device_type) if move else None
    # Where each (block type, op)'s storages went, over the type's instances.
    went: dict[tuple, Counter] = defaultdict(Counter)
    outside: Counter = Counter()
    outside_bytes: Counter = Counter()
    for block, producer, nbytes, target in plan.decided:
        key = plan.block_type.get(block) if block is not None else None
        if key is None or producer is None:
            outside[target] += 1
            outside_bytes[target] += nbytes
        else:
            went[(key, producer)][target] += 1
    for bp in plan.blocks.values():
        if not bp.per_op:
            mode = "runs as is"
        elif WHOLE_BLOCK in bp.recompute:
            mode = f"checkpointed whole, {_s(bp.recompute_s)} of re-run per block"
        else:
            mode = f"per-op recompute, {_s(bp.recompute_s)} of re-run ops per block"
        lines.append(f"  block {bp.type_name} {_count(bp.instances)}: {mode}")
        shown = [row for row in bp.rows if row.saved_bytes]   # the rest re-run per op
        names = [f"{row.op.op_id[0].removeprefix('aten.')} #{row.op.op_id[1]}" for row in shown]
        width = max([40, *map(len, names)])   # one column for the longest op name
        head = (f"    {'op (n-th call in the block)':<{width}} {'saved/block':>11} "
                f"{'recompute':>10}")
        if link:
            head += f" {move + ' trip':>10}"
        lines.append(head + "  decision")
        for row, name in zip(shown, names):
            line = (f"    {name:<{width}} {format_bytes(row.saved_bytes):>11} "
                    f"{_s(row.op.time_s + row.op.chain_s):>10}")
            if link:
                line += f" {_s(row.saved_bytes / link[0] + row.saved_bytes / link[1]):>10}"
            decision = _targets(went[(bp.type_key, row.op.op_id)]) or row.decision
            if row.op.not_storable:   # after the columns: the reason is longer than a name
                decision += f" ({row.op.not_storable})"
            lines.append(f"{line}  {decision}")
    if outside:
        lines.append("  block inputs and storages made outside blocks: " + ", ".join(
            f"{n} {t} ({format_bytes(outside_bytes[t])})" for t, n in sorted(outside.items())))
    return "\n".join(lines)
