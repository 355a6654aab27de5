"""One `with offload.activations()` block: its tiers, hooks, copies and stats, from entry
until its last saved tensor is gone.

NOTE [End of step] A step's end-of-step work (wait for device copies, drain and close its
tiers so the store and arenas go back for the next step, update the round-trip plan, write the
trace) runs at one of these defined points, never from a destructor:

1. the context's exit, when no saved tensor of the step is alive (backward ran inside the
   block: the common case);
2. the end of a backward that ran after the exit (autograd's end-of-backward callback, which
   the hooks' BackwardMarks queue at the first unpack of each backward), once the backward
   freed them all;
3. otherwise (a graph dropped without backward, one freed later by hand) the step waits in
   `pending` and is finished at the next context entry, `offload.empty_cache()` or
   interpreter exit, whichever comes first.

A saved tensor dying only updates counters and gives its payload back to its tier
(records.py: its record counts itself out of the step's meter); that may happen on any
thread, under the meter's release lock, so nothing that waits or writes files may run
there.

NOTE [Training step] What `auto` learns from a step's time (its profile, its trials) comes
only from a training step: one that ran a forward and a backward and ended at point 1 or 2
(its graph freed by its own backward), during which torch.compile compiled nothing. An eval
block (`torch.no_grad()` inside: no backward), a graph kept with `retain_graph` (ends at
point 3, whenever it is dropped) and a compiling step would all book a time that is not the
step's. Every step reports once (`StepReport`), when it ends or is freed (`close()`, or an
exception: `failed`, with the block's error, or for a backward after the block that raised
and never ended).
"""
from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from typing import Any, NamedTuple

import torch

from ..config import Config
from ..errors import OffloadError
from ..tiers.base import Tier
from ..util.stats import Stats
from .deep_graphs import check as check_graph_depth
from .hooks import OffloadHooks
from .records import Ledger, PyRecord
from .round_trip import LinkSpeed, RoundTripPlan
from .subclasses import note_unmoved
from .timeline import PyTimeline, Timeline

__all__ = ["Step", "StepView", "StepReport", "close_tiers", "finish_pending", "steps_alive"]

log = logging.getLogger("offload")
_said: set[str] = set()   # planning errors of ours said already (one line each)


def forget_warnings() -> None:
    """Say the planning errors again (offload.process.reset)."""
    _said.clear()

_pending_lock = threading.Lock()
_pending: set["Step"] = set()  # exited steps whose saved tensors were still alive


class StepView(NamedTuple):   # immutable, and made every step: a tuple, not a dataclass
    """What the policy's scheduler gets of a step when it starts (schedule/session.py)."""

    hooks: OffloadHooks              # pack / unpack (blocks store op outputs through them)
    capacities: dict[str, int]       # what each open tier may hold, by name
    readahead: Any                   # the step's Prefetcher: `raise_budget(nbytes)`
    start_s: float


class StepReport(NamedTuple):
    """What the policy's scheduler gets of a step when it is over."""

    stats: Stats
    timeline: Any                    # when each stored storage was packed and unpacked
    backward_mark: Any               # where the backward started, on the hooks' clock
                                     # (None without one)
    end_s: float
    training: bool                   # NOTE [Training step]
    failed: bool = False             # its block raised (`error`), or a backward after it
                                     # never ended (it raised: what, the step cannot see)
    error: BaseException | None = None

    @property
    def rows(self) -> list:
        """Timeline.rows(): [key, nbytes, pack_s, unpack_s] per stored storage (made on
        demand: only a scheduler that plans from them pays for an object per row)."""
        return self.timeline.rows()


