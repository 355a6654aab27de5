"""`ctx.plan` as text: the decisions per block type and op, what each option would cost, and
the figures they were made from. Rendering only; offload/schedule/plan.py decides."""
from __future__ import annotations

from collections import Counter, defaultdict

from ..util.sizes import format_bytes
from .plan import Plan, _rates

__all__ = ["render"]


def _s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"


def _targets(counter: Counter) -> str:
    if len(counter) == 1:
        return next(iter(counter))
    return ", ".join(f"{t} x{n}" for t, n in sorted(counter.items()))


def render(plan: Plan) -> str:
    params, figures, prof = plan.params, plan.figures, plan.profile_summary
    lines = [
        f"auto plan: {plan.summary()}",
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
    if plan.measured:
        lines.append("  measured step (best of its trial steps): " + ", ".join(
            f"{mode} {_s(min(t))}" for mode, t in plan.measured.items())
            + ("" if plan.settled else " (trials still running)")
            + f"; runs: {'the plan' if plan.mode == 'plan' else plan.mode}")
    move = params.tiers[0] if params.tiers else None
    rates = _rates(figures, move, params.device_type) if move else None
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
        mode = (f"per-op recompute, {_s(bp.recompute_s)} of re-run ops per block"
                if bp.per_op else "runs as is")
        lines.append(f"  block {bp.type_name} x{len(bp.instances)}: {mode}")
        head = f"    {'op (n-th call in the block)':<40} {'saved/block':>11} {'recompute':>10}"
        if rates:
            head += f" {move + ' trip':>10}"
        lines.append(head + "  decision")
        for row in bp.rows:
            if not row.saved_bytes:
                continue  # made nothing backward keeps: re-runs under per-op recompute
            name = f"{row.op.op_id[0].removeprefix('aten.')} #{row.op.op_id[1]}"
            if row.op.not_storable:
                name += f" ({row.op.not_storable})"
            line = (f"    {name:<40} {format_bytes(row.saved_bytes):>11} "
                    f"{_s(row.op.time_s + row.op.chain_s):>10}")
            if rates:
                line += f" {_s(row.saved_bytes / rates[0] + row.saved_bytes / rates[1]):>10}"
            decision = _targets(went[(bp.type_key, row.op.op_id)]) or row.decision
            lines.append(f"{line}  {decision}")
    if outside:
        lines.append("  block inputs and storages made outside blocks: " + ", ".join(
            f"{n} {t} ({format_bytes(outside_bytes[t])})" for t, n in sorted(outside.items())))
    return "\n".join(lines)
