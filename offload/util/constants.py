"""Numbers more than one part of offload relies on: one home each, with the reason.

What they were measured on is in docs/benchmarks.md ("Why the constants are what they are").
"""
from __future__ import annotations

__all__ = ["ROUND_TRIP_SAFETY", "ROUND_TRIP_MAX_KEPT_FRACTION"]

# A moved storage's pack → unpack gap must hold this many round trips (out and back) for
# the move to pay off: the measured speeds are lower bounds and the queues jitter.
# Used by the round-trip plan (runtime/round_trip.py) and by `auto`'s plan (schedule/).
ROUND_TRIP_SAFETY = 1.5

# The round-trip plan keeps at most this share of the moved bytes on the device: keeping
# costs device memory, and the plan errs towards keeping.
ROUND_TRIP_MAX_KEPT_FRACTION = 0.1
