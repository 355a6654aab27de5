"""Measuring a step: time, peak memory, saved-bytes accounting, gradient files.

Peak activation memory is "how much more memory the step needed than the model at rest":

* CUDA: ``torch.cuda.max_memory_allocated()`` during the step minus
  ``torch.cuda.memory_allocated()`` at its start (parameters and gradient buffers are already
  allocated then, see the worker), maximum over the measured steps.
* CPU: peak resident set size of the worker process during the timed steps minus its RSS
  after the warm-up, once freed heap pages went back to the OS (``malloc_trim``). Measuring
  from before the first step instead would charge one-time costs to the step: the first
  ``torch.utils.checkpoint`` call imports ~800 modules (~74 MiB RSS, measured). That growth
  is kept apart as ``warmup_rss_delta_bytes``.

  Nothing a strategy keeps between steps may hide in that baseline: the runtime pools its
  NVMe staging arena (offload/tiers/pool.py) and the pages the warm-up touched would stay
  resident, so a baseline taken with them would hand the offload rows a discount that
  ``none`` never gets. So on CPU the worker drops the pool before the baseline
  (``RssPeak.rebase(release=...)``; ``released_bytes`` says how much RSS that gave back)
  and the first timed step re-creates the arena and pays for its pages, in memory and in
  time (the step time range shows it; the median of 3+ steps hardly moves). The peak comes
  from a thread sampling
  ``/proc/self/statm`` every 10 ms (more often steals time from the compute threads on a
  small machine), and is exact whenever it beats the lifetime maximum ``ru_maxrss``.

Resident activation bytes ("our accounting") count the storages autograd keeps for backward,
see :class:`SavedBytesCounter`.
"""
from __future__ import annotations

import os
import resource
import threading
from typing import Any, Callable

import torch

# Where the nvme tier's files live: rows.py and worker.py read them from here.
from offload.util.disk_space import RAM_FS_TYPES, fs_type  # noqa: F401

__all__ = ["current_rss_bytes", "RssPeak", "release_free_memory", "reset_peak_rss",
           "peak_anon_rss_bytes", "fs_type", "RAM_FS_TYPES",
           "SavedBytesCounter",
           "param_storage_ptrs", "grad_hashes", "compare_grad_hashes", "save_grads",
           "compare_grads", "synchronize"]

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def current_rss_bytes() -> int:
    """Resident set size of this process now (cheap: one read of /proc/self/statm)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except OSError:  # not Linux: psutil is a dependency anyway
        import psutil

        return psutil.Process().memory_info().rss


def _max_rss_bytes() -> int:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class RssPeak:
    """Peak RSS growth of this process over the steps (see module doc).

    Example:
        rss = RssPeak().start()
        warm_up()
        rss.rebase()          # one-time costs (imports, arenas) end up in the baseline
        run_steps()
        rss.stop()
        rss.peak_delta_bytes, rss.warmup_delta_bytes
    """

    def __init__(self, interval_s: float = 0.01):
        self.interval_s = interval_s
        self.baseline_bytes = 0
        self.peak_bytes = 0
        self.warmup_delta_bytes: int | None = None
        self.released_bytes: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "RssPeak":
        self.baseline_bytes = current_rss_bytes()
        self._max_rss_before = _max_rss_bytes()
        self.peak_bytes = self.baseline_bytes
        self._thread = threading.Thread(target=self._sample, name="offload-bench-rss",
                                        daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            rss = current_rss_bytes()
            if rss > self.peak_bytes:
                self.peak_bytes = rss

    def _exact_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, current_rss_bytes())
        max_rss = _max_rss_bytes()
        if max_rss > self._max_rss_before:
            # The lifetime peak moved since the baseline, so it is this region's exact peak.
            self.peak_bytes = max(self.peak_bytes, max_rss)

    def rebase(self, release: Callable[[], None] | None = None) -> None:
        """End of warm-up: keep its growth apart, return freed pages, measure from here.

        Args:
            release: drops what the strategy keeps between steps (pooled arenas), so it is
                not part of the baseline; the RSS this gave back is ``released_bytes``.
        """
        self._exact_peak()
        self.warmup_delta_bytes = max(0, self.peak_bytes - self.baseline_bytes)
        release_free_memory()
        if release is not None:
            before = current_rss_bytes()
            release()
            release_free_memory()
            self.released_bytes = max(0, before - current_rss_bytes())
        self.baseline_bytes = self.peak_bytes = current_rss_bytes()
        self._max_rss_before = _max_rss_bytes()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._exact_peak()

    @property
    def peak_delta_bytes(self) -> int:
        return max(0, self.peak_bytes - self.baseline_bytes)


def reset_peak_rss() -> bool:
    """Linux: set the kernel's peak RSS of this process's memory map (VmHWM in
    ``/proc/self/status``) to the RSS now, so that a later :func:`peak_anon_rss_bytes` is the
    peak of what ran in between. ``ru_maxrss`` is not reset: it also keeps the peak seen when
    any thread exited. False where the kernel refuses (``/proc/self/clear_refs`` missing or
    not writable)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _status_bytes() -> dict[str, int]:
    """The sizes in /proc/self/status ("VmHWM:  12 kB" -> {"VmHWM": 12288}); {} off Linux."""
    try:
        with open("/proc/self/status") as f:
            lines = [line.split() for line in f]
    except OSError:
        return {}
    return {words[0].rstrip(":"): int(words[1]) * 1024 for words in lines
            if len(words) == 3 and words[2] == "kB"}


