"""Error classes users can catch and act on.

Every message names the setting or argument at fault, the value seen, and what to do.
"""
from __future__ import annotations

import errno as _errno
import os

__all__ = ["OffloadError", "ConfigError", "StorageError", "ExtensionUnavailable", "TierFullError",
           "UsedAfterCloseError"]


def short_repr(value: object, limit: int = 120) -> str:
    """`value` as an error message shows it: its repr when that is a string or one short
    line, else its type (a state dict's or a model's repr runs to thousands of lines)."""
    text = repr(value)
    if isinstance(value, (str, os.PathLike)) or (len(text) <= limit and "\n" not in text):
        return text
    size = f" of {len(value)}" if isinstance(value, (list, tuple, dict, set)) else ""
    return f"<{type(value).__name__}{size}>"


class OffloadError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(OffloadError, ValueError):
    """A setting (environment variable or keyword argument) is invalid.

    Raised before the first forward, before anything touches the disk.
    """


class StorageError(OffloadError, OSError):
    """An I/O call failed. Keeps `errno`, the file path, and where in it (offset, size).

    `StorageError(errno.ENOSPC, "...")` has `.errno == errno.ENOSPC`, so callers can
    branch on errno exactly as they would on a plain OSError.
    """

    def __init__(self, err: int, message: str, filename: str | None = None,
                 offset: int | None = None, nbytes: int | None = None):
        where = []
        if offset is not None:
            where.append(f"offset={offset}")
        if nbytes is not None:
            where.append(f"size={nbytes}")
        text = f"{message} [{_errno.errorcode.get(err, err)}: {os.strerror(err)}]"
        if where:
            text += " (" + ", ".join(where) + ")"
        super().__init__(err, text, filename)
        self.offset = offset
        self.nbytes = nbytes


class ExtensionUnavailable(OffloadError, ImportError):
    """The compiled core `offload._C` is missing or failed to load; the reason is kept."""


class TierFullError(OffloadError, RuntimeError):
    """Every tier is full and OFFLOAD_STRICT=1 forbids keeping the tensor on the device."""


class UsedAfterCloseError(OffloadError, RuntimeError):
    """Something was used after it was closed or released: a saved tensor whose context freed
    it (the block raised, or `close()` ran before backward), a closed tier, store, arena
    block or copy stream. The one class for all of them, from Python and from the C++ core."""
