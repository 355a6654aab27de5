"""The one place that imports the compiled core `offload._C`.

`import offload` must work without it (a source checkout that was never built, a broken
toolchain, a wheel built for another Python): the failure is recorded here, and raised as
`ExtensionUnavailable` only when a feature that needs the core is used.

    from offload._ext import load_core
    core = load_core()            # the module, or ExtensionUnavailable with the reason
    store = core.NvmeStore(["/mnt/nvme"], 8 << 30)
"""
from __future__ import annotations

import importlib
import logging
import threading
from types import ModuleType

from .errors import ExtensionUnavailable

__all__ = ["load_core", "core_attr", "core_available", "core_unavailable_reason",
           "HOW_TO_BUILD"]

_log = logging.getLogger("offload")
_lock = threading.Lock()
_module: ModuleType | None = None
_reason: str | None = None
_tried = False

HOW_TO_BUILD = ("build it with `pip install -e .` from the source checkout (a C++17 compiler, "
                "CMake >= 3.18 and pybind11 are needed; no CUDA toolkit), or install a wheel")


def _try_import() -> None:
    global _module, _reason, _tried
    with _lock:
        if _tried:
            return
        try:
            _module = importlib.import_module("offload._C")
        except Exception as exc:  # ImportError, or an OSError from the dynamic loader
            _reason = f"{type(exc).__name__}: {exc}"
            _log.debug("offload._C is unavailable: %s", _reason)
        _tried = True


def load_core() -> ModuleType:
    """Return the compiled core module.

    Raises:
        ExtensionUnavailable: `offload._C` is missing or failed to load; the message keeps
            the original import error and says how to build it.
    """
    _try_import()
    if _module is None:
        raise ExtensionUnavailable(
            f"the compiled core offload._C is not available ({_reason}); {HOW_TO_BUILD}")
    return _module


def core_attr(name: str):
    """`offload._C.<name>`, or None when the core is missing or was built before it existed
    (the feature that needs it then says so when used); never raises."""
    _try_import()
    return getattr(_module, name, None) if _module is not None else None


def core_available() -> bool:
    """True when `offload._C` imported; never raises."""
    _try_import()
    return _module is not None


def core_unavailable_reason() -> str | None:
    """Why `offload._C` could not be imported, or None when it is available."""
    _try_import()
    return _reason