def peak_anon_rss_bytes() -> int | None:
    """Peak RSS since the process started or :func:`reset_peak_rss`, less the file-backed and
    shared-memory pages mapped now: the peak of private anonymous memory (tensors, the heap,
    arenas; tensors in shared memory, such as batches from DataLoader workers, are not
    counted). None off Linux.

    The pages subtracted are those mapped at the call, not at the peak: file pages mapped
    after the peak lower the figure, file pages unmapped or reclaimed after it raise it. It
    is exact when neither happened, which holds once a warm-up step has run the same code
    (0 bytes of file-backed growth over a second step of the built-in GPT). File-backed
    pages are torch's shared libraries, and how many count depends on the page cache, not on
    the step: a kernel that maps large page-cache folios whole (6.18 does) maps a freshly
    installed torch 2 MiB at a time (docs/benchmarks.md, *Peak RSS per process*).
    """
    sizes = _status_bytes()
    try:
        return sizes["VmHWM"] - sizes["RssFile"] - sizes["RssShmem"]
    except KeyError:
        return None


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc `malloc_trim`), so RSS shows live memory.

    Without it the allocator keeps the first step's pages and later steps show no growth.
    Not glibc: a no-op, and RSS growth then shows only the first step.
    """
    from offload.tiers.heap import trim_heap

    trim_heap()


def param_storage_ptrs(model: torch.nn.Module) -> set[int]:
    """Storage addresses of every parameter and buffer: autograd saves views of them (e.g.
    ``weight.t()`` for a Linear), which are not activations and must not be counted."""
    ptrs = set()
    for t in list(model.parameters()) + list(model.buffers()):
        ptrs.add(t.untyped_storage().data_ptr())
    return ptrs


class SavedBytesCounter(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes autograd saves for backward inside the region.

    Counts each storage once (views share it, and the whole storage stays alive), skips
    parameter/buffer storages. Tensors are saved unchanged, so the step computes the same.
    As an outer hook it does not see what a checkpoint region saves inside itself: for
    `recompute` it counts exactly what stays resident between forward and backward.
    """

    def __init__(self, exclude_ptrs: set[int] = frozenset()):
        self.saved_bytes = 0
        self.saved_tensors = 0
        self._exclude = exclude_ptrs
        self._seen: set[int] = set()
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            ptr, nbytes = id(t), t.numel() * t.element_size()
        # Saved tensors are alive until backward, so an address cannot be reused meanwhile.
        if nbytes and ptr not in self._exclude and ptr not in self._seen:
            self._seen.add(ptr)
            self.saved_bytes += nbytes
            self.saved_tensors += 1
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so a wall-clock interval covers it (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _checksum():
    """(name, fn(buffer) -> int): the core's CRC-32C (GB/s) where built, else zlib's CRC-32."""
    try:
        from offload._ext import load_core

        return "crc32c", load_core().crc32c
    except Exception:  # no compiled core: the check must still work for none/recompute
        import zlib

        return "crc32", zlib.crc32


def grad_hashes(model: torch.nn.Module) -> dict[str, Any]:
    """A checksum of every parameter's gradient bytes (None where it got none).

    Taken after every timed step, so the gradient check covers each step, not only the last
    one (whose full tensors are saved for the max abs diff). A CRC catches any change of a
    few bits for sure, so a one-ulp nudge never slips through.
    Returns ``{"algo": name, "grads": {param name: int | None}}``.
    """
    algo, fn = _checksum()
    out: dict[str, int | None] = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            out[name] = None
            continue
        flat = _bytes(g.detach().cpu())
        # Shape and dtype are part of "the same gradient" too.
        out[name] = fn(flat.numpy(), fn(f"{tuple(g.shape)}{g.dtype}".encode()))
    return {"algo": algo, "grads": out}


def compare_grad_hashes(ref_steps: list[dict[str, Any]], got_steps: list[dict[str, Any]]
                        ) -> tuple[bool | None, list[str], list[int]]:
    """Compare per-step checksums (from :func:`grad_hashes`) against the reference run's.

    Step k is compared with the reference's step k (every step computes the same gradients,
    see the worker); a run with more steps than the reference is compared with its last.

    Returns:
        (bit_exact, names that differ in any step, indices of the timed steps that differ).
        bit_exact is None when nothing can be compared (no steps, different checksums).
    """
    if not ref_steps or not got_steps:
        return None, [], []
    differ: set[str] = set()
    steps: list[int] = []
    for k, got in enumerate(got_steps):
        ref = ref_steps[min(k, len(ref_steps) - 1)]
        if ref["algo"] != got["algo"]:
            return None, [], []
        a, b = ref["grads"], got["grads"]
        bad = {n for n in set(a) | set(b) if a.get(n, "missing") != b.get(n, "missing")}
        if bad:
            differ |= bad
            steps.append(k)
    return not steps, sorted(differ), steps


def save_grads(model: torch.nn.Module, path: str) -> None:
    """Write every parameter's gradient (CPU copies; None where a parameter got none)."""
    grads = {name: (None if p.grad is None else p.grad.detach().cpu())
             for name, p in model.named_parameters()}
    tmp = path + ".part"
    torch.save(grads, tmp)
    os.replace(tmp, path)  # a reader never sees half a file


def compare_grads(ref_path: str, path: str) -> tuple[bool, float, list[str]]:
    """Compare two gradient files.

    Returns:
        (bit_exact, max_abs_diff, names that differ). `bit_exact`: every gradient's bytes
        are the same, as the per-step checksums compare them (`torch.equal` calls NaN
        unequal to itself: a model whose gradients hold NaN was "DIFF" against itself); a
        missing/extra gradient or a shape/dtype change counts as a difference with an
        infinite max_abs_diff, as does a NaN on one side only.
    """
    ref = torch.load(ref_path, mmap=True, weights_only=True)
    got = torch.load(path, mmap=True, weights_only=True)
    bit_exact, max_diff, differ = True, 0.0, []
    for name in sorted(set(ref) | set(got)):
        a, b = ref.get(name), got.get(name)
        if a is None and b is None:
            continue
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            bit_exact, max_diff = False, float("inf")
            differ.append(name)
            continue
        if not torch.equal(_bytes(a), _bytes(b)):
            bit_exact = False
            differ.append(name)
            max_diff = max(max_diff, _max_abs_diff(a, b))
    return bit_exact, max_diff, differ


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b|: infinite where one side is NaN and the other is not (Python's
    `max` with a NaN keeps the other figure, so a NaN vanished from the figure); 0 where
    only a zero's sign or a NaN's payload differs."""
    wide = torch.complex128 if a.is_complex() else torch.float64   # (double() drops .imag)
    a, b = a.to(wide), b.to(wide)
    if not torch.equal(a.isnan(), b.isnan()):
        return float("inf")
    diff = torch.where((a == b) | a.isnan(), 0.0, (a - b).abs())
    return diff.max().item() if diff.numel() else 0.0

