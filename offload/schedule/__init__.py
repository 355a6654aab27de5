"""The scheduler: policies `recompute` and `auto` (see README "How `auto` decides").

A saved tensor's walk under `auto`: session.py (the decision point, `SchedulePlacement`)
looks it up in the plan (plan.py, made from profile.py's step and probe.py's figures),
then the hooks hand it to a tier; inside blocks the plan's recomputed ops are replayed by
recompute.py. Modules import what they need from here directly; nothing is re-exported.
"""


def reset() -> None:
    """Forget the scheduler's process-wide state (offload.process.reset): per-model sessions
    and plans live in util/per_model.py; here, what schedule modules keep themselves."""
