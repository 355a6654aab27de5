"""torch's parametrization cache as it was at a block's call, for its re-run.

NOTE [Parametrization cache in a re-run] Inside `torch.nn.utils.parametrize.cached()`, the
first read of a parametrized weight (weight_norm, orthogonal, a user's parametrization)
computes it and later reads take that tensor from a module-global cache, until the
outermost `cached()` exits. A block's re-run in backward ran under whatever the cache held
then: outside `cached()` (the docstring's own use: around the forward only) it computed a
weight the forward took from the cache, inside it (around forward and backward) it took
one the forward had computed. Either way it saved other tensors than the forward; checkpoint
matches saves by position and compares only shape, dtype and device, so the backward got
the wrong ones (silently where those agree: gradients off by 1e2 on a tied
encoder/decoder) or raised its CheckpointError at every step. The re-run now runs under
the cache as it was at the call: on or off as then, holding the entries made before the
call (an earlier block's shared weight: the same tensor the forward took), not those the
forward made itself (the re-run makes them again, as the forward did). The cache is a
module global, swapped for the re-run's time: another thread's parametrized modules see
the re-run's meanwhile. What it costs: a
read of one integer per call; under `cached()`, a copy of its (small) dict per call.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.nn.utils.parametrize as parametrize

__all__ = ["guard_parametrize_cache"]


def guard_parametrize_cache(fn: Callable) -> Callable:
    """`fn` (the function checkpoint runs, forward then re-runs) with its re-runs under the
    parametrization cache as it was at the forward (NOTE [Parametrization cache in a
    re-run])."""
    calls = 0
    enabled = 0
    entries: dict | None = None

    def run(*args) -> Any:
        nonlocal calls, enabled, entries
        calls += 1
        if calls == 1:
            enabled = getattr(parametrize, "_cache_enabled", 0)
            entries = dict(parametrize._cache) if enabled else None
            return fn(*args)
        if not enabled and not getattr(parametrize, "_cache_enabled", 0):
            return fn(*args)
        now = parametrize._cache_enabled, parametrize._cache
        parametrize._cache_enabled = enabled
        parametrize._cache = dict(entries) if entries is not None else {}
        try:
            return fn(*args)
        finally:
            parametrize._cache_enabled, parametrize._cache = now

    return run
