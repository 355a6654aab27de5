"""Fork safety (offload/process.py): a forked child holds none of our slab files or arena pages,
so what the parent frees is freed while the child lives; a child that runs a step opens its
own store; a child forked inside the block (a DataLoader worker started there) runs its own
autograd as without offload.
"""
from __future__ import annotations

import logging
import multiprocessing
import os

import pytest
import torch

import offload
from conftest import answer_from_forked_child
from mounts import free_bytes as _free_bytes

MiB = 1 << 20
_fork = multiprocessing.get_context("fork")


def _fds_into(directory):
    """Our own descriptors whose target lies in `directory` (slabs show as 'dir/#123 (deleted)')."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(directory + "/"):
            found.append(target)
    return found


def _child_waits(directory, conn):
    conn.send(_fds_into(directory))
    conn.recv()          # stay alive until the parent has checked its disk space


def test_a_forked_child_keeps_no_slab_open(small_disk):
    free_before = _free_bytes(small_disk)
    x = torch.randn(512, 512, requires_grad=True)
    ctx = offload.activations(tiers="nvme", nvme_dir=small_disk, min_bytes=0,
                              nvme_bytes="32MiB")
    parent_end, child_end = _fork.Pipe()
    child = None
    try:
        with pytest.raises(KeyError):
            with ctx:
                y = (x * 2).tanh().sum()                   # a slab open and in use
                assert _fds_into(small_disk), "the parent should hold its slab"
                assert _free_bytes(small_disk) <= free_before - 32 * MiB
                child = _fork.Process(target=_child_waits, args=(small_disk, child_end))
                child.start()                               # a DataLoader worker, say
                raise KeyError("the step fails")            # the parent closes its slab
        assert parent_end.poll(30)
        assert parent_end.recv() == []                      # the child held no slab
        del y
        assert not _fds_into(small_disk)
        # The child is still alive: the space must be back anyway.
        assert child.is_alive()
        assert _free_bytes(small_disk) >= free_before - MiB
    finally:
        if child is not None:
            parent_end.send("done")
            child.join(10)


def _child_step(directory, conn):
    torch.set_num_threads(1)  # as a DataLoader worker does: the parent's OpenMP pool is gone
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(),
                                torch.nn.Linear(512, 8))
    x = torch.randn(64, 256)
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with offload.activations(tiers="nvme", nvme_dir=directory, min_bytes=0) as ctx:
        model(x).sum().backward()
    same = all(torch.equal(a, p.grad) for a, p in zip(ref, model.parameters()))
    conn.send((same, ctx.stats.nvme_written_bytes, ctx.tiers["nvme"].capacity_bytes))


def test_a_forked_child_runs_its_own_step(nvme_dir):
    x = torch.randn(256, 256, requires_grad=True)
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0) as ctx:
        (x * 2).sin().sum().backward()                      # leaves an idle store pooled
    assert ctx.stats.nvme_written_bytes > 0
    parent_end, child_end = _fork.Pipe()
    child = _fork.Process(target=_child_step, args=(nvme_dir, child_end))
    child.start()
    # Were the parent's store reused here, the child would wait forever for I/O threads
    # that were not forked.
    assert parent_end.poll(60), "the child's step hung"
    same, written, _ = parent_end.recv()
    child.join(30)
    assert child.exitcode == 0
    assert same and written > 0
    # The parent's pooled store is untouched by the child and still serves the next step.
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0) as again:
        (x * 2).sin().sum().backward()
    assert again.stats.nvme_written_bytes > 0


class _AutogradInWorker(torch.utils.data.Dataset):
    """An augmentation that runs autograd in the DataLoader worker."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        w = torch.randn(64, 64, requires_grad=True, generator=torch.Generator().manual_seed(i))
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(10 + i))
        (x @ w).tanh().sum().backward()
        return w.grad


@pytest.mark.parametrize("tiers", ["nvme", "host"])
def test_a_worker_forked_inside_the_block_runs_its_own_autograd(tiers, nvme_dir):
    """Before: the worker inherits the forking thread's saved-tensor hooks, ours, and packed
    into the parent's nvme store, closed in a child: UsedAfterCloseError in the worker. The
    hooks made before the fork now hold every save as it is; the parent's step is unchanged."""
    dataset = _AutogradInWorker()
    expected = [dataset[i] for i in range(len(dataset))]
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2,
                                         multiprocessing_context="fork")
    x = torch.randn(64, 64, requires_grad=True)
    with offload.activations(tiers=tiers, nvme_dir=nvme_dir, min_bytes=0) as ctx:
        y = (x * 2).sin()
        got = list(loader)                   # the workers fork here
        y.sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert torch.equal(x.grad, 2 * (x * 2).cos())
    assert ctx.stats.nvme_bytes + ctx.stats.host_bytes > 0


