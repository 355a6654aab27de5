"""Whether this process can use the GPU paths, and if not, why: the one place that decides.

The GPU paths (pinned host arena, copies on side streams, NVMe I/O chained with device
copies) need three things: a torch that can use the GPU (`torch.cuda.is_available()`), the
compiled core with its CUDA paths (every build has them unless OFFLOAD_BUILD_CUDA=0), and
the CUDA runtime torch loaded, found by the core at run time (csrc/cudart.hpp says why that
one). `offload.activations()` asks `require_gpu_paths` when it is built, so a missing piece
is a ConfigError naming the cause and the fix before the first forward, never an error in
the middle of one; `offload.build_info()` reports `status()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import _ext
from ..errors import ConfigError

__all__ = ["GpuStatus", "status", "require_gpu_paths", "may_see_cuda_tensors"]


@dataclass(frozen=True)
class GpuStatus:
    """`usable`: the GPU paths can run now. Otherwise `reason` says why and `fix` what to do."""

    usable: bool
    reason: str | None = None
    fix: str | None = None
    runtime: dict[str, Any] | None = None  # the CUDA runtime the core calls (path, versions)


def status() -> GpuStatus:
    """Ask torch, then the core; never raises. Initializes CUDA (as torch would at first use)."""
    if torch.version.hip is not None:
        return GpuStatus(False, f"torch {torch.__version__} is a ROCm build; the GPU paths call "
                         "the CUDA runtime", "use a CUDA build of torch, or run on the CPU")
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return GpuStatus(False, f"torch {torch.__version__} is a CPU-only build",
                             "install a CUDA build of torch to use a GPU")
        return GpuStatus(False, f"torch.cuda.is_available() is False (torch {torch.__version__}, "
                         f"CUDA {torch.version.cuda}: no driver, no device, or "
                         "CUDA_VISIBLE_DEVICES hides them)",
                         "check nvidia-smi and CUDA_VISIBLE_DEVICES")
    if not _ext.core_available():
        return GpuStatus(False, "the compiled core offload._C is not available "
                         f"({_ext.core_unavailable_reason()})", _ext.HOW_TO_BUILD)
    core = _ext.load_core()
    if not core.cuda_compiled:
        return GpuStatus(False, "offload._C was built without its CUDA paths "
                         "(OFFLOAD_BUILD_CUDA=0)",
                         "reinstall offload with OFFLOAD_BUILD_CUDA unset; no CUDA toolkit "
                         "is needed")
    runtime = core.cuda_runtime()
    if not core.cuda_usable():
        if runtime is None:
            fix = ("the core calls the CUDA runtime torch loaded (libcudart.so.N) and finds none "
                   "loaded; with a torch that links it statically, load one first: "
                   "ctypes.CDLL('libcudart.so.N')")
        else:
            fix = (f"the core calls {runtime['path']}, the first CUDA runtime loaded in this "
                   "process; if torch uses another one, import torch before anything that "
                   "loads a CUDA runtime of its own")
        return GpuStatus(False, f"torch can use the GPU but offload's core cannot: "
                         f"{core.cuda_unusable_reason()}", fix, runtime)
    return GpuStatus(True, runtime=runtime)


def may_see_cuda_tensors(model: torch.nn.Module | None) -> bool:
    """Whether a context may be handed CUDA tensors: torch can use a GPU, and the model (when
    given) has a parameter or buffer on one, or none at all."""
    if not torch.cuda.is_available():
        return False
    if model is None:
        return True
    tensors = [*model.parameters(), *model.buffers()]
    return not tensors or any(t.is_cuda for t in tensors)


def require_gpu_paths(what: str) -> None:
    """Raise ConfigError naming the cause and the fix when the GPU paths cannot be used.

    Args:
        what: The caller and the settings that need them, for the message
            (e.g. "offload.activations(tiers='host,nvme')").
    """
    s = status()
    if not s.usable:
        raise ConfigError(f"{what}: CUDA tensors would be moved, but the GPU paths cannot be "
                          f"used: {s.reason} ({s.fix}; to train on the CPU only, hide the GPU "
                          "with CUDA_VISIBLE_DEVICES='' or pass model= with the model on the CPU)")
