"""``--max-batch``: the largest batch each strategy fits, and its throughput there.

What "fits" means:

* CUDA: the worker ran without running out of device memory (and, with ``--memory-limit``,
  its allocator peak above the model at rest stayed under the limit).
* CPU: RAM is the device, and running out of it would take the machine down, so the limit is
  a number (``--memory-limit``) checked against the strategy's *resident activation bytes* --
  what our accounting says stays in RAM: for ``none``/``save_on_cpu`` every storage autograd
  saves; for ``recompute`` the block inputs kept between forward and backward plus the
  largest block's recomputed set; for the offload rows the runtime's ``peak_resident_bytes``
  plus its staging arena. These are different instruments: the row's ``resident_source``
  names its own, and its ``resident_check`` says whether the measured RSS growth of the
  main run agrees with it (each probe also records its RSS growth). Strategies without such
  accounting (torchtune) get no CPU result.

Search: every probe is a fresh worker (one warm-up + one timed step). The throughput
reported is the median step time of the run at the best batch: that is the single timed
step of a probe, or the median of the main run's ``--steps`` when the best batch is the
base batch (so a probe's figure is one sample, noisier than the main run's). The first probe is the batch predicted from the main
run by assuming activation bytes grow linearly with the batch; then its neighbour confirms
the edge, and bisection takes over if the prediction was off. A batch cap and a per-strategy
time budget keep it bounded; ``max_batch_limited_by`` says which edge stopped the search
("memory" is the real answer; "cap"/"time" mean "at least this").
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from offload.bench.result import RunResult
from offload.bench.rows import Probe

__all__ = ["fits", "search", "Found"]

# Room left for the allocator's fragmentation when predicting the GPU batch.
_CUDA_USABLE_FRACTION = 0.92


@dataclass
class Found:
    """What the search found for one strategy (the row's ``max_batch*`` fields)."""

    max_batch: int | None
    max_batch_limited_by: str
    max_batch_probes: list[Probe] = field(default_factory=list)
    max_batch_step_s: float | None = None
    max_batch_tokens_per_s: float | None = None
    max_batch_samples_per_s: float | None = None


def fits(result: RunResult, device_type: str, limit_bytes: int | None) -> bool | None:
    """Whether a probe fits; None when it cannot be told (no accounting, crash)."""
    if result.oom:
        return False
    if not result.available:
        return None
    if device_type == "cuda":
        return limit_bytes is None or result.cuda_peak_bytes <= limit_bytes
    if result.resident_bytes is None:
        return None
    return result.resident_bytes <= limit_bytes


def _predict(base: RunResult, device_type: str, limit_bytes: int | None) -> int | None:
    batch = base.batch
    if device_type == "cuda":
        per_sample = (base.cuda_peak_bytes or 0) / batch
        room = limit_bytes
        if room is None and base.cuda_total_bytes:
            room = _CUDA_USABLE_FRACTION * base.cuda_total_bytes - base.cuda_base_bytes
    else:
        per_sample, room = (base.resident_bytes or 0) / batch, limit_bytes
    if not per_sample or room is None:
        return None
    return max(1, math.floor(room / per_sample))


def search(base: RunResult, probe: Callable[[int], RunResult], *, device_type: str,
           limit_bytes: int | None, cap: int, time_budget_s: float,
           on_probe: Callable[[int, bool | None], None] = lambda b, f: None) -> Found:
    """Find the largest fitting batch for one strategy.

    Args:
        base: the worker result of the main run (its batch, memory and step time).
        probe: runs the strategy at a batch, returns the worker result.
        cap: largest batch to try.
        time_budget_s: stop when the next probe is predicted to exceed what is left.
    """
    base_batch = base.batch
    probes: list[Probe] = []
    lo, hi, best = 0, None, None
    base_fit = fits(base, device_type, limit_bytes)
    if base_fit is None:
        return Found(None, "no memory accounting for this strategy here")
    if base_fit:
        lo, best = base_batch, base
    else:
        hi = base_batch
    # A cold first step costs more than a warm one: budget probes with a margin.
    per_sample_s = 1.5 * 2 * min(base.step_times_s) / base_batch
    startup_s = max(0.0, base.wall_s - sum(base.step_times_s))
    spent_s, limited_by = 0.0, "memory"
    predicted = _predict(base, device_type, limit_bytes)
    last = None
    while True:
        if hi is not None and hi - lo <= 1:
            break
        if lo >= cap:
            limited_by = "cap"
            break
        if last is None and predicted is not None:
            b = predicted                 # first guess: linear extrapolation
        elif last is not None and last == predicted and hi is None:
            b = lo + 1                    # the prediction fit: confirm the edge above it
        elif last is not None and last == predicted and lo < predicted - 1:
            b = predicted - 1             # it did not: the edge is most likely just below
        elif hi is None:
            b = lo * 2 if lo else 1
        else:
            b = (lo + hi) // 2
        b = min(max(b, lo + 1), cap if hi is None else min(cap, hi - 1))   # never above cap
        estimate_s = startup_s + per_sample_s * b
        if spent_s + estimate_s > time_budget_s:
            limited_by = "time"
            break
        on_probe(b, None)
        result = probe(b)
        spent_s += result.wall_s or estimate_s
        ok = fits(result, device_type, limit_bytes)
        probes.append(Probe(batch=b, fits=ok, resident_bytes=result.resident_bytes,
                            cuda_peak_bytes=result.cuda_peak_bytes,
                            peak_rss_delta_bytes=result.peak_rss_delta_bytes,
                            step_s=result.median_step_s, reason=result.reason))
        on_probe(b, ok)
        last = b
        if ok is None:
            limited_by = f"probe at batch {b} failed: {result.reason}"
            break
        if ok:
            lo, best = b, result
        else:
            hi = b
    out = Found(lo or None, limited_by, probes)
    if best is not None and best.step_times_s:
        step_s = best.median_step_s
        out.max_batch_step_s = step_s
        out.max_batch_samples_per_s = lo / step_s
        if best.tokens_per_step:
            out.max_batch_tokens_per_s = best.tokens_per_step / step_s
    if lo == 0:
        out.max_batch_limited_by = "memory: not even batch 1 fits" if hi == 1 else limited_by
    return out