def _leave_by_an_exception(ctx, conn):
    errors = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: errors.append(record.getMessage())
    logging.getLogger("offload").addHandler(handler)
    error = RuntimeError("the child leaves the block")   # as a `with` body raising does
    ctx.__exit__(RuntimeError, error, error.__traceback__)
    conn.send((errors, ctx.active))


@pytest.mark.parametrize("tiers", ["nvme", "host"])
def test_a_child_forked_inside_the_block_leaves_it_by_an_exception_quietly(tiers, nvme_dir):
    """A child forked between forward and backward that leaves the block with an exception
    (or sys.exit) freed the parent's nvme payloads through the store the fork let go of,
    and logged "error while freeing the step" with a message about a backward it never ran
    (a helper's report). It frees nothing of the parent's now; the parent's step is exact."""
    x = torch.randn(256, 256, requires_grad=True)
    with offload.activations(tiers=tiers, nvme_dir=nvme_dir, min_bytes=0) as ctx:
        y = (x * 2).sin()
        errors, active = answer_from_forked_child(_leave_by_an_exception, ctx)
        y.sum().backward()
    assert errors == [] and not active
    assert torch.equal(x.grad, 2 * (x * 2).cos())
    assert getattr(ctx.stats, f"{tiers}_bytes") > 0


def _arena_rss_in_child(base, conn):
    rss_kib, in_vma = None, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(v, 16) for v in head.split("-"))
                in_vma = start <= base < end
            elif in_vma and head == "Rss:":
                rss_kib = int(line.split()[1])
                break
    conn.send(rss_kib)


def test_a_forked_child_shares_no_arena_pages():
    core = pytest.importorskip("offload._C")
    arena = core.HostArena(16 * MiB, pinned=False)
    block = arena.allocate(16 * MiB)
    torch.frombuffer(block, dtype=torch.uint8).fill_(1)   # every page touched
    rss_kib = answer_from_forked_child(_arena_rss_in_child, arena.base_ptr)
    # Without MADV_WIPEONFORK the child's mapping would show the parent's 16 MiB.
    assert rss_kib is not None and rss_kib < 1024, f"child maps {rss_kib} KiB of the arena"


def _backward_in_child(y, conn):
    # GNU OpenMP does not survive a fork once the parent ran a parallel region (the
    # child's first one hangs, with or without offload): one thread here.
    torch.set_num_threads(1)
    try:
        y.sum().backward()
        conn.send("no error")
    except Exception as exc:   # noqa: BLE001 (the message is what the test reads)
        conn.send(f"{type(exc).__name__}: {exc}")


@pytest.mark.parametrize("in_flight", [False, True], ids=["batched", "in-the-engine"])
def test_a_child_backwarding_the_parents_nvme_graph_is_told_why(in_flight, nvme_dir):
    """The child got a bare "NvmeStore is closed" (documented: a child cannot read the
    parent's store); the error now says the process was forked and what to do. A write in
    the parent's engine at the fork (16 MiB, throttled) made the child wait for ever on
    threads it does not have (found by a sanitizer run: io_request.hpp NOTE [Requests
    across a fork])."""
    x = torch.randn(1024, 4096, requires_grad=True) if in_flight else \
        torch.randn(256, 256, requires_grad=True)
    settings = {"nvme_max_bw": "20MB"} if in_flight else {}
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0, **settings) as ctx:
        y = (x * 2).sin()
        said = answer_from_forked_child(_backward_in_child, y, timeout_s=60)
        y.sum().backward()                   # the parent's own backward is unchanged
    assert said.startswith("UsedAfterCloseError") and "this process was forked" in said, said
    assert "use the host tier" in said
    assert torch.equal(x.grad, 2 * (x * 2).cos()) and ctx.stats.nvme_bytes > 0


def _end_inherited_step_in_child(conn):
    offload.empty_cache()   # ends the parent's pending step here: its nvme tier closes
    conn.send("ended")


def test_a_child_ends_a_pending_nvme_step_it_inherited(nvme_dir):
    """A graph dropped without backward leaves its step pending until the next entry,
    `empty_cache()` or exit; a child forked meanwhile ends it in its own process. Closing
    the tier read the forked store's engine counters, which the store had let go at the
    fork: the child died of SIGSEGV (found by a code review)."""
    x = torch.randn(256, 256, requires_grad=True)
    with offload.activations(tiers="nvme", nvme_dir=nvme_dir, min_bytes=0):
        y = (x * 2).sin()
    del y   # pending: nothing has ended the step yet
    assert answer_from_forked_child(_end_inherited_step_in_child) == "ended"
    offload.empty_cache()
