"""The parent side: workspace, one worker process per run, gradient checks, rows.

Rules this module keeps (tests check them):

1. Nothing is left behind. Every file the benchmark makes (specs, results, logs, gradient
   files, the NVMe directories) lives in directories :class:`Workspace` creates and removes on
   exit -- normal end, exception, Ctrl-C or SIGTERM alike. A worker that crashes or is killed
   leaves its debris there too.
2. Workers run in their own session (forked from a forkserver that ignores SIGINT), so Ctrl-C
   reaches only the parent, which stops the worker with SIGTERM (the worker unwinds its
   ``with`` blocks), then SIGKILL after a grace period.
3. A worker that dies or times out becomes a row with ``available=False`` and the reason.
4. ``none`` always runs first in round 1: its gradients are the reference every other run
   (and later ``none`` rounds) is compared against, each as soon as it arrives, so at most
   two gradient files exist at a time. Every timed step counts: the checksums of each
   step's gradients against ``none``'s same step, and the last step's full tensors (which
   also give the max abs diff).
"""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from offload.bench import measure
from offload.bench.result import KILLED_OOM, TIMED_OUT, RunResult
from offload.bench.spec import RunSpec

__all__ = ["Workspace", "WorkerRunner", "GradChecker", "schedule"]

_log = logging.getLogger("offload")

_TERM_GRACE_S = 10.0


