"""One row per strategy: the typed record behind the table, ``--json`` and ``--plot``.

:class:`Row` is the single definition of what a row holds; :func:`make_row` fills it from
every round's :class:`~offload.bench.result.RunResult`, :func:`add_relative` adds what is
relative to ``none``, and :func:`to_json` / :func:`from_json` are the ``--json`` file
(schema in docs/benchmarks.md, versioned by :data:`SCHEMA_VERSION`). A field that does not
apply to a strategy (NVMe bytes of ``checkpoint``, the gradient check of an unavailable
row) is None, never missing.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from offload.bench.measure import RAM_FS_TYPES
from offload.bench.result import RunResult
from offload.util.sizes import format_bytes

__all__ = ["Row", "Meta", "Probe", "ROW_FIELDS", "SCHEMA", "SCHEMA_VERSION", "make_row",
           "add_relative", "to_json", "from_json", "STATS_FIELDS", "RATE_FIELDS"]

# The --json file: {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "rows": [Row, ...]}.
# Bump the version when a field is renamed, removed or changes meaning (adding one is not).
SCHEMA = "offload-bench.rows"
SCHEMA_VERSION = 1

# Fields of offload.activations' ctx.stats.as_dict() that a row carries (first round).
STATS_FIELDS = (
    "kept_bytes", "host_bytes", "nvme_bytes", "nvme_written_bytes", "nvme_read_bytes",
    "packed_tensors", "peak_resident_bytes",
)
# Per-step rates: the row has the median over measured steps.
RATE_FIELDS = ("d2h_gbps", "h2d_gbps", "nvme_write_gbps", "nvme_read_gbps", "stall_s",
               "stall_forward_s", "stall_backward_s")


@dataclass
class Meta:
    """What every row of one benchmark shares: the model and how it was run."""

    device: str
    dtype: str
    model: str
    batch: int
    seq_len: int | None
    warmup: int
    steps: int
    rounds: int
    memory_limit_bytes: int | None = None


@dataclass
class Probe:
    """One --max-batch probe: a fresh worker at `batch`."""

    batch: int
    fits: bool | None
    resident_bytes: int | None
    cuda_peak_bytes: int | None
    peak_rss_delta_bytes: int | None
    step_s: float | None
    reason: str | None


@dataclass
class Row:
    # what ran
    strategy: str
    description: str = ""
    available: bool = False
    reason: str | None = None
    error: bool = False
    device: str | None = None
    device_name: str | None = None
    dtype: str | None = None
    model: str | None = None
    batch: int | None = None
    seq_len: int | None = None
    tokens_per_step: int | None = None
    warmup: int | None = None
    steps: int | None = None
    rounds: int | None = None
    blocks: list[str] | None = None
    # time
    step_s_median: float | None = None
    step_s_min: float | None = None
    step_s_max: float | None = None
    step_s_iqr: float | None = None
    step_times_s: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    samples_per_s: float | None = None
    overhead_vs_none: float | None = None
    untimed_steps: int | None = None  # before the timed ones: warm-up, profile, trials
    unsettled: str | None = None      # why it was timed before it settled (Strategy.unsettled)
    # memory
    peak_activation_bytes: int | None = None
    peak_activation_source: str | None = None  # "cuda allocator" | "process rss"
    cuda_peak_bytes: int | None = None
    peak_rss_delta_bytes: int | None = None
    warmup_rss_delta_bytes: int | None = None
    pool_released_bytes: int | None = None
    memory_saved_bytes: int | None = None
    memory_saved_pct: float | None = None
    resident_bytes: int | None = None
    resident_source: str | None = None
    resident_saved_pct: float | None = None
    saved_bytes: int | None = None
    rss_unexplained_bytes: int | None = None
    resident_check: str | None = None
    nvme_direct: bool | None = None
    nvme_fs_types: list[str | None] | None = None
    nvme_in_ram: bool | None = None
    # tiers and transfers (offload rows): STATS_FIELDS, RATE_FIELDS
    kept_bytes: int | None = None
    host_bytes: int | None = None
    nvme_bytes: int | None = None
    nvme_written_bytes: int | None = None
    nvme_read_bytes: int | None = None
    packed_tensors: int | None = None
    peak_resident_bytes: int | None = None
    d2h_gbps: float | None = None
    h2d_gbps: float | None = None
    nvme_write_gbps: float | None = None
    nvme_read_gbps: float | None = None
    stall_s: float | None = None
    stall_forward_s: float | None = None
    stall_backward_s: float | None = None
    runtime_stats: dict[str, Any] | None = None  # ctx.stats.as_dict(), first round's last step
    build: dict[str, Any] | None = None          # offload.build_info() of the benchmark
    # gradient check against none
    bit_exact: bool | None = None
    max_abs_diff: float | None = None
    grads_differ: list[str] | None = None
    grads_differ_steps: list[int] | None = None
    # --max-batch
    memory_limit_bytes: int | None = None
    max_batch: int | None = None
    max_batch_limited_by: str | None = None
    max_batch_step_s: float | None = None
    max_batch_tokens_per_s: float | None = None
    max_batch_samples_per_s: float | None = None
    max_batch_vs_none: float | None = None
    max_batch_probes: list[Probe] | None = None
    # --explain and caveats
    plan: str | None = None
    nondeterministic_op: str | None = None
    torch_thp: bool | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Row":
        data = {k: _named_float(v) if k in _FLOAT_FIELDS else v for k, v in data.items()}
        if data.get("runtime_stats") is not None:   # ctx.stats: numbers, and a few strings
            data["runtime_stats"] = {k: _named_float(v)
                                     for k, v in data["runtime_stats"].items()}
        if data.get("max_batch_probes") is not None:
            data["max_batch_probes"] = [Probe(**{**p, "step_s": _named_float(p["step_s"])})
                                        for p in data["max_batch_probes"]]
        return cls(**data)


ROW_FIELDS = tuple(f.name for f in dataclasses.fields(Row))
_FLOAT_FIELDS = frozenset(f.name for f in dataclasses.fields(Row) if "float" in str(f.type))

# The RSS cross-check (see add_relative): slack on top of the transient working set that
# `none` shows, for sampling and allocator noise.
CHECK_SLACK_MIN_BYTES = 32 << 20
CHECK_SLACK_FRACTION = 0.10


def _median_or_none(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _max_or_none(values: list[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def make_row(strategy: str, description: str, meta: Meta, results: list[RunResult],
             grad_check: tuple) -> Row:
    """Combine every round's worker result for `strategy` into one row.

    Times pool all measured steps of all rounds; memory is the largest peak of any round
    (conservative); bytes come from the first round (they are deterministic).
    """
    row = Row(strategy=strategy, description=description, **dataclasses.asdict(meta))
    ok = [r for r in results if r.available]
    bad = [r for r in results if not r.available]
    row.error = any(r.error for r in results)
    if bad or not ok:
        row.reason = bad[0].reason if bad else "not run"
        return row
    row.available = True
    first = ok[0]
    row.device_name, row.tokens_per_step, row.blocks = (first.device_name, first.tokens_per_step,
                                                        first.blocks)
    times = [t for r in ok for t in r.step_times_s]
    row.step_times_s = times
    row.step_s_median = statistics.median(times)
    row.step_s_min, row.step_s_max = min(times), max(times)
    if len(times) >= 2:
        q = statistics.quantiles(times, n=4, method="inclusive")
        row.step_s_iqr = q[2] - q[0]
    row.untimed_steps = _max_or_none([r.untimed_steps for r in ok])
    row.unsettled = next((r.unsettled for r in ok if r.unsettled), None)
    if row.tokens_per_step:
        row.tokens_per_s = row.tokens_per_step / row.step_s_median
    row.samples_per_s = (first.samples_per_step or 0) / row.step_s_median

    row.cuda_peak_bytes = _max_or_none([r.cuda_peak_bytes for r in ok])
    row.peak_rss_delta_bytes = _max_or_none([r.peak_rss_delta_bytes for r in ok])
    row.warmup_rss_delta_bytes = _max_or_none([r.warmup_rss_delta_bytes for r in ok])
    row.pool_released_bytes = _max_or_none([r.pool_released_bytes for r in ok])
    directs = [r.nvme_direct for r in ok if r.nvme_direct is not None]
    row.nvme_direct = all(directs) if directs else None
    row.nvme_fs_types = first.nvme_fs_types
    if row.nvme_direct is not None:
        # Buffered I/O parks the bytes in the page cache, a RAM file system keeps them in
        # shmem: RAM either way, and not in the process's RSS (the table flags the row).
        ram_fs = any(t in RAM_FS_TYPES for t in row.nvme_fs_types or [])
        row.nvme_in_ram = (not row.nvme_direct) or ram_fs
    if row.cuda_peak_bytes is not None:
        row.peak_activation_bytes, row.peak_activation_source = row.cuda_peak_bytes, \
            "cuda allocator"
    elif row.peak_rss_delta_bytes is not None:
        row.peak_activation_bytes, row.peak_activation_source = row.peak_rss_delta_bytes, \
            "process rss"
    row.resident_bytes = _max_or_none([r.resident_bytes for r in ok])
    row.saved_bytes, row.resident_source = first.saved_bytes, first.resident_source

    stats = first.stats or {}
    for name in STATS_FIELDS:
        setattr(row, name, stats.get(name))
    row.runtime_stats = stats or None
    steps_stats = [s for r in ok for s in r.stats_steps if s]
    for name in RATE_FIELDS:
        setattr(row, name, _median_or_none([s.get(name) for s in steps_stats]))
    row.plan = next((r.plan for r in ok if r.plan), None)
    row.nondeterministic_op = next((r.nondeterministic_op for r in ok
                                    if r.nondeterministic_op), None)
    row.torch_thp = first.torch_thp

    bit_exact, max_diff, differ, differ_steps = grad_check
    row.bit_exact, row.max_abs_diff = bit_exact, max_diff
    row.grads_differ = differ[:10] if differ else ([] if bit_exact is not None else None)
    row.grads_differ_steps = differ_steps if bit_exact is not None else None
    return row


def add_relative(rows: list[Row], reference: str = "none") -> None:
    """Fill the fields relative to the reference row (overhead, memory saved)."""
    ref = next((r for r in rows if r.strategy == reference and r.available), None)
    if ref is None:
        return
    for row in rows:
        if not row.available:
            continue
        row.overhead_vs_none = row.step_s_median / ref.step_s_median
        if row.peak_activation_bytes is not None and ref.peak_activation_bytes:
            saved = ref.peak_activation_bytes - row.peak_activation_bytes
            row.memory_saved_bytes = saved
            row.memory_saved_pct = 100.0 * saved / ref.peak_activation_bytes
        if row.resident_bytes is not None and ref.resident_bytes:
            row.resident_saved_pct = 100.0 * (1 - row.resident_bytes / ref.resident_bytes)
        if row.max_batch and ref.max_batch:
            row.max_batch_vs_none = row.max_batch / ref.max_batch
    _cross_check(rows, ref)


def _cross_check(rows: list[Row], ref: Row) -> None:
    """CPU: does the resident-bytes accounting explain the measured RSS growth?

    The two memory columns come from different instruments (rss from the kernel; resident
    bytes from a saved-tensor hook or the runtime's own counter, see ``resident_source``).
    Every strategy runs the same computation, so each needs about the same transient
    working set on top of what it keeps (temporaries, activation gradients): `none` measures
    it as its RSS growth minus its resident bytes. A row whose RSS growth exceeds its
    resident bytes (staging arena included) by more than that, plus a slack of
    max(32 MiB, 10% of `none`'s RSS growth), holds memory its accounting does not show:
    ``resident_check`` says so, and the table flags the row. (The check cannot see memory
    that is in neither instrument: page cache of buffered NVMe I/O, see ``nvme_direct``.)
    """
    if ref.peak_activation_source != "process rss" or ref.resident_bytes is None:
        return
    transient = max(0, ref.peak_rss_delta_bytes - ref.resident_bytes)
    slack = max(CHECK_SLACK_MIN_BYTES, int(CHECK_SLACK_FRACTION * ref.peak_rss_delta_bytes))
    for row in rows:
        if (not row.available or row.peak_activation_source != "process rss"
                or row.resident_bytes is None):
            continue
        unexplained = row.peak_rss_delta_bytes - row.resident_bytes
        row.rss_unexplained_bytes = unexplained
        if row is ref:
            row.resident_check = "reference (sets the transient allowance)"
        elif unexplained > transient + slack:
            row.resident_check = (
                f"RSS grew {format_bytes(unexplained - transient)} more than resident bytes "
                f"plus none's transient set explain (allowed slack {format_bytes(slack)})")
        else:
            row.resident_check = "ok"


# JSON has no infinity or NaN (Python writes `Infinity`, which other parsers refuse and jq
# reads as 1.8e308): such a figure (an infinite max_abs_diff) is written as a string.
_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _finite_or_named(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite_or_named(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_named(v) for v in value]
    return value


def _named_float(value: Any) -> Any:
    """`_finite_or_named` undone for a float field (or a list of floats)."""
    if isinstance(value, str):
        return _NON_FINITE.get(value, value)
    if isinstance(value, list):
        return [_named_float(v) for v in value]
    return value


def to_json(rows: list[Row]) -> str:
    """The --json document: every row, every field (docs/benchmarks.md, *JSON*)."""
    doc = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION,
           "rows": [_finite_or_named(dataclasses.asdict(r)) for r in rows]}
    return json.dumps(doc, indent=2, allow_nan=False) + "\n"


def from_json(text: str) -> list[Row]:
    """Rows of a --json document written by this or an older-compatible version.

    Raises:
        ValueError: not an offload-bench document, or a schema version this code cannot read.
    """
    doc = json.loads(text)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"not an offload-bench --json document (expected schema {SCHEMA!r})")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(f"offload-bench --json schema_version {doc.get('schema_version')!r}: "
                         f"this version reads {SCHEMA_VERSION} (rerun the benchmark)")
    return [Row.from_dict(r) for r in doc["rows"]]
