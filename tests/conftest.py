"""Shared fixtures: a temporary NVMe directory that must be empty afterwards, and markers."""
from __future__ import annotations

import gc
import os
import shutil
import tempfile

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "cuda_toolkit: checks against the CUDA toolkit's headers; "
                            "runs wherever they are installed, and with the cuda tests on a GPU")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.addinivalue_line("markers", "trials: an auto test that lets the plan be measured against the pure strategies")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def nvme_dir():
    """A fresh directory on the machine's real disk (not tmpfs: O_DIRECT must work).

    Teardown asserts it is empty: nothing the runtime writes may outlive its use.
    """
    base = os.environ.get("OFFLOAD_TEST_DIR", "/var/tmp")
    path = tempfile.mkdtemp(prefix="offload-test-", dir=base)
    try:
        yield path
        left = os.listdir(path)
        assert left == [], f"files left behind in the NVMe directory: {left}"
        # Slabs have no name (O_TMPFILE): a leaked one is only visible as a descriptor.
        # After the stores kept for a next step are closed, none may point here.
        import offload

        gc.collect()
        offload.empty_cache()
        held = descriptors_into(path)
        assert held == [], f"slab files still open in the NVMe directory: {held}"
    finally:
        shutil.rmtree(path, ignore_errors=True)


def answer_from_forked_child(target, *args, timeout_s: float = 30):
    """Run `target(*args, conn)` in a forked child and return what it sends on `conn`
    (failing the test when it sends nothing within `timeout_s`)."""
    import multiprocessing

    fork = multiprocessing.get_context("fork")
    parent_end, child_end = fork.Pipe()
    child = fork.Process(target=target, args=(*args, child_end))
    child.start()
    if not parent_end.poll(timeout_s):
        child.kill()   # hung: not left behind
        child.join()
        raise AssertionError(f"{target.__name__} sent nothing in {timeout_s} s")
    answer = parent_end.recv()
    child.join(10)
    return answer


def descriptors_into(directory: str) -> list[str]:
    """This process's open descriptors whose target lies in `directory` (a slab shows as
    'directory/#1234 (deleted)')."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target.startswith(directory.rstrip("/") + "/"):
            found.append(target)
    return found


@pytest.fixture
def small_disk():
    """A fresh 64 MiB ext4 file system (loop-mounted; skipped where mounting is refused),
    with no NVMe store or arena of earlier tests kept open."""
    import offload
    from mounts import mounted

    offload.empty_cache()
    with mounted("ext4", size_bytes=64 << 20) as point:
        yield point
        offload.empty_cache()


@pytest.fixture(params=["core", "python"])
def path(request, monkeypatch):
    """The core's records and handles, or the Python path's (a Python meter makes Python
    records, and their saves Python handles)."""
    if request.param == "python":
        from offload.runtime import records
        from offload.runtime.saved_bytes import PySavedBytes

        monkeypatch.setattr(records, "saved_bytes_meter", PySavedBytes)
    return request.param


@pytest.fixture
def auto_plan_only(request, tmp_path, monkeypatch):
    """For `auto` tests (`pytestmark = pytest.mark.usefixtures("auto_plan_only")`): one torch
    thread (tiny models on a busy 2-core machine), a probe cache of the test's own, and the
    plan run as it is, not timing-chosen trial steps of the whole-block strategies (a test
    marked @pytest.mark.trials opts in to those)."""
    from offload.schedule import search

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    if "trials" not in request.keywords:
        monkeypatch.setattr(search, "TRIAL_MARGIN", -1.0)
    yield
    torch.set_num_threads(threads)
