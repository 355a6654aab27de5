"""Checks for a file a command line tool writes at its end (`offload-bench --json`, `--plot`),
made before the work, so that a bad path is a usage error and not a traceback after it."""
from __future__ import annotations

import os
import tempfile

__all__ = ["output_file_problem"]


def output_file_problem(path: str, example: str = "out.json") -> str | None:
    """Why `path` cannot be written as a file, or None. Creates and removes one temporary
    file next to it: permission bits do not tell (root passes them; /proc refuses anyway).

    Args:
        example: a file name for the message when `path` is a directory.
    """
    full = os.path.abspath(path)
    if os.path.isdir(full):
        return (f"{path!r} is a directory; name a file in it "
                f"(e.g. {os.path.join(path, example)})")
    directory = os.path.dirname(full)
    if not os.path.isdir(directory):
        return f"the directory {directory!r} does not exist (create it, or name another file)"
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".offload-write-check-"):
            pass
    except OSError as exc:
        return (f"cannot create a file in {directory!r} ({exc.strerror or exc}); "
                "name a file in a directory you can write")
    return None
