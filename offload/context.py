"""`offload.activations()`: the context manager around one training step.

    with offload.activations() as ctx:          # settings from OFFLOAD_* env vars
        loss = model(batch).loss
        loss.backward()
    print(ctx.stats.as_dict())

Construction parses and validates every setting (ConfigError before the first forward;
nothing touches the disk). `__enter__` resolves capacities, opens the tiers and installs the
hooks. `__exit__` removes the hooks; the tiers close as soon as no saved tensor needs them
(at once when backward ran inside the block). When the block raises, everything is freed
(slab files, arena space, hooks) and the original exception propagates unchanged.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any

import torch

from .config import Config
from .hooks import OffloadHooks, _set_no_offload_depth, no_offload_depth
from .bounce import LinkSpeed, TensorTiming
from .placement import BouncePlan, Placement, plan_for
from .prefetch import Prefetcher
from .stats import Stats
from .tensor_meta import ParamStorages
from .tiers import nvme_space, pool
from .tiers.base import Tier
from .tiers.host import HostTier
from .trace import TraceRecorder

__all__ = ["activations", "ActivationOffload", "no_offload", "empty_cache"]

log = logging.getLogger("offload")


def activations(*, model: torch.nn.Module | None = None, **settings: Any) -> "ActivationOffload":
    """Offload the activations autograd saves inside the block to host RAM / NVMe.

    Args:
        model: The model being trained (optional). Its parameters and buffers are recognised
            exactly (without it, parameters and views of them still are; buffers such as
            BatchNorm's running statistics are then treated like activations, moved only
            above OFFLOAD_MIN_BYTES); the scheduler will use it to find repeated blocks.
        **settings: Override the OFFLOAD_* environment variables; same names in lower case
            without the prefix: tiers, nvme_dir, host_bytes, nvme_bytes, min_bytes, policy,
            budget, strict, log, prefetch_bytes, io_workers, staging_bytes, cpu_heap, trace.

    Returns:
        The context manager; `__enter__` returns it, and `.stats` is readable after the block.

    Raises:
        ConfigError: a setting is invalid (names the variable, the value and what to do).

    Example:
        >>> with offload.activations(tiers="nvme", nvme_dir="/mnt/nvme") as ctx:
        ...     model(x).sum().backward()
        >>> ctx.stats.nvme_bytes
    """
    return ActivationOffload(Config.from_env(**settings), model=model)


class ActivationOffload:
    """One offload context; reusable for several steps (`with ctx:` each step)."""

    def __init__(self, config: Config, model: torch.nn.Module | None = None) -> None:
        config.validate()
        if "nvme" in config.tiers and config.policy == "offload":
            from ._ext import load_core

            load_core()  # ExtensionUnavailable (with the reason) now, not mid-step
        self.config = config
        self.model = model
        self.stats = Stats()
        self.tiers: dict[str, Tier] = {}
        self._hooks: OffloadHooks | None = None
        self._saved_hooks_cm = None
        self._active = False
        self._start_s = 0.0
        self._exit_s = 0.0
        self._copies: dict[torch.device, Any] = {}  # CopyStreams per CUDA device
        self._bounce = BouncePlan()  # learned across the steps of this context (no model=)

    # ---------------------------------------------------------------- enter / exit
    def __enter__(self) -> "ActivationOffload":
        if self._active:
            raise RuntimeError("offload.activations(): this context is already active; "
                               "create one context per step or nest different ones")
        config = self.config
        config.apply_log_level()
        self.stats = stats = Stats()
        if config.trace is not None:
            stats.trace = TraceRecorder()
        self._copies = {}
        tiers = self._open_tiers(stats) if config.policy == "offload" else {}
        try:
            params = ParamStorages()
            if self.model is not None:
                params.add_module(self.model)
            bounce = None
            if config.policy == "offload":
                bounce = plan_for(self.model, (config.tiers, config.min_bytes)) \
                    or self._bounce
            hooks = OffloadHooks(Placement(config, bounce), tiers, stats,
                                 Prefetcher(config.prefetch_bytes, stats), params, config.strict)
            self.tiers, self._hooks = tiers, hooks
            self._saved_hooks_cm = torch.autograd.graph.saved_tensors_hooks(hooks.pack,
                                                                            hooks.unpack)
            self._saved_hooks_cm.__enter__()
        except BaseException:
            _close_tiers(tiers, stats, None, reuse=False)
            raise
        self._active = True
        self._start_s = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._active = False
        self._exit_s = time.perf_counter()
        self.stats.step_s = self._exit_s - self._start_s
        self._saved_hooks_cm.__exit__(None, None, None)
        if exc_type is not None:
            self._abort()
            return False  # re-raise the original exception unchanged
        self._finish()
        return False

    def _open_tiers(self, stats: Stats) -> dict[str, Tier]:
        config, tiers = self.config, {}
        try:
            for name in config.tiers:
                if name == "host":
                    tiers[name] = HostTier(config.host_capacity_bytes(), stats,
                                           capacity_key=config.host_bytes,
                                           copies=self._copy_streams)
                elif name == "nvme":
                    from ._ext import load_core
                    from .tiers.nvme import NvmeTier

                    tiers[name] = NvmeTier(
                        config.nvme_dir, config.nvme_capacity_bytes,
                        workers=config.io_workers, staging_bytes=config.staging_bytes,
                        cpu_heap=config.cpu_heap,
                        stats=stats, core=load_core(), capacity_key=config.nvme_bytes,
                        copies=self._copy_streams)
        except BaseException:
            for tier in tiers.values():
                tier.close(reuse=False)
            raise
        return tiers

    def _copy_streams(self, device: torch.device):
        """The CopyStreams of a CUDA device, made at its first tensor (streams are cheap,
        but a CPU-only run must never touch torch.cuda)."""
        copies = self._copies.get(device)
        if copies is None:
            from .cuda_streams import CopyStreams

            # Source bytes held by pending D2H copies: the module's default (1 GiB) bounds
            # device memory kept for copies without throttling a ~50 GB/s link.
            copies = self._copies[device] = CopyStreams(device, trace=self.stats.trace)
        return copies

    def _close_copies(self) -> None:
        """Wait for every device copy in flight (their events only) and fold their stats."""
        copies, self._copies = self._copies, {}
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

    def _finish(self) -> None:
        hooks = self._hooks
        for tier in self.tiers.values():
            tier.poll()
        close = functools.partial(_close_tiers, self.tiers, self.stats, hooks,
                                  before=self._close_copies)
        if hooks.live_records == 0:
            close()
            self._step_done(self._exit_s)
        else:
            # Backward runs after the block: tiers stay open until the last saved tensor
            # is freed (NOTE [Record lifetime] in hooks.py); the trace is written then.
            log.debug("offload: %d stored storages outlive the block; tiers close when "
                      "backward frees them", hooks.live_records)

            def close_later() -> None:
                close()
                self._step_done(time.perf_counter())
            hooks.on_idle = close_later
        log.info("offload: %s", self.stats.summary())

    def _step_done(self, end_s: float) -> None:
        """The step's backward is over: plan the next step, write the trace."""
        try:
            self._learn_bounce()
        except Exception:  # a planning problem must never fail the training step
            log.exception("offload: could not update the bounce plan")
        self._write_trace(end_s)

    def _learn_bounce(self) -> None:
        placement = self._hooks.placement
        if placement.bounce is None:
            return
        s = self.stats
        # Speeds of the path the bytes took (see Stats.BusyClock).
        link = None
        if s.nvme_written_bytes and s.nvme_write_gbps > 0 and s.nvme_read_gbps > 0:
            link = LinkSpeed(s.nvme_write_gbps * 1e9, s.nvme_read_gbps * 1e9)
        elif s.d2h_bytes and s.d2h_gbps > 0 and s.h2d_gbps > 0:
            link = LinkSpeed(s.d2h_gbps * 1e9, s.h2d_gbps * 1e9)
        placement.bounce.learn((TensorTiming(*t) for t in self._hooks.timings), link)

    def _write_trace(self, end_s: float) -> None:
        """Add the compute spans and write OFFLOAD_TRACE (never fails the step)."""
        rec = self.stats.trace
        if not rec.enabled:
            return
        # Forward runs from entry to the first unpack; backward from there to `end_s`.
        backward_s = self._hooks.first_unpack_s
        forward_end_s = backward_s if backward_s is not None else self._exit_s
        rec.add("forward", "forward", self._start_s, forward_end_s, category="compute")
        if backward_s is not None:
            rec.add("backward", "backward", backward_s, max(end_s, backward_s),
                    category="compute")
        try:
            rec.write(self.config.trace)
        except OSError as exc:
            log.warning("offload: could not write the trace to %s: %s (OFFLOAD_TRACE)",
                        self.config.trace, exc)

    def _abort(self) -> None:
        try:
            self._hooks.release_all()
        except Exception:  # never mask the user's exception
            log.exception("offload: error while releasing saved tensors after an exception")
        try:
            _close_tiers(self.tiers, self.stats, self._hooks, reuse=False,
                         before=self._close_copies)
            empty_cache()  # an exception may end the run: keep no slab file or arena open
        except Exception:
            log.exception("offload: error while closing the tiers after an exception")

    def close(self) -> None:
        """Free the tiers now, even if saved tensors still refer to them, and drop the
        stores / arenas kept for the next step (`empty_cache()`)."""
        if self._hooks is not None:
            self._hooks.release_all()
        _close_tiers(self.tiers, self.stats, self._hooks, reuse=False,
                     before=self._close_copies)
        empty_cache()


