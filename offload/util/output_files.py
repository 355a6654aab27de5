"""Files offload writes where the user says (`offload-bench --json`, `--plot`,
OFFLOAD_TRACE): the checks made before the work, so that a bad path is a usage error and
not a traceback after it, and the write itself."""
from __future__ import annotations

import os
import secrets
import stat
import tempfile
from typing import IO, Callable

__all__ = ["output_file_problem", "write_output_file"]


def write_output_file(path: str | os.PathLike, write: Callable[[IO[str]], None]) -> str:
    """Write a text file at `path` with `write(f)`, as the user means it: a regular file (or
    a new one) is replaced at once, from a temporary file next to it (a reader never sees
    half of it, a failure leaves the old one), keeping its permission bits (a new file gets
    the umask's, as `open` gives); through a symbolic link, the file it points at (the link
    stays); anything else there (a FIFO, /dev/stdout, a device) is written in place, never
    replaced by a file. Returns the path."""
    path = os.fspath(path)
    try:
        st = os.stat(path)   # follows links
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        with open(path, "w") as f:
            write(f)
        return path
    real = os.path.realpath(path)
    tmp = os.path.join(os.path.dirname(real),
                       f".{os.path.basename(real)}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)   # (the umask applies)
    try:
        with os.fdopen(fd, "w") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
        os.replace(tmp, real)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def output_file_problem(path: str, example: str = "out.json") -> str | None:
    """Why `path` cannot be written as a file, or None. Creates and removes one temporary
    file next to it: permission bits do not tell (root passes them; /proc refuses anyway).

    Args:
        example: a file name for the message when `path` is a directory.
    """
    if not path:
        return f"an empty path; name a file (e.g. {example})"
    full = os.path.realpath(path)   # a link: where its file goes (write_output_file)
    if os.path.exists(full) and not os.path.isdir(full) and not os.path.isfile(full):
        return None   # a FIFO, /dev/stdout, a device: written in place (write_output_file)
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
