"""Turning worker results into rows: one per strategy, every field always present.

A field that does not apply to a strategy (NVMe bytes of `recompute`, gradient check of an
unavailable row) is None, never missing: `--json` consumers can rely on the key set
:data:`ROW_FIELDS`.
"""
from __future__ import annotations

import statistics
from typing import Any

from offload.bench.measure import RAM_FS_TYPES
from offload.sizes import format_bytes

__all__ = ["ROW_FIELDS", "STATS_FIELDS", "make_row", "add_relative"]

# Fields of offload.activations' ctx.stats.as_dict() that a row carries.
STATS_FIELDS = (
    "kept_bytes", "host_bytes", "nvme_bytes", "nvme_written_bytes", "nvme_read_bytes",
    "packed_tensors", "peak_resident_bytes",
)
# Per-step rates: the row has the median over measured steps.
RATE_FIELDS = ("d2h_gbps", "h2d_gbps", "nvme_write_gbps", "nvme_read_gbps", "stall_s",
               "stall_forward_s", "stall_backward_s")

ROW_FIELDS = (
    # what ran
    "strategy", "description", "available", "reason", "error",
    "device", "device_name", "dtype", "model", "batch", "seq_len", "tokens_per_step",
    "warmup", "steps", "rounds",
    # time
    "step_s_median", "step_s_min", "step_s_max", "step_s_iqr", "step_times_s",
    "tokens_per_s", "samples_per_s", "overhead_vs_none",
    # memory
    "peak_activation_bytes", "peak_activation_source", "cuda_peak_bytes",
    "peak_rss_delta_bytes", "warmup_rss_delta_bytes", "pool_released_bytes",
    "memory_saved_bytes", "memory_saved_pct",
    "resident_bytes", "resident_source", "resident_saved_pct", "saved_bytes",
    "rss_unexplained_bytes", "resident_check", "nvme_direct", "nvme_fs_types", "nvme_in_ram",
    # tiers and transfers (offload rows)
    *STATS_FIELDS, *RATE_FIELDS,
    "runtime_stats",  # the whole ctx.stats.as_dict() of the first round's last step
    "build",  # offload.build_info() of the process that ran the benchmark
    # gradient check against none
    "bit_exact", "max_abs_diff", "grads_differ", "grads_differ_steps",
    # --max-batch
    "memory_limit_bytes", "max_batch", "max_batch_limited_by", "max_batch_step_s",
    "max_batch_tokens_per_s", "max_batch_samples_per_s", "max_batch_vs_none", "max_batch_probes",
    # --explain
    "plan", "nondeterministic_op", "torch_thp",
)


# The RSS cross-check (see add_relative): slack on top of the transient working set that
# `none` shows, for sampling and allocator noise.
CHECK_SLACK_MIN_BYTES = 32 << 20
CHECK_SLACK_FRACTION = 0.10


