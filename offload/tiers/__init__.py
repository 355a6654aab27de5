"""Where offloaded activations live: `host` (RAM; pinned for CUDA sources) and `nvme`
(slab files written by the C++ engine). Each tier stores and loads flat byte payloads
(base.py); the runtime (offload/runtime/) handles dtypes, shapes and views.

The registry: a tier is known by its class's `name`, opened by its `open` classmethod, and
reports its own figures (`Tier.report`); nothing else dispatches on a tier's name.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..util import stats as _stats
from .base import Payload, Tier
from .host import HostTier
from .nvme import NvmeTier

__all__ = ["REGISTRY", "names", "open_tiers", "Tier", "Payload"]

REGISTRY: dict[str, type[Tier]] = {cls.name: cls for cls in (HostTier, NvmeTier)}
_stats.TIER_NAMES[0] = tuple(REGISTRY)


def names() -> tuple[str, ...]:
    """The registered tiers' names, in spill order of the default OFFLOAD_TIERS."""
    return tuple(REGISTRY)


def open_tiers(config, stats, copies: Callable[[torch.device], Any]) -> dict[str, Tier]:
    """The tiers `config.tiers` names, opened for one step (closed again if one fails)."""
    tiers: dict[str, Tier] = {}
    try:
        for name in config.tiers:
            tiers[name] = REGISTRY[name].open(config, stats, copies)
    except BaseException:
        for tier in tiers.values():
            tier.close(reuse=False)
        raise
    return tiers
