"""Run ONE strategy in this (fresh) process and write one JSON result.

Usage (the parent does this; handy for debugging one row by hand)::

    python -m offload.bench.worker SPEC.json OUT.json

A fresh process per strategy keeps them honest: no allocator cache, pinned arena, CUDA
context or runtime state leaks from one strategy into the next, and peak RSS is this
strategy's own. The parent forks workers from a forkserver that has only imported torch and
this package (see runner), which saves seconds of import time per worker.

The step: all gradient buffers exist before the first step (zeroed, not freed, between
steps), so "peak activation memory" is what the step adds on top of parameters + gradients
(and, on CPU, on top of what the warm-up left allocated: see :mod:`offload.bench.measure`).
Every step re-seeds the RNG and uses the same batch and weights (no optimizer update), so
every step -- and every strategy -- computes the same gradients. Every timed step's
gradients are checksummed (``grad_hashes``: a corruption in any step is caught, not only in
the last), and the last timed step's are saved whole for the max abs diff; the parent
compares both against ``none``.
"""
from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import torch

from offload.bench import measure
from offload.bench.result import OUT_OF_MEMORY, RunResult
from offload.bench.spec import RunSpec
from offload.bench.strategies import SETTLE_MAX_STEPS, Unavailable, get, load_plugins
from offload.bench.workload import Workload, block_names, build_workload, checkpointed
from offload.schedule.blocks import block_type_key
from offload.tiers.heap import torch_thp_enabled

__all__ = ["run", "main", "empty_result"]

_log = logging.getLogger("offload")


def empty_result(spec: RunSpec) -> RunResult:
    return RunResult(strategy=spec.strategy, batch=spec.batch, torch_thp=torch_thp_enabled())


def _is_oom(exc: BaseException) -> bool:
    oom_type = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    return isinstance(exc, oom_type) or "can't allocate memory" in str(exc)


def _setup_device(device: torch.device) -> str:
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise Unavailable(f"--device {device}: no CUDA device visible to torch")
        if device.index is not None:
            torch.cuda.set_device(device)
        # The gradient check compares bit for bit: ask for deterministic kernels. Strictly:
        # with warn_only=True the flash / memory-efficient attention backwards keep their
        # non-deterministic algorithm (seen on an H200: `none` itself differed between runs).
        # An op with no deterministic kernel at all raises; `_step` then falls back.
        torch.use_deterministic_algorithms(True)
        return torch.cuda.get_device_name(device)
    import platform

    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} CPUs, " \
           f"{torch.get_num_threads()} torch threads)"


def _plan_text(ctx: Any) -> str | None:
    """The auto plan as text, from whichever attribute the runtime exposes."""
    if ctx is None:
        return None
    for attr in ("plan", "explain"):
        value = getattr(ctx, attr, None)
        if value is None:
            continue
        value = value() if callable(value) else value
        if value is not None:
            return str(value)
    stats = getattr(ctx, "stats", None)
    plan = getattr(stats, "plan", None)
    return None if plan is None else str(plan)


def _account(wl: Workload, kind: str | None, exclude: set[int]) -> tuple:
    """(resident_bytes, saved_bytes) by counting saved storages in an untimed forward;
    kind "block": (the largest block's recomputed set, None)."""
    if kind == "counted":
        counter = measure.SavedBytesCounter(exclude)  # (its __enter__ returns None)
        with counter:
            loss = wl.loss()
        del loss
        return counter.saved_bytes, counter.saved_bytes
    if kind in ("recompute", "block"):
        # Between forward and backward, checkpoint keeps only what the outer hook sees (block
        # inputs, head, loss). In backward one block at a time is recomputed on top of that:
        # add the largest block's saved set, counted by running a block plainly on the input
        # it got; once per block structure and input shapes, which fix that set.
        inputs: dict[tuple, tuple[torch.nn.Module, tuple, dict]] = {}

        def capture(module, args, kwargs):
            detach = lambda v: v.detach() if isinstance(v, torch.Tensor) else v  # noqa: E731
            shapes = tuple(tuple(v.shape) for v in (*args, *kwargs.values())
                           if isinstance(v, torch.Tensor))
            inputs.setdefault((block_type_key(module), shapes), (
                module, tuple(map(detach, args)), {k: detach(v) for k, v in kwargs.items()}))

        handles = [b.register_forward_pre_hook(capture, with_kwargs=True) for b in wl.blocks]
        counter = measure.SavedBytesCounter(exclude)
        try:
            if kind == "block":
                with torch.no_grad():  # the inputs only
                    wl.loss()
            else:
                with counter, checkpointed(wl.blocks):
                    loss = wl.loss()
                del loss
        finally:
            for h in handles:
                h.remove()
        block_max = 0
        for module, args, kwargs in inputs.values():
            block_counter = measure.SavedBytesCounter(exclude)
            with block_counter, wl.autocast():
                out = module(*args, **kwargs)
            del out
            block_max = max(block_max, block_counter.saved_bytes)
        if kind == "block":
            return block_max, None
        return counter.saved_bytes + block_max, counter.saved_bytes
    return None, None


