"""The stand-in CUDA runtime of tests/fake_cudart.c: built once per session, and check
scripts run against it, each in a subprocess (a runtime loaded into the test process would
stay for every later test). Not a test module (no test_ prefix).

    def test_x(fake_cudart):
        run(prelude(fake_cudart) + "...")

`prelude` loads the stand-in before torch (the core takes the first runtime among the
loaded libraries), makes `device` current on the script's thread as torch does on its own
threads, and defines `counter(name)`, `text(name)` and `check_engine_threads()`: the last
asserts that no call needed a device on a thread that never set one, that no event was
waited on by spinning, and that no context was made on another device than `device`.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

__all__ = ["compiler", "fake_cudart", "run", "prelude"]


def compiler(kind: str) -> str:
    for name in (("cc", "gcc") if kind == "c" else ("c++", "g++")):
        if shutil.which(name):
            return name
    pytest.skip(f"no {kind} compiler on this machine")


@pytest.fixture(scope="session")
def fake_cudart(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("fake-cudart") / "libcudart.so.99"
    subprocess.run([compiler("c"), "-shared", "-fPIC", "-O1", "-pthread", "-o", str(out),
                    os.path.join(HERE, "fake_cudart.c")], check=True)
    return str(out)


def run(script: str, env: dict | None = None, timeout_s: float = 120) -> str:
    """Runs `script` (dedented) with the repository as working directory; its stdout."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def prelude(load_first: str | None = None, device: int | None = 0) -> str:
    """Imports and helpers for a check script (see the module doc); `device=None` leaves
    the script's thread without a device."""
    first = f"fake = ctypes.CDLL({load_first!r})" if load_first else ""
    select = f"assert fake.cudaSetDevice({device}) == 0" if load_first and device is not None else ""
    return f"""
    import ctypes, gc, os, sys, tempfile, threading
    {first}
    import torch
    from offload._ext import load_core
    C = load_core()
    {select}
    def counter(name):
        return ctypes.c_ulong.in_dll(fake, name).value
    def text(name):
        return (ctypes.c_char * 64).in_dll(fake, name).value.decode()
    def check_engine_threads(device={device!r}):
        assert counter("fake_calls_without_device") == 0, (
            "a CUDA call on a thread that never set its device: "
            + text("fake_first_call_without_device"))
        assert counter("fake_spin_syncs") == 0, "an event was waited on by spinning"
        assert counter("fake_contexts") == 1 << device, bin(counter("fake_contexts"))
"""
