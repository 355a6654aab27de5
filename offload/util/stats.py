"""Per-step counters of the runtime: where the saved bytes went, how long the step waited,
and the throughput each path achieved. `Stats.as_dict()` is plain JSON.

The field names are read by the benchmark (keep them): saved_bytes, kept_bytes, host_bytes,
nvme_bytes (a tier's figures: TierStats), peak_resident_bytes, nvme_written_bytes, nvme_read_bytes, stall_s, d2h_gbps,
h2d_gbps, nvme_write_gbps, nvme_read_gbps, packed_tensors.

Pipeline telemetry: `stall_s` (and its forward / backward split) is the time the training
thread waited for offload work; `io_busy_s` the wall time during which some transfer (NVMe
write or read, D2H, H2D) was in flight; `overlap_fraction` the share of that time hidden
behind compute, i.e. 1 - stall_s / io_busy_s (a stall always waits on some transfer, so it
lies inside the busy time); queue depths are the `peak_*_inflight` fields.
"""
from __future__ import annotations

import inspect
import time
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from .never_compiled import never_compiled
from .trace import NULL_RECORDER

__all__ = ["Stats", "TierStats", "BusyClock"]


class BusyClock:
    """Wall time during which at least one transfer of a path was in flight.

    Bytes / busy time is the throughput the path achieved while it had work; unlike bytes /
    step time it does not drop when the path simply had nothing to do. Each transfer adds
    its [start, end] interval; overlapping intervals count once. The end of an NVMe
    transfer is the engine's completion time (`IoFuture.end_s`, on perf_counter's clock);
    a chained GPU read (read then H2D) ends when the runtime saw its copy done (an upper
    bound: that GB/s is a lower bound).
    """

    __slots__ = ("_intervals",)

    def __init__(self) -> None:
        self._intervals: list[tuple[float, float]] = []

    def add_interval(self, start_s: float, end_s: float) -> None:
        self._intervals.append((start_s, end_s))

    def add_intervals(self, intervals) -> None:
        """Add several [start, end] intervals at once (an nvme tier's, folded in)."""
        self._intervals.extend(intervals)

    def add(self, seconds: float) -> None:
        """Account a transfer that just ran synchronously for `seconds`."""
        now = time.perf_counter()
        self._intervals.append((now - seconds, now))

    @property
    def busy_s(self) -> float:
        return _union_s(self._intervals)


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end] intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


@dataclass
class TierStats:
    """One tier's figures for a step (the tier's own: tiers/base.py NOTE [One owner])."""

    bytes: int = 0               # activation bytes stored in the tier (unique storages)
    capacity_bytes: int = 0      # what this process's tier may hold, shared by every step
    #                              alive at once (host_budget.py, nvme_space.py); a percentage
    #                              is divided among the local ranks (ranks.py NOTE [Host share])
    capacity_source: str = ""    # what a percentage was taken of ("50% of cgroup v2 /job
    #                              (limit 2 GiB, ...)": util/memory_limits.py)
    exit_used_bytes: int = 0     # space the step still held when it was freed before its
    #                              stored tensors were (an exception, ctx.close()); 0 for a
    #                              step that ended with them


_NO_TIER = TierStats()
# The names of the registered tiers (offload/tiers/__init__.py sets them): every Stats lists
# their figures, opened or not, so the JSON keeps one shape.
TIER_NAMES: list[tuple] = [()]
# (prefix, suffix, TierStats attribute) of the flat names.
_TIER_FIELDS = (("exit_", "_used_bytes", "exit_used_bytes"),
                ("", "_capacity_source", "capacity_source"),
                ("", "_capacity_bytes", "capacity_bytes"),
                ("", "_bytes", "bytes"))


