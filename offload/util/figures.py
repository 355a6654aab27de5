"""The machine figures the scheduler plans with, and how a user overrides them.

`Figures` is plain data (no torch): what the probe measured (offload/schedule/probe.py), read
back from its cache, or given with OFFLOAD_PROBE. Rates are in GB/s (1e9 bytes per second),
times in seconds. A figure that does not apply here (PCIe on a CPU-only run, NVMe without
an `nvme` tier) is None.

`parse_probe_setting` is the parser of OFFLOAD_PROBE, kept here (not in config_parse.py) so the
list of figure names has one owner.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["Figures", "FIGURE_DOCS", "ProbeSetting", "parse_probe_setting"]

# name -> (unit, what it is). The order is the order the probe command prints them in.
FIGURE_DOCS: dict[str, tuple[str, str]] = {
    "compute_gflops": ("GFLOP/s", "dense matmul rate of the device (fp32 on CPU, bf16 on CUDA)"),
    "dispatch_op_s": ("s", "extra host time per op under a Python dispatch mode (the cost of "
                           "per-op recompute bookkeeping)"),
    "d2h_gbps": ("GB/s", "device to pinned host copy, large transfers"),
    "h2d_gbps": ("GB/s", "pinned host to device copy, large transfers"),
    "d2h_small_gbps": ("GB/s", "device to pinned host copy of 1 MiB transfers"),
    "copy_issue_s": ("s", "host time to issue one device copy on a side stream with its event"),
    "nvme_write_gbps": ("GB/s", "writes through our O_DIRECT engine to OFFLOAD_NVME_DIR"),
    "nvme_read_gbps": ("GB/s", "reads through our O_DIRECT engine from OFFLOAD_NVME_DIR"),
    "nvme_issue_s": ("s", "host time to submit one write request to the engine"),
}


@dataclass(frozen=True)
class Figures:
    """One machine's figures; `sources` says where each came from (measured, cache, ...)."""

    compute_gflops: float | None = None
    dispatch_op_s: float | None = None
    d2h_gbps: float | None = None
    h2d_gbps: float | None = None
    d2h_small_gbps: float | None = None
    copy_issue_s: float | None = None
    nvme_write_gbps: float | None = None
    nvme_read_gbps: float | None = None
    nvme_issue_s: float | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def replace(self, source: str, **values: Any) -> "Figures":
        """A copy with `values` set, each marked as coming from `source`."""
        sources = dict(self.sources)
        sources.update({k: source for k in values})
        return dataclasses.replace(self, **values, sources=sources)

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FIGURE_DOCS}

    def entries(self) -> list[tuple[str, str, str]]:
        """(name, value with its unit, where it came from) of every figure that is set."""
        out = []
        for name, (unit, _) in FIGURE_DOCS.items():
            value = getattr(self, name)
            if value is None:
                continue
            text = f"{value * 1e6:.1f} µs" if unit == "s" else f"{value:.3g} {unit}"
            out.append((name, text, self.sources.get(name, "")))
        return out

    def describe(self) -> str:
        """One line, for the plan's INFO log and `ctx.plan`."""
        return ", ".join(f"{name}={text}" + (f" ({source})" if source else "")
                         for name, text, source in self.entries()) or "none"


@dataclass(frozen=True)
class ProbeSetting:
    """OFFLOAD_PROBE parsed: measure again or not, and figures given by the user."""

    refresh: bool = False
    overrides: Mapping[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        if self.overrides:
            return ",".join(f"{k}={v:g}" for k, v in self.overrides.items())
        return "refresh" if self.refresh else "cached"


def parse_probe_setting(raw: Any, where: str) -> ProbeSetting:
    """Parse `cached`, `refresh`, or `name=value,...` (a dict also works as a keyword).

    Raises:
        ValueError: with the reason and what to do (config.py turns it into ConfigError).
    """
    if isinstance(raw, ProbeSetting):
        return raw
    if isinstance(raw, Mapping):
        items = list(raw.items())
    else:
        text = str(raw).strip()
        if text.lower() in ("cached", ""):
            return ProbeSetting()
        if text.lower() == "refresh":
            return ProbeSetting(refresh=True)
        items = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"{where}: {part!r} is neither 'cached', 'refresh' nor "
                                 "name=value (e.g. OFFLOAD_PROBE=nvme_write_gbps=0.2,"
                                 "nvme_read_gbps=0.2)")
            items.append((name.strip(), value.strip()))
    overrides: dict[str, float] = {}
    for name, value in items:
        if name not in FIGURE_DOCS:
            close = difflib.get_close_matches(name, list(FIGURE_DOCS), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"{where}: unknown figure {name!r} ({hint}known figures: "
                             f"{', '.join(FIGURE_DOCS)})")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: {name}={value!r} is not a number (give e.g. "
                             f"{name}=0.5)") from None
        if not (number > 0 and math.isfinite(number)):
            raise ValueError(f"{where}: {name}={value!r} must be a positive, finite number")
        overrides[name] = number
    return ProbeSetting(overrides=overrides)
