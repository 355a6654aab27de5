"""Each safety mechanism, switched off, is caught by the suite's own check for it. A mechanism
no test can catch being removed is not tested.

| mechanism | its check | sabotage here |
|---|---|---|
| store close (slab descriptors) | conftest `nvme_dir` teardown: `descriptors_into` | stores never closed |
| the version check | tests/test_inplace.py (autograd's error) | `check_version` of every saved kind a no-op |
| the fork handler | tests/test_fork.py (the child's descriptors) | child keeps inherited stores |
| the checksum on read | tests/test_storage_errors.py | checksums off (there) |
| each stream wait / record_stream | tests/test_copy_protocol.py `test_noteN_without_...` | (there) |
| the leak check | tests/test_leaks.py | each step's stats kept (run by hand, in the issue note) |
| untracked aliases (copy + layout key) | tests/test_untracked_aliases.py | no tensor seen as one |
| ... the private copy alone | test_a_saved_unsafe_chunk_comes_back_as_saved (bytes) | the whole storage moved |
"""
from __future__ import annotations


import pytest
import torch

import offload
import offload.tiers
from offload.tiers import nvme_space
from conftest import answer_from_forked_child, descriptors_into
from test_inplace import relu_inplace


class _NeverClosed:
    """An NvmeStore whose close() does nothing (the sabotage); `real` closes it after."""

    def __init__(self, store):
        self.real = store

    def close(self):
        pass

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_sabotage_store_close_is_caught_by_the_descriptor_check(nvme_dir, monkeypatch):
    made = []
    original = nvme_space.acquire

    def acquire(dirs, settings, open_store, *rest):
        return original(dirs, settings,
                        lambda: made.append(_NeverClosed(open_store())) or made[-1], *rest)

    monkeypatch.setattr(nvme_space, "acquire", acquire)
    x = torch.randn(256, 256, requires_grad=True)
    try:
        with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0):
            (x * 2).sin().sum().backward()
        offload.empty_cache()          # "closes" the idle store: a no-op now
        assert descriptors_into(nvme_dir) != [], "the fixture's check would not see the leak"
    finally:
        for store in made:
            store.real.close()
    assert descriptors_into(nvme_dir) == []


def test_sabotage_version_check_lets_the_reproducer_train_on(nvme_dir, monkeypatch):
    from offload.runtime import records
    from offload.runtime.saved_handles import Kept, Moved
    from offload.runtime.saved_bytes import PySavedBytes

    # The Python path's check (the core's, in csrc/moved_save.cpp, cannot be patched out:
    # tests/test_move_path.py breaks it the same way and expects autograd's error).
    monkeypatch.setattr(records, "saved_bytes_meter", PySavedBytes)
    for cls in (Kept, Moved):
        monkeypatch.setattr(cls, "check_version", lambda self: None)
    x = torch.randn(64, 256, requires_grad=True)
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0):
        relu_inplace(x).backward()     # test_inplace expects autograd's error here
    assert x.grad is not None


def _child_reports_descriptors(directory, conn):
    conn.send(descriptors_into(directory))


def test_sabotage_fork_handler_leaves_the_slab_open_in_the_child(nvme_dir, monkeypatch):
    monkeypatch.setattr(nvme_space, "after_fork_in_child", lambda: None)
    x = torch.randn(256, 256, requires_grad=True)
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0):
        y = (x * 2).sin().sum()
        held = answer_from_forked_child(_child_reports_descriptors, nvme_dir)
        y.backward()
    assert held != [], "test_fork's check would not see the inherited slab"


def test_sabotage_untracked_alias_detection_gives_a_chunk_anothers_bytes(monkeypatch):
    import test_untracked_aliases as t

    from offload.runtime import hooks

    monkeypatch.setattr(hooks, "untracked_alias", lambda t, storage, base=None: False)
    monkeypatch.setitem(offload.tiers.REGISTRY, "host", t._timed_copy_tier(at_pack=True))
    ref, _ = t._synthetic_grads(None)
    got, _ = t._synthetic_grads({"tiers": "host", "min_bytes": 0})
    assert not all(torch.equal(a, b) for a, b in zip(ref, got)), \
        "test_untracked_aliases' copy-at-pack case would not see the wrong bytes"


def test_sabotage_without_the_private_copy_a_chunk_moves_its_whole_storage(monkeypatch,
                                                                             nvme_dir):
    import test_untracked_aliases as t

    from offload.runtime import storing

    monkeypatch.setattr(storing, "snapshot", lambda x: x.detach())
    _, ctx = t._synthetic_grads({"tiers": "nvme", "nvme_dir": nvme_dir, "min_bytes": 0})
    assert ctx.stats.saved_bytes >= 2 * 4 * 48 * 4, \
        "test_a_saved_unsafe_chunk_comes_back_as_saved's byte check would not fail"
