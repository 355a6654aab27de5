"""buffers.py's copies keep what overlaps overlapping (rule 1), and structure.py's hooks
are installed only once a block is guarded."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from offload.schedule.buffers import _copy_together


def test_copies_of_views_of_one_tensor_are_views_of_one_copy():
    """A buffer that is a view of another (a row, a column, a transpose, another dtype)
    must stay one: a re-run's in-place update of the one is read through the other."""
    a = torch.arange(24.0).reshape(4, 6)
    views = [a, a[1], a[:, 2], a.t(), a[2:, 3:], a.view(torch.int32)[0]]
    alone = [torch.ones(3), torch.zeros(0), torch.ones(2, 3).t()]
    with torch.no_grad():
        copies = _copy_together(views + alone + [a[1]])
    got = [copies[id(t)] for t in views + alone]
    for original, copy in zip(views + alone, got):
        assert torch.equal(original, copy)
        assert (copy.shape, copy.stride()) == (original.shape, original.stride())
        assert copy.data_ptr() != original.data_ptr() or not original.numel()
    got[0].mul_(2)   # written through the copy of `a`: every view of it sees it
    for original, copy in zip(views[1:], got[1:len(views)]):
        assert torch.equal(copy, original * 2) if copy.dtype == a.dtype else \
            torch.equal(copy, (a * 2).view(torch.int32)[0])
    assert torch.equal(a, torch.arange(24.0).reshape(4, 6))   # the original is untouched
    shared = {copy.untyped_storage().data_ptr() for copy in got[:len(views)]}
    assert len(shared) == 1
    assert got[len(views)].untyped_storage().data_ptr() not in shared


def test_tensors_overlapping_on_storages_of_their_own_are_each_copied():
    """`torch.from_numpy` of overlapping slices of one array: two storages over one stretch
    of memory, which no storage holds (before: the stretch was set on the first storage,
    past its end: RuntimeError at the block's call)."""
    numpy = pytest.importorskip("numpy")
    array = numpy.arange(16, dtype=numpy.float32)
    p, q = torch.from_numpy(array[0:8]), torch.from_numpy(array[4:12])
    with torch.no_grad():
        copies = _copy_together([p, q])
    assert torch.equal(copies[id(p)], p) and torch.equal(copies[id(q)], q)
    assert copies[id(p)].data_ptr() != p.data_ptr()


def test_importing_offload_installs_no_module_registration_hook():
    """structure.py's global hooks come with the first guarded block, not with the import."""
    code = ("import offload, torch.nn.modules.module as m; "
            "print(len(m._global_module_registration_hooks), "
            "len(m._global_buffer_registration_hooks))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["0", "0"]
