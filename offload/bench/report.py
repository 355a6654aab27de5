"""Presenting rows: the rich table, ``--json``, ``--plot``, ``--explain``."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from offload.bench.rows import Row, to_json
from offload.util.output_files import write_output_file
from offload.util.sizes import format_bytes

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["print_table", "footnotes", "write_json", "write_plot", "plot_unavailable_reason",
           "plot_format_problem", "explain_text"]


def _bytes(v: int | None) -> str:
    return "—" if v is None else format_bytes(v)


def _time(row: Row) -> str:
    if row.step_s_median is None:
        return "—"
    return f"{row.step_s_median:.2f} ({row.step_s_min:.2f}–{row.step_s_max:.2f})"


def _overhead(row: Row) -> str:
    v = row.overhead_vs_none
    return "—" if v is None else f"{v:.2f}x"


def _saved(row: Row) -> str:
    if row.strategy == "none" or row.memory_saved_pct is None:
        return "—"
    return f"{round(row.memory_saved_pct):+d}%"   # an int: -0.3 shows "+0%", not "-0%"


def _tiers(row: Row) -> str:
    if row.kept_bytes is None and row.host_bytes is None and row.nvme_bytes is None:
        return "—"
    return " / ".join(_bytes(getattr(row, k)) for k in ("kept_bytes", "host_bytes", "nvme_bytes"))


def _rates(row: Row) -> str:
    parts = []
    for label, w, r in (("pcie", "d2h_gbps", "h2d_gbps"),
                        ("nvme", "nvme_write_gbps", "nvme_read_gbps")):
        if getattr(row, w) or getattr(row, r):
            parts.append(f"{label} {getattr(row, w) or 0:.1f}/{getattr(row, r) or 0:.1f}")
    return ", ".join(parts) or "—"


def _stall(row: Row) -> str:
    return "—" if row.stall_s is None else f"{row.stall_s:.2f}"


def _grads(row: Row) -> str:
    if row.bit_exact is None:
        return "ref" if row.strategy == "none" and row.available else "—"
    if row.bit_exact:
        return "bit-exact"
    if row.max_abs_diff:
        return f"[bold red]DIFF[/] {row.max_abs_diff:.2g}"
    # The last step matched; an earlier one did not (its tensors are not kept, only CRCs);
    # or equal values in other bits (a zero's sign, a NaN's payload).
    steps = ",".join(str(k + 1) for k in row.grads_differ_steps or [])
    return f"[bold red]DIFF[/] step {steps}" if steps else "[bold red]DIFF[/] bits"


# The rows that wrap the blocks (strategies.py): the footnote naming them is for these.
_CHECKPOINTING = ("checkpoint", "recompute", "ckpt+save_on_cpu")

# Footnote marks: buffered NVMe I/O (memory cells), RSS the accounting does not explain.
_BUFFERED, _UNEXPLAINED = "†", "‡"


def _buffered(row: Row) -> bool:
    return bool(row.nvme_in_ram)


def _unexplained(row: Row) -> bool:
    return (row.resident_check or "ok").startswith("RSS grew")


def _mem_cell(text: str, row: Row) -> str:
    return text + _BUFFERED if _buffered(row) and text != "—" else text


def _max_batch(row: Row) -> str:
    if row.max_batch is None:
        return "—"
    text = str(row.max_batch)
    if row.max_batch_limited_by in ("cap", "time"):
        text = "≥" + text
    if row.max_batch_vs_none and row.strategy != "none":
        text += f" ({row.max_batch_vs_none:.1f}x)"
    rate = row.max_batch_tokens_per_s or row.max_batch_samples_per_s
    if rate:
        unit = "tok/s" if row.max_batch_tokens_per_s else "samples/s"
        text += f", {rate:,.0f} {unit}"
    return text


def title(rows: list[Row], sep: str = " ") -> str:
    """What ran, on what; `sep` goes between its two halves (a newline for a plot's title,
    which does not wrap)."""
    r = rows[0]
    seq = f", seq {r.seq_len}" if r.seq_len else ""
    # The device's name from a row that ran (none may have failed before it said it).
    name = next((x.device_name for x in rows if x.device_name), None) or "?"
    return (f"offload-bench: {r.model}, batch {r.batch}{seq}, {r.dtype},{sep}"
            f"{r.device} ({name}); {r.steps} timed step(s) after "
            f"{r.warmup} warm-up, {r.rounds} round(s)")


def print_table(rows: list[Row], console: Console) -> None:
    """The human table, plus one line per strategy that could not run."""
    from rich.table import Table

    gpu = any(r.peak_activation_source == "cuda allocator" for r in rows)
    # The title goes above the table, not in it: rich wraps a table's title to the table's
    # width mid-phrase, padding the lines with spaces where stdout is a file.
    console.print(title(rows), soft_wrap=True, highlight=False)
    table = Table(title_justify="left")
    table.add_column("strategy", no_wrap=True)
    table.add_column("step s\nmedian (min–max)", justify="right")
    table.add_column("vs none", justify="right")
    table.add_column("peak act. mem\n" + ("(GPU allocator)" if gpu else "(RSS growth)"),
                     justify="right")
    table.add_column("saved\nvs none", justify="right")
    table.add_column("resident\nactivations", justify="right")
    table.add_column("kept / host / nvme", justify="right")
    table.add_column("GB/s\nwrite/read", justify="right")
    table.add_column("stall s", justify="right")
    table.add_column("grads\nvs none", justify="right")
    show_max = any(r.max_batch is not None or r.max_batch_limited_by for r in rows)
    if show_max:
        table.add_column("max batch", justify="right")
    for row in rows:
        if not row.available:
            continue
        resident = _bytes(row.resident_bytes) + (_UNEXPLAINED if _unexplained(row) else "")
        cells = [row.strategy, _time(row), _overhead(row),
                 _mem_cell(_bytes(row.peak_activation_bytes), row),
                 _mem_cell(_saved(row), row), _mem_cell(resident, row), _tiers(row),
                 _rates(row), _stall(row), _grads(row)]
        if show_max:
            cells.append(_max_batch(row))
        table.add_row(*cells)
    console.print(table)
    for row in rows:
        if not row.available:
            label = "failed" if row.error else "not available"
            reason = row.reason or ""
            if reason.startswith("failed: "):
                reason = reason[len("failed: "):]
            console.print(f"  {row.strategy}: {label}: {reason}", highlight=False,
                          markup=False)
    for line in footnotes(rows):
        console.print(line, highlight=False, markup=False)
    limited = [r for r in rows if r.max_batch_limited_by
               and r.max_batch_limited_by not in ("memory", "cap", "time")]
    for row in limited:
        console.print(f"  {row.strategy}: max batch: {row.max_batch_limited_by}",
                      highlight=False, markup=False)


# A baseline whose slowest timed step took this many times its fastest: said under the table.
NOISY_SPREAD = 1.3


def footnotes(rows: list[Row]) -> list[str]:
    """Lines under the table: where each memory number comes from, and its caveats."""
    shown = [r for r in rows if r.available]
    lines = []
    blocks = next((r.blocks for r in shown if r.blocks), None)
    checkpointing = list(dict.fromkeys(r.strategy for r in shown if r.strategy in _CHECKPOINTING))
    if blocks and checkpointing:
        names = ", ".join(blocks) if len(blocks) <= 3 else f"{blocks[0]} … {blocks[-1]}"
        which = checkpointing[0] if len(checkpointing) == 1 else \
            ", ".join(checkpointing[:-1]) + " and " + checkpointing[-1]
        lines.append(f"  blocks (checkpointed by the {which} row{'s' * (len(checkpointing) > 1)}"
                     f"; policy=recompute's, offload/schedule/blocks.py): {len(blocks)}, "
                     f"{names}")
    sources: dict[str, list[str]] = {}
    for r in shown:
        if r.resident_source:
            sources.setdefault(r.resident_source, []).append(r.strategy)
    if sources:
        lines.append("  resident activations: " + "; ".join(
            f"{', '.join(names)}: {src}" for src, names in sources.items()))
    if any(r.peak_activation_source == "process rss" for r in shown):
        released = [r for r in shown if r.pool_released_bytes]
        text = ("  peak act. mem: RSS growth over the timed steps above the warm-up's end; "
                "arenas the runtime keeps between steps were dropped first and count again")
        if released:
            text += " (" + ", ".join(f"{r.strategy} {format_bytes(r.pool_released_bytes)}"
                                     for r in released) + ")"
        lines.append(text)
    for r in shown:
        if _buffered(r):
            why = ("buffered NVMe I/O (O_DIRECT refused), so the written bytes sit in the "
                   "page cache" if r.nvme_direct is False else
                   f"the NVMe directory is on {'/'.join(sorted(set(r.nvme_fs_types)))}, "
                   "so the written bytes stay in RAM")
            lines.append(f"  {_BUFFERED} {r.strategy}: {why}, which RSS does not count: "
                         "its memory numbers understate the RAM it uses (use --nvme-dir on "
                         "a disk)")
        if _unexplained(r):
            why = "its resident-bytes accounting misses memory"
            if r.device == "cpu" and r.nvme_bytes:
                # heap.py: with the default OFFLOAD_CPU_HEAP=reuse glibc keeps freed
                # activation memory (and its fragmentation) for the next allocation.
                why = ("memory freed during the step that glibc keeps for reuse "
                       "(OFFLOAD_CPU_HEAP=reuse, the default; =release returns it to the OS "
                       "at about twice the page faults)")
            lines.append(f"  {_UNEXPLAINED} {r.strategy}: {r.resident_check}: {why}")
    for r in shown:
        stats = r.runtime_stats or {}
        if stats.get("full_kept_bytes"):
            # The runtime's warning saying so went to the worker's log, which is gone.
            sizes = ", ".join(f"{name} {format_bytes(stats[f'{name}_capacity_bytes'])}"
                              for name in ("host", "nvme")
                              if stats.get(f"{name}_capacity_bytes"))
            lines.append(f"  {r.strategy}: its tiers were full: "
                         f"{format_bytes(stats['full_kept_bytes'])} of a step's saves stayed "
                         f"where they were (room: {sizes or 'none'}; OFFLOAD_HOST_BYTES / "
                         "OFFLOAD_NVME_BYTES, or the disk's free space), so its memory "
                         "figures are not those of moving everything")
    for r in shown:
        if r.unsettled:
            lines.append(f"  {r.strategy}: had not settled after {r.untimed_steps} untimed steps "
                         f"({r.unsettled}), so its times are not yet what a longer run gets")
        elif r.untimed_steps and r.warmup is not None and r.untimed_steps > r.warmup:
            lines.append(f"  {r.strategy}: timed after {r.untimed_steps} untimed steps "
                         f"({r.warmup} warm-up, then until it settled"
                         + (": its profile and trial steps" if r.strategy == "auto" else "")
                         + "), so its times are those of what it settled on")
    base = next((r for r in shown if r.strategy == "none"), None)
    if base is not None and base.step_s_min and base.step_s_max and \
            base.step_s_max > NOISY_SPREAD * base.step_s_min:
        lines.append(f"  none's steps ran {base.step_s_min:.3g} to {base.step_s_max:.3g} s: "
                     "the machine was busy, and the ratios against none are as uncertain "
                     + ("(more --rounds, run in alternating order, give medians)"
                        if (base.rounds or 1) < 3 else "as that spread"))
    no_thp = [r.strategy for r in shown
              if r.device == "cpu" and r.nvme_bytes and r.torch_thp is False]
    if no_thp:
        # heap.py: torch's huge-page allocation is what makes CPU NVMe offload cheap.
        lines.append(f"  {', '.join(no_thp)}: ran without THP_MEM_ALLOC_ENABLE=1; with it "
                     "(set before starting Python, for every row) activations are page-aligned "
                     "huge pages, written in place and cheaply pinned, which can lower the step "
                     "time and peak RSS (docs/benchmarks.md, THP_MEM_ALLOC_ENABLE)")
    floor = next((r for r in shown if r.nondeterministic_op), None)
    if floor is not None:
        lines.append("  gradient check: an op of this model has no deterministic kernel on this "
                     "device, so it ran non-deterministically and a DIFF may be that op's noise ("
                     + floor.nondeterministic_op + ")")
    steps = [r for r in shown if r.bit_exact is False and r.grads_differ_steps]
    ref = next((r for r in steps if r.strategy == "none"), None)
    if ref is not None:
        # `none` against its own first round: the floor of the bit-exact check (worker.py
        # asks for deterministic kernels; an op with none makes it fall back to warn-only).
        lines.append("  none differs from its own first round: this device's kernels are not "
                     "bit-reproducible for this model (e.g. an attention backward without a "
                     "deterministic algorithm), so a DIFF in another row at those steps is the "
                     "same noise, not the strategy")
    for r in steps:
        lines.append(f"  {r.strategy}: gradients differ from none in timed step(s) "
                     + ", ".join(str(k + 1) for k in r.grads_differ_steps)
                     + (f" ({', '.join(r.grads_differ[:3])})" if r.grads_differ else ""))
    return lines


def write_json(rows: list[Row], path: str) -> None:
    """The --json file (rows.to_json: one schema, versioned)."""
    write_output_file(path, lambda f: f.write(to_json(rows)))


def write_json_anywhere(rows: list[Row]) -> str | None:
    """The --json rows in a new file of the temporary directory, when the path asked for
    could not be written (what a long run measured is not lost); its path, or None."""
    import tempfile
    try:
        fd, path = tempfile.mkstemp(prefix="offload-bench-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            f.write(to_json(rows))
        return path
    except OSError:
        return None


def plot_unavailable_reason() -> str | None:
    """Why --plot cannot work here (matplotlib missing), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib, an optional extra: pip install 'offload[bench]' " \
               "(or pip install matplotlib), or drop --plot"
    return None