class Step:
    """The state of one block; `ActivationOffload` makes one per `__enter__`."""

    def __init__(self, config: Config, stats: Stats,
                 round_trip: RoundTripPlan | None = None) -> None:
        self.config = config
        self.stats = stats
        self.tiers: dict[str, Tier] = {}
        self.hooks: OffloadHooks | None = None
        self.ledger = Ledger(stats)
        # The plan this step keeps by (learned from the steps before) and updates for the
        # next, from when each stored storage was packed and unpacked (the hooks note it).
        self.round_trip = round_trip
        # The core's or the Python one, as the ledger chose its records (hooks.py NOTE
        # [Handles in C]).
        self.timeline = PyTimeline() if self.ledger.record_type is PyRecord else Timeline()
        self.copies: dict[torch.device, Any] = {}  # CopyStreams per CUDA device
        self.start_s = time.perf_counter()
        self.exit_s: float | None = None
        # Run after the tiers closed, with the StepReport: `auto` plans here.
        self.after_finish: list = []
        self._compiled_at_start = _dynamo_frames()
        self._finished = False
        self._aborted = False   # `abort` noted what the step held (a second keeps it)
        self._lock = threading.Lock()  # finish runs once, from whichever point comes first

    # ---------------------------------------------------------------- device copies
    def copy_streams(self, device: torch.device):
        """The CopyStreams of a CUDA device, made at its first tensor (streams are cheap,
        but a CPU-only run must never touch torch.cuda)."""
        copies = self.copies.get(device)
        if copies is None:
            from ..tiers.copies import CopyStreams

            copies = self.copies[device] = CopyStreams(device, trace=self.stats.trace)
        return copies

    def close_copies(self) -> None:
        """Wait for every device copy in flight (their events only) and fold their stats."""
        copies, self.copies = self.copies, {}
        error = None
        for cs in copies.values():
            try:
                cs.close()
            except Exception as exc:  # keep closing the others; report the first
                error = error or exc
            finally:
                self.stats.add_copy_stats(cs.stats)
        if error is not None:
            raise error

    # ---------------------------------------------------------------- the end
    def exited(self) -> bool:
        """The block is over (NOTE [End of step], point 1). True when the step ended with it
        (no saved tensor outlives the block); otherwise it ends, and says so, later."""
        self.exit_s = time.perf_counter()
        # Before the graph can be freed after the block (deep_graphs.py NOTE [Deep graphs]);
        # the step's first node is the one its backward marks counted from.
        check_graph_depth(self.hooks.marks.first_node)
        self.stats.step_s = self.exit_s - self.start_s
        for name, count in self.stats.unmoved_tensors_by_type.items():
            note_unmoved(name, self.stats.unmoved_bytes_by_type[name], count)
        for tier in self.tiers.values():
            tier.poll()
        if self.ledger.live_records == 0:
            self.finish(self.exit_s, timed=True)
            return True
        # Backward runs after the block: the tiers stay open for it; Stats shows the forward's
        # figures until the step ends. What they hold back to batch goes now.
        for tier in self.tiers.values():
            tier.flush()
        self.fold()
        log.debug("offload: %d stored storages outlive the block; the step ends when they "
                  "are freed", self.ledger.live_records)
        with _pending_lock:
            _pending.add(self)
        self.hooks.marks.on_backward_end = self._backward_ended
        return False

    def fold(self) -> None:
        """Bring what the step's saves counted into its Stats (at the block's exit, the
        step's end, and whenever `ctx.stats` is read; idempotent)."""
        self.ledger.fold()
        for tier in self.tiers.values():
            tier.fold(self.stats)

    def _backward_ended(self) -> None:
        """Autograd's end-of-backward callback (NOTE [End of step], point 2)."""
        if self.ledger.live_records == 0:
            self.finish(time.perf_counter(), timed=True)

    def finish_if_idle(self) -> bool:
        """Finish a pending step whose saved tensors are all gone (point 3)."""
        ledger = self.ledger
        if ledger.live_records:
            return False
        self.finish(ledger.idle_since_s or time.perf_counter())
        return True

    def finish(self, end_s: float, timed: bool = False) -> None:
        """Close the tiers (clean resources back to the pool), learn, write the trace.
        `timed`: `end_s` is the end of the step's own backward (points 1 and 2)."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
        try:
            with _pending_lock:
                _pending.discard(self)
            self.hooks.marks.on_backward_end = None
            self.fold()
            after_exit = self.exit_s is not None and end_s > self.exit_s
            if after_exit and timed:   # backward after the block: the step ends with it (point 2)
                self.stats.step_s = end_s - self.start_s
            close_tiers(self.tiers, self.stats, before=self.close_copies)
        except BaseException:   # a Ctrl-C: finished, so nothing else would close them
            close_tiers(self.tiers, self.stats, reuse=False, before=self.close_copies)
            raise
        try:
            self._learn_round_trip()
        except Exception:  # a planning problem must never fail the training step
            log.exception("offload: could not update the round-trip plan")
        training = timed and self.hooks.marks.first_unpack_s is not None \
            and _dynamo_frames() == self._compiled_at_start   # NOTE [Training step]
        # A backward after the block that raised never ended: the graph died without it.
        # (So does one still running on another thread when the next step enters: taken
        # for failed too. Its thread cannot tell: a CUDA backward unpacks on autograd's
        # device threads.)
        failed = not timed and self.hooks.marks.open_backwards > 0
        self._tell(StepReport(self.stats, self.timeline, self.hooks.marks.backward_mark, end_s,
                              training, failed))
        self._write_trace(end_s)
        if after_exit and log.isEnabledFor(logging.INFO):   # the block's exit did not say
            log.info("offload: %s", self.stats.summary())

    def _tell(self, report: StepReport) -> None:
        """Hand the step's report to `after_finish` (`auto` plans there)."""
        for learn in self.after_finish:
            try:
                learn(report)
            except OffloadError as exc:   # ours says what to do: once, with no traceback
                if str(exc) not in _said:
                    _said.add(str(exc))
                    log.warning("offload: could not plan the next step (OFFLOAD_POLICY=auto; "
                                "it tries again each step, running as `offload` meanwhile): "
                                "%s", exc)
            except Exception:  # same: the step itself went through
                log.exception("offload: could not plan the next step (OFFLOAD_POLICY=auto)")

    def abort(self, error: BaseException | None = None) -> None:
        """Free everything now: after the block raised `error` (the report says so), or an
        interrupted exit, or `ActivationOffload.close()`."""
        with self._lock:
            reported, self._finished = self._finished, True
        with _pending_lock:
            _pending.discard(self)
        if self.hooks is not None:
            self.hooks.marks.on_backward_end = None
        self.fold()   # what the failed block saved stays in its figures
        held = {name: tier.used_bytes for name, tier in self.tiers.items()}
        for tier in self.tiers.values():
            tier.abort()  # every payload freed now; a later unpack says so
        close_tiers(self.tiers, self.stats, reuse=False, before=self.close_copies)
        # What the step still held when it was freed; a second abort (`close()` inside the
        # block, then its exception's exit) finds it all freed and keeps the first's figures
        # (noted once they are written: a first one interrupted before writes none).
        if not self._aborted:
            for name, nbytes in held.items():
                self.stats.tier(name).exit_used_bytes = nbytes
            self._aborted = True
        if not reported and self.hooks is not None:   # every step reports once
            self._tell(StepReport(self.stats, self.timeline, self.hooks.marks.backward_mark,
                                  time.perf_counter(), False, error is not None, error))

    def _learn_round_trip(self) -> None:
        if self.round_trip is None:
            return
        s = self.stats
        # Speeds of the path the bytes took (see Stats.BusyClock; each figure is a union
        # of busy intervals: read once).
        link = _link(s.nvme_write_gbps, s.nvme_read_gbps) if s.nvme_written_bytes else None
        if link is None and s.d2h_bytes:
            link = _link(s.d2h_gbps, s.h2d_gbps)
        self.round_trip.learn_timeline(self.timeline, link)

    def _write_trace(self, end_s: float) -> None:
        """Add the compute spans and write OFFLOAD_TRACE (never fails the step)."""
        rec = self.stats.trace
        if not rec.enabled:
            return
        # Forward runs from entry to the first unpack; backward from there to `end_s`.
        backward_s = self.hooks.marks.first_unpack_s
        exit_s = self.exit_s if self.exit_s is not None else end_s
        forward_end_s = backward_s if backward_s is not None else exit_s
        rec.add("forward", "forward", self.start_s, forward_end_s, category="compute")
        if backward_s is not None:
            rec.add("backward", "backward", backward_s, max(end_s, backward_s),
                    category="compute")
        try:
            rec.write(self.config.trace)
        except OSError as exc:
            log.warning("offload: could not write the trace to %s: %s (%s)",
                        self.config.trace, exc, self.config.where("trace"))