class Workspace:
    """Temporary directories for one benchmark (see Rule 1).

    Args:
        nvme_bases: directories to create the NVMe scratch directories in (one each).
        tmp_base: where specs, results, logs and gradient files go (None: the system default).
    """

    def __init__(self, nvme_bases: list[str], tmp_base: str | None = None):
        self._nvme_bases = nvme_bases
        self._tmp_base = tmp_base
        self.root = ""
        self.nvme_dirs: list[str] = []
        self._counter = itertools.count()

    def __enter__(self) -> "Workspace":
        try:
            # named by the benchmark's pid: whose it is, among several runs
            self.root = tempfile.mkdtemp(prefix=f"offload-bench-{os.getpid()}-",
                                         dir=self._tmp_base)
            for base in self._nvme_bases:
                self.nvme_dirs.append(tempfile.mkdtemp(prefix="offload-bench-nvme-", dir=base))
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def cleanup(self) -> None:
        for path in [self.root, *self.nvme_dirs]:
            if path:
                shutil.rmtree(path, ignore_errors=True)

    @property
    def nvme_dir(self) -> str:
        return ",".join(self.nvme_dirs)

    def new_paths(self, stem: str) -> tuple[str, str, str, str]:
        """Fresh (spec, result, log, grads) paths for one worker run."""
        n = next(self._counter)
        base = os.path.join(self.root, f"{n:03d}-{stem}")
        return base + ".spec.json", base + ".out.json", base + ".log", base + ".grads.pt"

    def clear_nvme(self) -> list[str]:
        """Empty the NVMe directories; returns what was left there (a runtime bug)."""
        left = []
        for d in self.nvme_dirs:
            for name in os.listdir(d):
                left.append(os.path.join(d, name))
                path = os.path.join(d, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.unlink(path)
        return left


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Deterministic cuBLAS (needed by torch.use_deterministic_algorithms on CUDA).
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return env


def _forkserver(preload: tuple[str, ...] = ()) -> multiprocessing.context.BaseContext:
    """Workers fork from a server that has imported torch and this package once.

    Importing torch takes 2-5 s on a small machine, per worker; the fork takes milliseconds.
    The server ran no computation, so each worker still starts with no allocator cache,
    no thread pool, no CUDA context and no runtime state: as fresh as a new interpreter.
    `preload` adds modules (--hf: transformers' modeling module); they count only if this
    call starts the server (one per process), which is the first run of a benchmark.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["offload.bench.worker", *preload])
    _start_ignoring_ctrl_c()
    return ctx


def _start_ignoring_ctrl_c() -> None:
    """Start the forkserver (when not running yet) with SIGINT ignored from its first
    instruction: Ctrl-C reaches the terminal's whole process group, and the server ignores
    it only once its imports are done, so one in its first seconds (importing torch)
    printed a KeyboardInterrupt traceback of its own, after the parent's "interrupted"
    line. An ignored signal stays ignored across exec, and Python then leaves it so; its
    workers inherit that (they run in their own session anyway: rule 2). The parent
    ignores Ctrl-C only while it forks the server."""
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():
        forkserver.ensure_running()   # (signal handlers belong to the main thread)
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


def _log_tail(path: str, lines: int = 6) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()[-4000:]
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


class WorkerRunner:
    """Runs :func:`offload.bench.worker.child_entry` for one spec, returns its result."""

    def __init__(self, ws: Workspace, timeout_s: float, preload: tuple[str, ...] = ()):
        self.ws = ws
        self.timeout_s = timeout_s
        self.preload = preload

    def run(self, spec: RunSpec, save_grads: bool = False) -> RunResult:
        from offload.bench.worker import child_entry

        spec_path, out_path, log_path, grads_path = self.ws.new_paths(spec.strategy)
        spec = spec.replace(nvme_dir=self.ws.nvme_dir,
                            grads_path=grads_path if save_grads else None)
        with open(spec_path, "w") as f:
            f.write(spec.to_json())
        t0 = time.perf_counter()
        proc = _forkserver(self.preload).Process(
            target=child_entry, name=f"offload-bench-{spec.strategy}",
            args=(spec_path, out_path, log_path, _child_env()))
        try:
            proc.start()   # (Ctrl-C here: a worker the forkserver starts later exits at once)
            timed_out = self._wait(proc)
        except BaseException:
            _stop(proc)
            raise
        wall_s = time.perf_counter() - t0
        left = self.ws.clear_nvme()
        result = self._read(spec, proc.exitcode, timed_out, out_path, log_path)
        result.wall_s = wall_s
        if left:
            _log.warning("%s left %d file(s) in the NVMe directory: %s", spec.strategy,
                         len(left), left[:3])
            result.nvme_leftover_files = len(left)
        for path in (spec_path, out_path, log_path):
            _unlink(path)
        return result

    def _wait(self, proc) -> bool:
        deadline = time.monotonic() + self.timeout_s
        while True:
            proc.join(timeout=0.2)  # short waits keep Ctrl-C responsive
            if proc.exitcode is not None:
                return False
            if time.monotonic() > deadline:
                _stop(proc)
                return True

    def _read(self, spec, returncode, timed_out, out_path, log_path) -> RunResult:
        if not timed_out and os.path.exists(out_path):
            with open(out_path) as f:
                return RunResult.from_json(f.read())
        result = RunResult(strategy=spec.strategy, batch=spec.batch, error=True)
        if timed_out:
            result.reason = f"failed: {TIMED_OUT} after {self.timeout_s:g} s " \
                            "(raise --timeout-s)"
        else:
            how = (f"killed by signal {-returncode}" if returncode < 0
                   else f"exit code {returncode}")
            if returncode == -signal.SIGKILL:   # what the kernel's OOM killer sends
                how += f" ({KILLED_OOM})"
            tail = _log_tail(log_path)
            result.reason = f"failed: worker {how}" + (f": {tail}" if tail else "")
        return result


def _stop(proc) -> None:
    if proc.pid is None or proc.exitcode is not None:   # not started (yet), or ended
        return
    proc.terminate()  # SIGTERM: the worker unwinds its `with` blocks
    proc.join(timeout=_TERM_GRACE_S)
    if proc.exitcode is None:
        proc.kill()
        proc.join()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@dataclass
class GradCheck:
    bit_exact: bool | None
    max_abs_diff: float
    differ: list[str]
    differ_steps: list[int]


@dataclass
class GradChecker:
    """Compares each run's gradients against the first `none` run's (Rule 4).

    A run brings its last step's gradient file (deleted once compared) and the checksums
    of every timed step's gradients.
    """

    reference: str = "none"
    ref_path: str | None = None
    ref_hashes: list[dict[str, Any]] | None = None
    pending: list[tuple[str, str | None, list]] = field(default_factory=list)
    results: dict[str, list[GradCheck]] = field(default_factory=dict)

    def add(self, strategy: str, path: str | None, hashes: list | None = None) -> None:
        hashes = hashes or []
        if path and not os.path.exists(path):
            path = None
        if not path and not hashes:
            return
        if strategy == self.reference and self.ref_path is None and self.ref_hashes is None:
            self.ref_path, self.ref_hashes = path, hashes
            pending, self.pending = self.pending, []
            for name, p, h in pending:
                self.add(name, p, h)
            return
        if self.ref_path is None and self.ref_hashes is None:
            self.pending.append((strategy, path, hashes))
            return
        try:
            exact, max_diff, differ = True, 0.0, []
            if path and self.ref_path:
                exact, max_diff, differ = measure.compare_grads(self.ref_path, path)
            elif path or self.ref_path:
                exact = None  # one side has no file: the last step is not comparable
        finally:
            if path:
                _unlink(path)
        steps: list[int] = []
        if hashes or self.ref_hashes:
            h_exact, h_differ, steps = measure.compare_grad_hashes(self.ref_hashes or [], hashes)
            differ = sorted(set(differ) | set(h_differ))
            exact = None if exact is None or h_exact is None else (exact and h_exact)
        self.results.setdefault(strategy, []).append(GradCheck(exact, max_diff, differ, steps))

    def close(self) -> None:
        for _, path, _ in self.pending:
            if path:
                _unlink(path)
        self.pending = []
        if self.ref_path:
            _unlink(self.ref_path)

    def summary(self, strategy: str) -> tuple[bool | None, float | None, list[str], list[int]]:
        """(bit_exact, max_abs_diff of the last steps, names, timed-step indices that differ)."""
        checks = self.results.get(strategy)
        if not checks:
            return None, None, [], []
        differ = sorted({n for c in checks for n in c.differ})
        steps = sorted({k for c in checks for k in c.differ_steps})
        exact = None if any(c.bit_exact is None for c in checks) else \
            all(c.bit_exact for c in checks)
        return exact, max(c.max_abs_diff for c in checks), differ, steps


def schedule(strategies: list[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, strategy) in run order: forward in odd rounds, reversed in even ones, so slow
    drift of the machine (thermal, page cache, other tenants) does not favour one position;
    `none` leads round 1 (Rule 4)."""
    order = sorted(strategies, key=lambda s: s != "none")
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):
            yield r, name

