"""Measuring a step: time, peak memory, saved-bytes accounting, gradient files.

Peak activation memory is "how much more memory the step needed than the model at rest":

* CUDA: ``torch.cuda.max_memory_allocated()`` during the step minus
  ``torch.cuda.memory_allocated()`` at its start (parameters and gradient buffers are already
  allocated then, see the worker), maximum over the measured steps.
* CPU: peak resident set size of the worker process during the timed steps minus its RSS
  after the warm-up, once freed heap pages went back to the OS (``malloc_trim``). Measuring
  from before the first step instead would charge one-time costs to the step: the first
  ``torch.utils.checkpoint`` call imports ~800 modules (~74 MiB RSS, measured). That growth
  is kept apart as ``warmup_rss_delta_bytes``. The peak comes from a thread sampling
  ``/proc/self/statm`` every 10 ms (more often steals time from the compute threads on a
  small machine), and is exact whenever it beats the lifetime maximum ``ru_maxrss``.

Resident activation bytes ("our accounting") count the storages autograd keeps for backward,
see :class:`SavedBytesCounter`.
"""
from __future__ import annotations

import os
import resource
import threading

import torch

__all__ = ["current_rss_bytes", "RssPeak", "release_free_memory", "SavedBytesCounter",
           "param_storage_ptrs", "save_grads", "compare_grads", "synchronize"]

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

    def rebase(self) -> None:
        """End of warm-up: keep its growth apart, return freed pages, measure from here."""
        self._exact_peak()
        self.warmup_delta_bytes = max(0, self.peak_bytes - self.baseline_bytes)
        release_free_memory()
        self.baseline_bytes = self.peak_bytes = current_rss_bytes()
        self._max_rss_before = _max_rss_bytes()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._exact_peak()

    @property
    def peak_delta_bytes(self) -> int:
        return max(0, self.peak_bytes - self.baseline_bytes)


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc `malloc_trim`), so RSS shows live memory.

    Without it the allocator keeps the first step's pages and later steps show no growth.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS growth then shows only the first step
        pass


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
        (bit_exact, max_abs_diff, names that differ). `bit_exact` is `torch.equal` on every
        gradient; a missing/extra gradient or a shape/dtype change counts as a difference
        with an infinite max_abs_diff.
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
        if not torch.equal(a, b):
            bit_exact = False
            differ.append(name)
            max_diff = max(max_diff, (a.double() - b.double()).abs().max().item())
    return bit_exact, max_diff, differ