def _link(out_gbps: float, in_gbps: float) -> LinkSpeed | None:
    """The measured speeds as a LinkSpeed; None when either was not measured."""
    return LinkSpeed(out_gbps * 1e9, in_gbps * 1e9) if out_gbps > 0 and in_gbps > 0 else None


def _dynamo_frames() -> int:
    """Frames torch.compile has compiled so far in this process (0 before it is used)."""
    # Another thread may be importing it (a recompute's first forward does, ~1 s): until
    # `counters` exists, nothing was compiled.
    counters = getattr(sys.modules.get("torch._dynamo.utils"), "counters", None)
    return counters["frames"]["total"] if counters is not None else 0


def finish_pending() -> int:
    """Finish every pending step whose saved tensors are gone; returns how many."""
    with _pending_lock:
        steps = list(_pending)
    done = 0
    for step in steps:
        try:
            done += step.finish_if_idle()
        except Exception:  # one broken step must not keep the others open
            log.exception("offload: error while finishing a step")
    return done


def steps_alive() -> int:
    """Exited steps whose stored tensors are still alive (after `finish_pending`)."""
    return len(_pending)   # one read of a set's size: no lock needed


def close_tiers(tiers: dict[str, Tier], stats: Stats, reuse: bool = True, before=None) -> None:
    """Drain and close `tiers`, noting what they still held (0 after a clean step).

    With `reuse` clean stores / arenas go back to the pool for the next step. `before`
    runs first (closing the CopyStreams: device copies land before the tiers drain).
    """
    if before is not None:
        try:
            before()
        except Exception:
            log.exception("offload: error while waiting for device copies")
            reuse = False
    for name, tier in list(tiers.items()):
        if tier.closed:
            continue
        try:
            if reuse:  # after an exception nobody needs the writes in flight: no waiting
                tier.drain()
            tier.report(stats)
        except Exception:
            log.exception("offload: error while draining the %s tier", name)
            reuse = False
        finally:
            tier.close(reuse=reuse)


atexit.register(finish_pending)  # the last step's trace, if its graph died after the block