def _close_tiers(tiers: dict[str, Tier], stats: Stats, hooks: OffloadHooks | None,
                 reuse: bool = True, before=None) -> None:
    """Drain and close `tiers`, noting what they still held (0 after a clean step).

    With `reuse` clean stores / arenas go back to the pool for the next step. `before`
    runs first (closing the CopyStreams: device copies land before the tiers drain).
    """
    if hooks is not None:
        hooks.on_idle = None
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
            if name == "nvme":
                stats.staging_peak_bytes = tier.arena_peak_bytes
                stats.exit_staging_used_bytes = tier.arena_used_bytes
            setattr(stats, f"exit_{name}_used_bytes", tier.used_bytes)
        except Exception:
            log.exception("offload: error while draining the %s tier", name)
            reuse = False
        finally:
            tier.close(reuse=reuse)


def empty_cache() -> None:
    """Close the NVMe stores (their slab files) and the arenas kept for the next step now.

    Like `torch.cuda.empty_cache()`: nothing in use is touched. A store a live context still
    uses stays open and closes when that context is done with it.
    """
    pool.clear()
    nvme_space.close_idle()


@contextlib.contextmanager
def no_offload():
    """A region whose saved tensors stay where they are (counted as kept).

    Nests, and works as a decorator. Outside `offload.activations()` it does nothing.

    Example:
        >>> with offload.activations():
        ...     with offload.no_offload():
        ...         y = small_head(x)       # saved tensors of this region stay on the device
    """
    depth = no_offload_depth()
    _set_no_offload_depth(depth + 1)
    try:
        yield
    finally:
        _set_no_offload_depth(depth)
