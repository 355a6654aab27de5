"""The scheduler: policies `recompute` and `auto` (see README "How `auto` decides").

A saved tensor's walk under `auto`: the auto session (auto_session.py) says what the step
runs; the decision point (placement.py, `SchedulePlacement`) looks the tensor up in its
shape class's plan (plan.py; made by search.py from profile.py's step and probe.py's
figures, priced by costs.py), then the hooks hand it to a tier; inside blocks the plan's
recomputed ops are replayed by stored_ops.py. Modules import what they need from here
directly; nothing is re-exported.
"""


def reset() -> None:
    """Forget the scheduler's process-wide state (offload.process.reset): per-model plan
    caches and buffer slots live in util/per_model.py (cleared there); here, what schedule
    modules keep themselves: the messages said once."""
    from . import recompute, session_base, stored_ops, weights

    session_base.reset()
    stored_ops.forget_messages()
    recompute.forget_messages()
    weights.forget_messages()
