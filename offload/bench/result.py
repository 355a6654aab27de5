"""What one worker run measured: written by the worker, read by the parent.

A worker (one strategy, one round, one batch) writes a :class:`RunResult` as a JSON file;
the parent reads it back and combines every round of a strategy into its row
(:mod:`offload.bench.rows`). A field that a run did not measure is None, never missing.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunResult", "OUT_OF_MEMORY", "TIMED_OUT", "KILLED_OOM"]

# How the reasons of failed runs say why (worker.py, runner.py); the table's last line
# counts the rows by them (cli.py `_why_nothing`).
OUT_OF_MEMORY = "out of memory"                         # a reason that starts so
TIMED_OUT = "worker timed out"                          # ... that holds it
KILLED_OOM = "SIGKILL: out of memory, most likely"      # ... that holds it


@dataclass
class RunResult:
    strategy: str
    batch: int
    available: bool = False
    reason: str | None = None          # why not available / what failed
    error: bool = False                # the strategy failed (not merely unavailable here)
    oom: bool = False                  # it ran out of device memory at this batch
    wall_s: float = 0.0                # the worker process, start to end (parent's clock)
    nvme_leftover_files: int = 0       # files the run left in the NVMe directory (a bug)
    device_name: str | None = None
    blocks: list[str] | None = None    # the checkpointed blocks (schedule/blocks.py), by name
    tokens_per_step: int | None = None
    samples_per_step: int | None = None
    # time
    step_times_s: list[float] = field(default_factory=list)
    untimed_steps: int | None = None   # steps before the timed ones (warm-up, settling)
    unsettled: str | None = None       # why the timed steps began before the strategy settled
    # memory (see measure's module doc)
    cuda_peak_bytes: int | None = None
    cuda_total_bytes: int | None = None
    cuda_base_bytes: int | None = None
    peak_rss_delta_bytes: int | None = None
    warmup_rss_delta_bytes: int | None = None
    pool_released_bytes: int | None = None
    resident_bytes: int | None = None
    resident_source: str | None = None
    saved_bytes: int | None = None
    # the offload runtime
    stats: dict[str, Any] | None = None               # ctx.stats.as_dict() of the last step
    stats_steps: list[dict[str, Any] | None] = field(default_factory=list)  # every timed step
    nvme_direct: bool | None = None
    nvme_fs_types: list[str | None] | None = None
    plan: str | None = None
    torch_thp: bool | None = None
    # gradients
    grads_path: str | None = None
    grad_hashes: list[dict[str, Any]] = field(default_factory=list)
    nondeterministic_op: str | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RunResult":
        return cls(**json.loads(text))

    @property
    def median_step_s(self) -> float | None:
        return statistics.median(self.step_times_s) if self.step_times_s else None