def _step(strategy, wl: Workload, spec: RunSpec, result: RunResult, reset) -> Any:
    """One training step; on CUDA, falls back to warn-only determinism if an op has none."""
    try:
        return strategy.step(wl, spec.nvme_dir, spec.budget)
    except RuntimeError as exc:
        if "deterministic" not in str(exc) or not torch.are_deterministic_algorithms_enabled() \
                or torch.is_deterministic_algorithms_warn_only_enabled():
            raise
        # This model has an op with no deterministic CUDA kernel: run it anyway and say in
        # the row that the bit-exact check has a floor.
        result.nondeterministic_op = str(exc).strip().splitlines()[0][:200]
        torch.use_deterministic_algorithms(True, warn_only=True)
        reset()
        return strategy.step(wl, spec.nvme_dir, spec.budget)


def _measure(spec: RunSpec, result: RunResult) -> None:
    strategy = get(spec.strategy)
    device = torch.device(spec.device)
    result.device_name = _setup_device(device)
    wl = build_workload(spec)
    result.tokens_per_step, result.samples_per_step = wl.tokens_per_step, wl.samples_per_step
    result.blocks = block_names(wl.model, wl.blocks)
    params = [p for p in wl.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)  # allocated before the baseline: not activation memory
    exclude = measure.param_storage_ptrs(wl.model)
    cuda_peaks: list[int] = []
    outcome = None
    rss = measure.RssPeak().start()

    def reset() -> None:
        for p in params:
            p.grad.zero_()
        torch.manual_seed(spec.seed + 2)  # identical dropout masks in every step/strategy

    try:
        # A strategy may need untimed steps of its own (auto: its profile step), and more
        # until it settles (auto: its trial steps), so that the timed steps run what a long
        # run gets; at most SETTLE_MAX_STEPS more, then the row says it never settled.
        warmup = spec.warmup + strategy.extra_warmup
        i, timing = 0, False
        while len(result.step_times_s) < spec.steps:
            if not timing and i >= warmup:
                result.unsettled = strategy.unsettled(outcome)
                timing = result.unsettled is None or i >= warmup + SETTLE_MAX_STEPS
                if timing:
                    result.untimed_steps = i
                    if i > 0:
                        # CPU: the pooled staging arena must not hide in the baseline
                        # (measure doc).
                        rss.rebase(release=functools.partial(_drop_runtime_pool,
                                                             spec.nvme_dir)
                                   if device.type == "cpu" else None)
            reset()
            measure.synchronize(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base_bytes = torch.cuda.memory_allocated(device)
            t0 = time.perf_counter()
            outcome = _step(strategy, wl, spec, result, reset)
            measure.synchronize(device)
            elapsed_s = time.perf_counter() - t0
            i += 1
            if not timing:
                continue
            result.step_times_s.append(elapsed_s)
            result.stats_steps.append(outcome.stats)
            result.grad_hashes.append(measure.grad_hashes(wl.model))  # untimed
            if outcome.nvme_direct is not None:
                result.nvme_direct = outcome.nvme_direct
            if device.type == "cuda":
                cuda_peaks.append(torch.cuda.max_memory_allocated(device) - base_bytes)
    finally:
        rss.stop()
    result.warmup_rss_delta_bytes = rss.warmup_delta_bytes
    if result.nvme_direct is not None:  # the nvme tier ran: where did its bytes go?
        result.nvme_fs_types = [measure.fs_type(d) for d in spec.nvme_dir.split(",") if d]
    result.pool_released_bytes = rss.released_bytes
    result.available = True
    result.peak_rss_delta_bytes = rss.peak_delta_bytes
    result.cuda_peak_bytes = max(cuda_peaks) if cuda_peaks else None
    if device.type == "cuda":
        result.cuda_total_bytes = torch.cuda.get_device_properties(device).total_memory
        result.cuda_base_bytes = base_bytes
    result.stats = outcome.stats if outcome else None
    if spec.explain:
        result.plan = _plan_text(outcome.ctx if outcome else None)
    if spec.grads_path:
        measure.save_grads(wl.model, spec.grads_path)
        result.grads_path = spec.grads_path
    kind = strategy.resident(device)
    if kind in ("stats", "stats+block"):
        result.resident_source = "runtime peak_resident_bytes" + (
            " + staging arena peak" if device.type == "cpu" else "")
        per_step = []
        for step_stats in result.stats_steps:  # the largest step, like the RSS peak
            resident = (step_stats or {}).get("peak_resident_bytes")
            if resident is not None and device.type == "cpu":
                # On CPU the NVMe tier's staging arena is RAM too, i.e. device memory: count
                # it (the runtime's peak_resident_bytes counts only the tensors themselves).
                resident += step_stats.get("staging_peak_bytes") or 0
            if resident is not None:
                per_step.append(resident)
        result.resident_bytes = max(per_step) if per_step else None
        result.saved_bytes = (result.stats or {}).get("saved_bytes")
        if kind == "stats+block" and spec.account and result.resident_bytes is not None:
            block_bytes, _ = _account(wl, "block", exclude)
            result.resident_bytes += block_bytes
            result.resident_source += " + largest recomputed block (untimed pass)"
    elif spec.account and kind is not None:
        result.resident_bytes, result.saved_bytes = _account(wl, kind, exclude)
        result.resident_source = RESIDENT_SOURCES[kind]


# How each accounting kind (Strategy.resident) counts resident activation bytes; the row
# names it, because the kinds are different instruments (see strategies' module doc).
RESIDENT_SOURCES = {
    "counted": "saved-tensor hook (untimed pass)",
    "recompute": "saved-tensor hook (untimed pass) + largest recomputed block",
}


def _drop_runtime_pool(nvme_dir: str | None) -> None:
    """Close the arenas the runtime keeps between steps, and its NVMe stores but on a RAM
    filesystem: a store there holds no RSS, and opening it again reserves its size in RAM
    (fallocate on tmpfs: 3.8 s for 12 GiB), which the first timed step paid (165x `none`
    with --steps 1)."""
    try:
        from offload import process
        from offload.util.disk_space import RAM_FS_TYPES, fs_type
    except Exception:  # a half-built runtime: it then pooled nothing either
        return
    in_ram = any(fs_type(d) in RAM_FS_TYPES for d in (nvme_dir or "").split(",") if d)
    process.empty_cache(stores=not in_ram)


def run(spec: RunSpec) -> RunResult:
    """Measure `spec.strategy`; never raises for a failing strategy (the row says why)."""
    from offload.errors import ConfigError, ExtensionUnavailable

    result = empty_result(spec)
    try:
        load_plugins(spec.plugins)  # the strategies they register (strategies.register)
        strategy = get(spec.strategy)
        reason = strategy.unavailable_reason(torch.device(spec.device), spec.nvme_dir)
        if reason:
            raise Unavailable(reason)
        _measure(spec, result)
    except (Unavailable, ConfigError, ExtensionUnavailable, ImportError) as exc:
        result.available, result.reason = False, str(exc) or type(exc).__name__
    except Exception as exc:  # any failure of the strategy becomes its row, not a crash
        result.available = False
        if _is_oom(exc):
            result.oom = True
            result.reason = f"{OUT_OF_MEMORY} at batch {spec.batch}"
        else:
            result.error = True
            result.reason = f"failed: {type(exc).__name__}: {exc}"
            traceback.print_exc()
    return result


def _interrupt(signum, frame):
    # The parent stops a worker with SIGTERM; unwind like Ctrl-C so every `with` block
    # (NVMe files, hooks, arena) cleans up on the way out.
    raise KeyboardInterrupt(f"signal {signum}")


def stop_when_orphaned(interval_s: float = 0.5) -> None:
    """SIGTERM ourselves (`_interrupt`: unwind and clean up) once our parent is gone. The
    parent stops its workers (runner Rule 2), but not one the forkserver forked after a
    Ctrl-C had ended the parent's wait for its pid: that worker would run its whole
    benchmark detached (setsid) into a removed workspace. The forkserver ends with the
    parent, and the worker is then another process's child."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="offload-bench-orphan-watch", daemon=True).start()


def child_entry(spec_path: str, out_path: str, log_path: str, environ: dict[str, str]) -> None:
    """Entry of a worker started by the parent's forkserver (see runner Rule 2)."""
    os.setsid()  # Ctrl-C in the terminal reaches only the parent, which stops us in order
    stop_when_orphaned()
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except FileNotFoundError:
        # The parent was stopped while the forkserver was starting us (Ctrl-C in the first
        # seconds) and removed its workspace: there is nothing to measure for anyone.
        raise SystemExit(0) from None
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # The forkserver started with the environment of the parent's first worker; settings
    # (OFFLOAD_*, CUBLAS_WORKSPACE_CONFIG) are read later, so take the parent's current one.
    os.environ.clear()
    os.environ.update(environ)
    sys.exit(main([spec_path, out_path]))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m offload.bench.worker SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec_path, out_path = argv
    signal.signal(signal.SIGTERM, _interrupt)
    level = os.environ.get("OFFLOAD_LOG", "WARNING").upper()
    logging.basicConfig(level=level if level in logging.getLevelNamesMapping() else "WARNING",
                        stream=sys.stderr, format="%(name)s %(levelname)s: %(message)s")
    with open(spec_path) as f:
        spec = RunSpec.from_json(f.read())
    try:
        result = run(spec)
    except KeyboardInterrupt:
        return 130
    tmp = out_path + ".part"
    with open(tmp, "w") as f:
        f.write(result.to_json())
    os.replace(tmp, out_path)
    return 1 if result.error else 0


if __name__ == "__main__":
    sys.exit(main())
