"""Shared fixtures: a temporary NVMe directory that must be empty afterwards, and markers."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


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
    finally:
        shutil.rmtree(path, ignore_errors=True)


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
