"""The scheduler's tuning constants, in one place: what each one bounds and why.

The measurements behind the values are in docs/benchmarks.md ("Why the scheduler's constants
are what they are"). The round trips a moved storage's gap must hold are the runtime's
`ROUND_TRIP_SAFETY` (util/constants.py), imported where used: one value under one name, so
the plan predicts what the runtime's round-trip plan does.
"""
from __future__ import annotations

__all__ = ["ETA", "TRIAL_MARGIN", "TRIAL_ROUNDS", "TRIAL_WIN", "SLOW_READ_SHARE",
           "MAX_PLANS", "SHAPE_REPROFILES", "KEPT_SLACK", "KEPT_SLACK_BYTES"]

# Share of the compute a transfer may hide behind (DESIGN cost model): the copy engine and
# the I/O threads take some of the time they overlap.
ETA = 0.8

# A whole-block strategy predicted within this share of the plan is measured against it
# (trials.py NOTE [Trials]): the cost model's misses run to several percent either way.
TRIAL_MARGIN = 0.15

# Trial steps each candidate runs, in a row; their mean counts (trials.py NOTE [Trials]: two
# kinds of step may alternate).
TRIAL_ROUNDS = 2

# A whole-block strategy replaces the plan only when this much faster: a smaller gap is
# step-to-step noise.
TRIAL_WIN = 0.02

# A block's reads are slow next to its backward when they take more than this share of it:
# then the read-ahead grows to one block's moved bytes (search.py, `_readahead`).
SLOW_READ_SHARE = 0.25

# Shape classes whose plans are kept (plan_cache.py NOTE [Shape classes]): lengths that vary
# every step stay planned without the cache growing without bound.
MAX_PLANS = 32

# Profiles again in a row a shape class may take for calls with other shapes than its plan
# holds (plan_cache.py NOTE [Shape classes]): a pattern the profiled step may not see
# (calls of another shape every other step) would otherwise profile every other step.
SHAPE_REPROFILES = 2

# A planned step that kept more than its plan predicted by this share and these bytes
# (plan_cache.py NOTE [Kept more than planned]): what the blocks save changed since the
# profile; below it, a micro-batch's rounding.
KEPT_SLACK = 0.10
KEPT_SLACK_BYTES = 16 << 10