def plot_format_problem(path: str) -> str | None:
    """Why matplotlib cannot write `path` (its extension names the format), or None."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # write_plot's backend

    formats = sorted(FigureCanvasAgg.get_supported_filetypes())
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext in formats:
        return None
    what = f"matplotlib writes no '.{ext}' files" if ext else \
        "no extension to tell matplotlib the format"
    return f"{what} (use .png, .svg or .pdf; it writes {', '.join(formats)})"


def write_plot(rows: list[Row], path: str) -> None:
    """Scatter of peak activation memory against median step time, one point per strategy."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    points = [r for r in rows if r.available and r.peak_activation_bytes is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in points:
        x, y = r.step_s_median, r.peak_activation_bytes / 2**20
        ax.scatter([x], [y], s=40)
        ax.annotate(r.strategy, (x, y), textcoords="offset points", xytext=(6, 4))
    source = points[0].peak_activation_source if points else ""
    ax.set_xlabel("median step time (s)")
    ax.set_ylabel(f"peak activation memory, MiB ({source})")
    ax.set_title(title(rows, sep="\n"), fontsize=8)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def explain_text(rows: list[Row]) -> str:
    """What --explain prints: the auto plan, or why there is none."""
    row = next((r for r in rows if r.strategy == "auto"), None)
    if row is None:
        return "--explain: the auto strategy did not run"
    if not row.available:
        return f"--explain: the auto policy is not available: {row.reason}"
    if not row.plan:
        return "--explain: auto ran, but the runtime exposed no plan (ctx.plan is missing)"
    # The runtime's text opens with its own "auto plan: ..." line (schedule/explain.py).
    return row.plan if row.plan.startswith("auto plan") else "auto plan:\n" + row.plan