def _median_or_none(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def make_row(strategy: str, description: str, meta: dict[str, Any],
             results: list[dict[str, Any]], grad_check: tuple) -> dict[str, Any]:
    """Combine every round's worker result for `strategy` into one row.

    Times pool all measured steps of all rounds; memory is the largest peak of any round
    (conservative); bytes come from the first round (they are deterministic).
    """
    row: dict[str, Any] = dict.fromkeys(ROW_FIELDS)
    row.update(meta)
    row["strategy"], row["description"] = strategy, description
    ok = [r for r in results if r.get("available")]
    bad = [r for r in results if not r.get("available")]
    row["error"] = any(r.get("error") for r in results)
    if bad or not ok:
        row["available"] = False
        row["reason"] = bad[0]["reason"] if bad else "not run"
        return row
    row["available"] = True
    first = ok[0]
    row["device_name"] = first.get("device_name")
    row["tokens_per_step"] = first.get("tokens_per_step")
    times = [t for r in ok for t in r["step_times_s"]]
    row["step_times_s"] = times
    row["step_s_median"] = statistics.median(times)
    row["step_s_min"], row["step_s_max"] = min(times), max(times)
    if len(times) >= 2:
        q = statistics.quantiles(times, n=4, method="inclusive")
        row["step_s_iqr"] = q[2] - q[0]
    if row["tokens_per_step"]:
        row["tokens_per_s"] = row["tokens_per_step"] / row["step_s_median"]
    row["samples_per_s"] = (first.get("samples_per_step") or 0) / row["step_s_median"]

    cuda = [r["cuda_peak_bytes"] for r in ok if r.get("cuda_peak_bytes") is not None]
    rss = [r["peak_rss_delta_bytes"] for r in ok if r.get("peak_rss_delta_bytes") is not None]
    row["cuda_peak_bytes"] = max(cuda) if cuda else None
    warm = [r["warmup_rss_delta_bytes"] for r in ok if r.get("warmup_rss_delta_bytes") is not None]
    row["warmup_rss_delta_bytes"] = max(warm) if warm else None
    released = [r["pool_released_bytes"] for r in ok if r.get("pool_released_bytes") is not None]
    row["pool_released_bytes"] = max(released) if released else None
    directs = [r["nvme_direct"] for r in ok if r.get("nvme_direct") is not None]
    row["nvme_direct"] = all(directs) if directs else None
    row["nvme_fs_types"] = first.get("nvme_fs_types")
    if row["nvme_direct"] is not None:
        # Buffered I/O parks the bytes in the page cache, a RAM file system keeps them in
        # shmem: RAM either way, and not in the process's RSS (the table flags the row).
        ram_fs = any(t in RAM_FS_TYPES for t in row["nvme_fs_types"] or [])
        row["nvme_in_ram"] = (not row["nvme_direct"]) or ram_fs
    row["peak_rss_delta_bytes"] = max(rss) if rss else None
    if cuda:
        row["peak_activation_bytes"], row["peak_activation_source"] = max(cuda), "cuda allocator"
    elif rss:
        row["peak_activation_bytes"], row["peak_activation_source"] = max(rss), "process rss"
    residents = [r["resident_bytes"] for r in ok if r.get("resident_bytes") is not None]
    row["resident_bytes"] = max(residents) if residents else None
    row["saved_bytes"] = first.get("saved_bytes")
    row["resident_source"] = first.get("resident_source")

    stats = first.get("stats") or {}
    for name in STATS_FIELDS:
        row[name] = stats.get(name)
    row["runtime_stats"] = stats or None
    steps_stats = [s for r in ok for s in r.get("stats_steps") or [] if s]
    for name in RATE_FIELDS:
        row[name] = _median_or_none([s.get(name) for s in steps_stats])
    row["plan"] = next((r["plan"] for r in ok if r.get("plan")), None)
    row["nondeterministic_op"] = next((r["nondeterministic_op"] for r in ok
                                       if r.get("nondeterministic_op")), None)
    row["torch_thp"] = first.get("torch_thp")

    bit_exact, max_diff, differ, differ_steps = grad_check
    row["bit_exact"], row["max_abs_diff"] = bit_exact, max_diff
    row["grads_differ"] = differ[:10] if differ else ([] if bit_exact is not None else None)
    row["grads_differ_steps"] = differ_steps if bit_exact is not None else None
    return row


def add_relative(rows: list[dict[str, Any]], reference: str = "none") -> None:
    """Fill the fields relative to the reference row (overhead, memory saved)."""
    ref = next((r for r in rows if r["strategy"] == reference and r["available"]), None)
    if ref is None:
        return
    for row in rows:
        if not row["available"]:
            continue
        row["overhead_vs_none"] = row["step_s_median"] / ref["step_s_median"]
        if row["peak_activation_bytes"] is not None and ref["peak_activation_bytes"]:
            saved = ref["peak_activation_bytes"] - row["peak_activation_bytes"]
            row["memory_saved_bytes"] = saved
            row["memory_saved_pct"] = 100.0 * saved / ref["peak_activation_bytes"]
        if row["resident_bytes"] is not None and ref["resident_bytes"]:
            row["resident_saved_pct"] = 100.0 * (1 - row["resident_bytes"] / ref["resident_bytes"])
        if row["max_batch"] and ref["max_batch"]:
            row["max_batch_vs_none"] = row["max_batch"] / ref["max_batch"]
    _cross_check(rows, ref)


def _cross_check(rows: list[dict[str, Any]], ref: dict[str, Any]) -> None:
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
    if ref["peak_activation_source"] != "process rss" or ref["resident_bytes"] is None:
        return
    transient = max(0, ref["peak_rss_delta_bytes"] - ref["resident_bytes"])
    slack = max(CHECK_SLACK_MIN_BYTES, int(CHECK_SLACK_FRACTION * ref["peak_rss_delta_bytes"]))
    for row in rows:
        if (not row["available"] or row["peak_activation_source"] != "process rss"
                or row["resident_bytes"] is None):
            continue
        unexplained = row["peak_rss_delta_bytes"] - row["resident_bytes"]
        row["rss_unexplained_bytes"] = unexplained
        if row is ref:
            row["resident_check"] = "reference (sets the transient allowance)"
        elif unexplained > transient + slack:
            row["resident_check"] = (
                f"RSS grew {format_bytes(unexplained - transient)} more than resident bytes "
                f"plus none's transient set explain (allowed slack {format_bytes(slack)})")
        else:
            row["resident_check"] = "ok"
