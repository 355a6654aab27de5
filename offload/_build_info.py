"""`offload.build_info()`: what was built and what this process can use, in one dict.

    >>> offload.build_info()["gpu_usable"], offload.build_info()["gpu_unusable_reason"]
    (False, 'torch 2.13.0+cpu is a CPU-only build')

`offload-bench` prints `summary()` of it in its header and stores it in every JSON row, so a
result says which build produced it.
"""
from __future__ import annotations

from typing import Any

import torch

from . import _ext
from .util import gpu_support
from ._version import __version__

__all__ = ["build_info", "summary"]


def build_info() -> dict[str, Any]:
    """Version, build flavour, CUDA paths compiled in, GPU usable now (and why not).

    Keys: ``version`` (the Python package), ``core_version`` (the compiled core; None
    without it), ``build_flavour`` ("cuda-dlopen": CUDA paths compiled in and resolved at
    run time from torch's CUDA runtime; "cpu": built with OFFLOAD_BUILD_CUDA=0; "none": the
    core is not available), ``core_unavailable_reason``, ``cuda_compiled``, ``gpu_usable``,
    ``gpu_unusable_reason``, ``gpu_fix``, ``cuda_runtime`` (path and versions of the runtime
    the core calls, or None), ``torch``, ``torch_cuda``.

    Never raises. Initializes CUDA when torch can use it (as torch would at first use).
    """
    core = _ext.load_core() if _ext.core_available() else None
    gpu = gpu_support.status()
    return {
        "version": __version__,
        "core_version": getattr(core, "__version__", None),
        "build_flavour": core.build_flavour if core is not None else "none",
        "core_unavailable_reason": _ext.core_unavailable_reason(),
        "cuda_compiled": bool(core is not None and core.cuda_compiled),
        "gpu_usable": gpu.usable,
        "gpu_unusable_reason": gpu.reason,
        "gpu_fix": gpu.fix,
        # The runtime the core found, also when the GPU is not usable (diagnostics).
        "cuda_runtime": gpu.runtime or (core.cuda_runtime() if core is not None
                                        and core.cuda_compiled else None),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }


def summary(info: dict[str, Any]) -> str:
    """One line: "offload 0.1.0, core cuda-dlopen (CUDA paths compiled in); GPU: ..."."""
    flavour = info["build_flavour"]
    core = {"cuda-dlopen": "CUDA paths compiled in", "cpu": "CPU-only build"}.get(
        flavour, info.get("core_unavailable_reason") or "not available")
    if info["gpu_usable"]:
        rt = info.get("cuda_runtime") or {}
        version = rt.get("runtime_version") or 0
        gpu = f"usable (CUDA runtime {version // 1000}.{version % 1000 // 10})"
    else:
        gpu = f"not usable: {info['gpu_unusable_reason']}"
    mismatch = ""
    if info["core_version"] not in (None, info["version"]):
        mismatch = f" [core built as {info['core_version']}: rebuild it]"
    return (f"offload {info['version']}, core {flavour} ({core}){mismatch}; GPU {gpu}; "
            f"torch {info['torch']}")