@never_compiled   # the core's I/O adds its stalls from inside unpacks: NOTE [Never compiled]
@dataclass
class Stats:
    """Counters for one `with offload.activations()` block (one training step).

    Bytes are counted once per storage (views of one storage are stored once). "Resident"
    means on the compute device: tensors kept there, plus the host tier on a CPU-only run
    (where the device *is* host RAM).
    """

    saved_bytes: int = 0          # activation bytes autograd saved (unique storages, no params)
    kept_bytes: int = 0           # ... of which stayed where they were; the rest went to the
    #                               tiers: `{tier}_bytes` (host_bytes, nvme_bytes), see TierStats
    param_bytes: int = 0          # parameter/buffer storages autograd saved (never moved)
    peak_resident_bytes: int = 0  # peak of saved activation bytes resident on the device
    nvme_written_bytes: int = 0
    nvme_read_bytes: int = 0
    nvme_bounced_bytes: int = 0   # NVMe bytes copied through bounce buffers (tiers/nvme.py
    #                               NOTE [Phase]: partial end sectors, out-of-phase memory)
    stall_s: float = 0.0          # stall_forward_s + stall_backward_s
    stall_forward_s: float = 0.0  # pack waited for staging space (backpressure)
    stall_backward_s: float = 0.0  # unpack waited for its data
    packed_tensors: int = 0       # tensors autograd handed to the pack hook
    offloaded_tensors: int = 0    # ... whose storage went to a tier (host or nvme)
    param_tensors: int = 0        # ... that were parameters/buffers or views of them
    unique_storages: int = 0      # storages stored (after dedup), kept ones included
    spilled_bytes: int = 0        # bytes that went to a later tier because an earlier was full
    full_kept_bytes: int = 0      # bytes kept because every tier was full
    prefetch_hits: int = 0        # unpacks whose read was already issued by the prefetcher
    prefetch_misses: int = 0      # unpacks that had to issue their own read
    peak_writes_inflight: int = 0  # deepest queue of NVMe writes not yet landed
    peak_prefetch_bytes: int = 0  # most bytes of read-ahead in flight at once
    peak_reads_inflight: int = 0  # deepest queue of NVMe reads issued, not yet seen done
    peak_d2h_inflight: int = 0    # deepest queue of D2H copies (CUDA)
    peak_h2d_inflight: int = 0    # deepest queue of H2D copies (CUDA)
    round_trip_kept_bytes: int = 0  # kept: moving them out and back would not pay off
    #                                 (runtime/round_trip.py)
    backward_kept_bytes: int = 0  # bytes saved while a backward ran (reentrant checkpoint's
    #                               recompute, double backward): used at once, never moved
    pending_copy_hits: int = 0    # unpacks served from the source while its D2H was pending
    step_s: float = 0.0           # wall time of the step: entry to the block's exit, or
    #                               to the end of its backward when that runs after it
    # Earlier steps of this process whose stored tensors were still alive when this one
    # began (graphs kept with retain_graph, a stored loss, micro-batches backwarded later):
    # 0 in a plain loop; growing from step to step, their tier space is never given back.
    steps_alive_at_entry: int = 0
    staging_peak_bytes: int = 0   # peak use of the nvme tier's staging arena
    exit_staging_used_bytes: int = 0  # staging arena still used when the tiers closed
    # Saved tensors left where they are because the runtime cannot move their type (sparse,
    # nested, quantized, a subclass that cannot be flattened: subclasses.py), by type name.
    unmoved_tensors_by_type: dict = field(default_factory=dict)
    unmoved_bytes_by_type: dict = field(default_factory=dict)
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    resident_bytes: int = field(default=0, repr=False)  # current value behind the peak
    d2h_clock: BusyClock = field(default_factory=BusyClock, repr=False)
    h2d_clock: BusyClock = field(default_factory=BusyClock, repr=False)
    write_clock: BusyClock = field(default_factory=BusyClock, repr=False)
    read_clock: BusyClock = field(default_factory=BusyClock, repr=False)
    # GPU-timed copy durations of the async path (CopyStreams, CUDA events).
    gpu_d2h_busy_s: float = field(default=0.0, repr=False)
    gpu_h2d_busy_s: float = field(default=0.0, repr=False)
    # Chrome-trace recorder of the step (OFFLOAD_TRACE); the disabled one costs nothing.
    trace: Any = field(default=NULL_RECORDER, repr=False, compare=False)
    # Each tier's own figures (TierStats), by the tier's name; as_dict() lists them under
    # `{tier}_bytes`, `{tier}_capacity_bytes`, `{tier}_capacity_source`,
    # `exit_{tier}_used_bytes` for every tier in `tier_names` (the registry's).
    tiers: dict = field(default_factory=dict, repr=False, compare=False)
    tier_names: tuple = field(default_factory=lambda: TIER_NAMES[0], repr=False, compare=False)

    def tier(self, name: str) -> "TierStats":
        """The figures of tier `name` (made at first use; a name no tier has is an error,
        not a row of zeros)."""
        figures = self.tiers.get(name)
        if figures is None:
            if name not in self.tier_names:
                raise KeyError(f"no tier is called {name!r}: the tiers are "
                               f"{', '.join(map(repr, self.tier_names))}")
            figures = self.tiers[name] = TierStats()
        return figures

    def __getattr__(self, name: str):
        # `host_bytes`, `nvme_capacity_bytes`, `exit_host_used_bytes`: a tier's figures by
        # the flat names the JSON and older code use (0 / "" for a tier not opened).
        for prefix, suffix, attr in _TIER_FIELDS:
            if name.startswith(prefix) and name.endswith(suffix) and \
                    len(name) > len(prefix) + len(suffix):
                tier = name[len(prefix):len(name) - len(suffix)]
                known = self.__dict__.get("tiers", {})
                if tier in known or tier in self.__dict__.get("tier_names", ()):
                    return getattr(known.get(tier, _NO_TIER), attr)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ------------------------------------------------------------ updates
    def count_unmoved(self, type_name: str, nbytes: int) -> None:
        """A saved tensor of a type the runtime cannot move stays: counted by type, and kept."""
        tensors, nbytes_by_type = self.unmoved_tensors_by_type, self.unmoved_bytes_by_type
        tensors[type_name] = tensors.get(type_name, 0) + 1
        nbytes_by_type[type_name] = nbytes_by_type.get(type_name, 0) + nbytes
        self.saved_bytes += nbytes
        self.kept_bytes += nbytes

    def add_stall(self, seconds: float, backward: bool, start_s: float | None = None,
                  what: str = "stall") -> None:
        """Count `seconds` the training thread waited; `start_s` places it in the trace."""
        self.stall_s += seconds
        if backward:
            self.stall_backward_s += seconds
        else:
            self.stall_forward_s += seconds
        if self.trace.enabled and seconds > 0:
            start = start_s if start_s is not None else time.perf_counter() - seconds
            self.trace.add(what, "stall", start, start + seconds, category="stall")

    def add_copy_stats(self, copy) -> None:
        """Fold in the counters of one CopyStreams (copies_in_flight.CopyStats) at context exit.

        Their stalls are already in the trace (CopyStreams records them itself).
        """
        self.d2h_bytes += copy.d2h_bytes
        self.h2d_bytes += copy.h2d_bytes
        self.gpu_d2h_busy_s += copy.d2h_busy_s
        self.gpu_h2d_busy_s += copy.h2d_busy_s
        forward_s = copy.backpressure_wait_s
        backward_s = copy.h2d_wait_s + copy.d2h_wait_s
        self.stall_forward_s += forward_s
        self.stall_backward_s += backward_s
        self.stall_s += forward_s + backward_s
        self.peak_d2h_inflight = max(self.peak_d2h_inflight, copy.max_d2h_inflight)
        self.peak_h2d_inflight = max(self.peak_h2d_inflight, copy.max_h2d_inflight)

    # ------------------------------------------------------------ derived
    @property
    def d2h_gbps(self) -> float:
        return _gbps(self.d2h_bytes, self.d2h_clock.busy_s + self.gpu_d2h_busy_s)

    @property
    def h2d_gbps(self) -> float:
        return _gbps(self.h2d_bytes, self.h2d_clock.busy_s + self.gpu_h2d_busy_s)

    @property
    def nvme_write_gbps(self) -> float:
        return _gbps(self.nvme_written_bytes, self.write_clock.busy_s)

    @property
    def nvme_read_gbps(self) -> float:
        return _gbps(self.nvme_read_bytes, self.read_clock.busy_s)

    @property
    def io_busy_s(self) -> float:
        """Wall time during which any transfer was in flight (overlaps counted once).

        GPU-timed async copies have no host interval: their busy time is added (an upper
        bound where they overlapped NVMe I/O).
        """
        return _union_s([iv for clock in (self.write_clock, self.read_clock, self.d2h_clock,
                                          self.h2d_clock) for iv in clock._intervals]) \
            + self.gpu_d2h_busy_s + self.gpu_h2d_busy_s

    @property
    def overlap_fraction(self) -> float:
        """Share of the transfer time hidden behind compute (1.0 when nothing stalled)."""
        busy = self.io_busy_s
        if busy <= 0:
            return 1.0
        return max(0.0, 1.0 - self.stall_s / busy)

    @property
    def stall_fraction(self) -> float:
        """Stall time as a share of the step's wall time."""
        return self.stall_s / self.step_s if self.step_s > 0 else 0.0

    def as_dict(self) -> dict:
        """Plain JSON-able dict: every counter plus the derived GB/s figures."""
        # repr=False marks the internal fields (clocks, the running resident count).
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.repr}
        for name in dict.fromkeys(self.tier_names + tuple(self.tiers)):
            figures = self.tiers.get(name, _NO_TIER)
            out[f"{name}_bytes"] = figures.bytes
            out[f"{name}_capacity_bytes"] = figures.capacity_bytes
            out[f"{name}_capacity_source"] = figures.capacity_source
            out[f"exit_{name}_used_bytes"] = figures.exit_used_bytes
        for name in ("d2h_gbps", "h2d_gbps", "nvme_write_gbps", "nvme_read_gbps",
                     "io_busy_s", "overlap_fraction", "stall_fraction"):
            out[name] = round(getattr(self, name), 4)
        for name in ("stall_s", "stall_forward_s", "stall_backward_s", "step_s"):
            out[name] = round(out[name], 6)
        return out

    def summary(self) -> str:
        """One log line for OFFLOAD_LOG=INFO."""
        gib = 1 << 30
        tiers = "".join(f", {name} {figures.bytes / gib:.3f}"
                        for name, figures in self.tiers.items())
        return (f"saved {self.saved_bytes / gib:.3f} GiB (kept {self.kept_bytes / gib:.3f}"
                f"{tiers}); "
                f"peak resident {self.peak_resident_bytes / gib:.3f} GiB; "
                + (f"nvme w/r {self.nvme_write_gbps:.2f}/{self.nvme_read_gbps:.2f} GB/s; "
                   if "nvme" in self.tiers else "") +
                f"stall {self.stall_s:.3f} s of {self.step_s:.3f} s"
                + (f" ({self.overlap_fraction:.0%} of I/O hidden)" if self.io_busy_s > 0
                   else " (no I/O)") + "; "
                f"{self.packed_tensors} tensors"
                + "".join(f"; {name} capacity {figures.capacity_bytes / gib:.3f} GiB "
                          f"({figures.capacity_source})"
                          for name, figures in self.tiers.items() if figures.capacity_source))


# NOTE [A step's Stats, made fast] Every step makes one: dataclass's __init__ sets its ~45
# fields one by one (3.0 us on the dev VM, a tenth of an empty step: issue 18). A Stats made
# without arguments takes the plain defaults in one dict update and calls only the
# factories (1.6 us); with arguments, dataclass's own __init__ runs.
_DEFAULTS = {f.name: f.default for f in fields(Stats) if f.default is not MISSING}
_FACTORIES = tuple((f.name, f.default_factory) for f in fields(Stats)
                   if f.default_factory is not MISSING)
_dataclass_init = Stats.__init__


def _init(self, *args, **kwargs) -> None:
    if args or kwargs:
        _dataclass_init(self, *args, **kwargs)
        return
    own = self.__dict__
    own.update(_DEFAULTS)
    for name, factory in _FACTORIES:
        own[name] = factory()


_init.__signature__ = inspect.signature(_dataclass_init)   # (help(Stats) unchanged)
Stats.__init__ = never_compiled(_init)
