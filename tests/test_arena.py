"""HostArena / HostBlock: alignment, stack-like and out-of-order frees, fragmentation,
peak, None when full, and zero-copy torch views that keep the memory alive."""
from __future__ import annotations

import gc
import threading

import pytest
import torch

from offload._ext import load_core
from offload.errors import UsedAfterCloseError

C = load_core()
PAGE = 4096


def test_blocks_are_4096_aligned_and_padded_to_whole_pages():
    arena = C.HostArena(64 * PAGE)
    assert C.DEFAULT_ALIGNMENT == PAGE
    sizes = [1, 511, 4095, 4096, 4097, 3 * PAGE + 5]
    blocks = [arena.allocate(n) for n in sizes]
    for n, b in zip(sizes, blocks):
        assert b.nbytes == n and len(b) == n
        assert b.ptr % PAGE == 0
    assert arena.used_bytes == sum((n + PAGE - 1) // PAGE * PAGE for n in sizes)
    ptrs = sorted(b.ptr for b in blocks)
    assert len(set(ptrs)) == len(ptrs)


def test_capacity_is_rounded_up_to_a_page_and_not_pinned_without_a_gpu():
    arena = C.HostArena(PAGE + 1)
    assert arena.capacity_bytes == 2 * PAGE
    assert arena.free_bytes == 2 * PAGE and arena.used_bytes == 0
    if not C.cuda_usable():
        assert arena.pinned is False


def test_stack_like_use_never_fragments():
    arena = C.HostArena(100 * PAGE)
    blocks = [arena.allocate(PAGE * (1 + i % 3)) for i in range(30)]
    base = arena.base_ptr
    assert [b.ptr for b in blocks] == sorted(b.ptr for b in blocks)   # forward: bump in order
    assert blocks[0].ptr == base
    for b in reversed(blocks):                                        # backward: reverse frees
        b.release()
        assert arena.fragmentation == 0.0
        assert arena.largest_free_bytes == arena.free_bytes
    assert arena.used_bytes == 0 and arena.largest_free_bytes == arena.capacity_bytes


def test_out_of_order_frees_coalesce_and_fragmentation_is_reported():
    arena = C.HostArena(16 * PAGE)
    a, b, c, d = (arena.allocate(4 * PAGE) for _ in range(4))
    assert arena.allocate(1) is None                          # full
    b.release()                                               # hole of 4 pages
    assert (arena.free_bytes, arena.largest_free_bytes) == (4 * PAGE, 4 * PAGE)
    d.release()                                               # top: tail of 4 pages
    assert (arena.free_bytes, arena.largest_free_bytes) == (8 * PAGE, 4 * PAGE)
    assert arena.fragmentation == pytest.approx(0.5)
    assert arena.allocate(5 * PAGE) is None                   # 8 pages free, not contiguous
    c.release()                                               # b + c + d coalesce
    assert (arena.free_bytes, arena.largest_free_bytes) == (12 * PAGE, 12 * PAGE)
    assert arena.fragmentation == 0.0
    big = arena.allocate(12 * PAGE)
    assert big is not None and big.ptr == a.ptr + 4 * PAGE
    a.release()
    big.release()
    assert arena.used_bytes == 0 and arena.largest_free_bytes == 16 * PAGE


def test_holes_are_reused_best_fit_before_the_tail():
    arena = C.HostArena(32 * PAGE)
    blocks = [arena.allocate(n * PAGE) for n in (3, 1, 2, 1, 4)]
    blocks[0].release()        # 3-page hole at offset 0
    blocks[2].release()        # 2-page hole at offset 4 pages
    two = arena.allocate(2 * PAGE)
    assert two.ptr == arena.base_ptr + 4 * PAGE     # the exact fit, not the first fit
    three = arena.allocate(3 * PAGE)
    assert three.ptr == arena.base_ptr
    tail = arena.allocate(PAGE)
    assert tail.ptr == arena.base_ptr + 11 * PAGE   # holes used up: bump from the tail


def test_peak_and_reset_peak():
    arena = C.HostArena(16 * PAGE)
    a = arena.allocate(8 * PAGE)
    b = arena.allocate(4 * PAGE)
    assert arena.peak_bytes == 12 * PAGE
    b.release()
    assert arena.peak_bytes == 12 * PAGE and arena.used_bytes == 8 * PAGE
    arena.reset_peak()
    assert arena.peak_bytes == 8 * PAGE
    a.release()
    assert arena.peak_bytes == 8 * PAGE


def test_allocate_returns_none_when_full_or_too_big():
    arena = C.HostArena(4 * PAGE)
    assert arena.allocate(5 * PAGE) is None
    blocks = [arena.allocate(PAGE) for _ in range(4)]
    assert all(b is not None for b in blocks)
    assert arena.allocate(1) is None
    blocks[1].release()
    assert arena.allocate(PAGE) is not None


def test_zero_byte_block_takes_one_page_and_gives_an_empty_buffer():
    arena = C.HostArena(2 * PAGE)
    b = arena.allocate(0)
    assert b.nbytes == 0 and arena.used_bytes == PAGE
    assert bytes(memoryview(b)) == b""


def test_release_is_idempotent_and_blocks_use_after_release():
    arena = C.HostArena(4 * PAGE)
    b = arena.allocate(100)
    b.release()
    b.release()
    assert b.released and arena.used_bytes == 0
    with pytest.raises(UsedAfterCloseError, match="HostBlock was released"):
        _ = b.ptr
    with pytest.raises(UsedAfterCloseError, match="HostBlock was released"):
        memoryview(b)


def test_garbage_collection_releases_the_block():
    arena = C.HostArena(4 * PAGE)
    b = arena.allocate(100)
    assert arena.used_bytes == PAGE
    del b
    gc.collect()
    assert arena.used_bytes == 0


def test_torch_frombuffer_is_a_zero_copy_view_that_keeps_the_block_alive():
    arena = C.HostArena(8 * PAGE)
    block = arena.allocate(3 * PAGE + 7)
    view = torch.frombuffer(block, dtype=torch.uint8)
    assert view.numel() == 3 * PAGE + 7 and view.data_ptr() == block.ptr
    view.fill_(42)
    assert bytes(memoryview(block)[:4]) == b"\x2a" * 4           # same memory, no copy
    ptr = block.ptr
    block.release()                    # exported: deferred until the view is gone
    del block
    gc.collect()
    assert arena.used_bytes == 4 * PAGE
    assert int(view.sum()) == 42 * view.numel()
    other = arena.allocate(4 * PAGE)   # must not land on the viewed memory
    assert other.ptr != ptr
    del view
    gc.collect()
    assert arena.used_bytes == 4 * PAGE    # only `other`
    other.release()
    assert arena.used_bytes == 0


def test_float_view_of_a_block():
    arena = C.HostArena(4 * PAGE)
    block = arena.allocate(16 * 4)
    t = torch.frombuffer(block, dtype=torch.float32)
    t.copy_(torch.arange(16, dtype=torch.float32))
    assert torch.equal(torch.frombuffer(block, dtype=torch.float32), torch.arange(16.0))


def test_blocks_outlive_their_arena():
    arena = C.HostArena(4 * PAGE)
    block = arena.allocate(PAGE)
    view = torch.frombuffer(block, dtype=torch.uint8)
    del arena
    gc.collect()
    view.fill_(1)                      # memory still mapped: the block owns the arena
    assert int(view.sum()) == PAGE


def test_concurrent_allocate_and_release_from_threads():
    arena = C.HostArena(256 * PAGE)
    errors = []

    def churn(seed):
        try:
            held = []
            for i in range(2000):
                if held and (i + seed) % 3 == 0:
                    held.pop((i * 7 + seed) % len(held)).release()
                else:
                    b = arena.allocate(PAGE * (1 + (i + seed) % 4))
                    if b is not None:
                        held.append(b)
            for b in held:
                b.release()
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert arena.used_bytes == 0 and arena.largest_free_bytes == arena.capacity_bytes


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="capacity_bytes must be positive, got 0"):
        C.HostArena(0)
    with pytest.raises(ValueError, match="capacity_bytes must be >= 0, got -5"):
        C.HostArena(-5)
    arena = C.HostArena(PAGE)
    with pytest.raises(ValueError, match=r"allocate: nbytes must be >= 0, got -1"):
        arena.allocate(-1)


@pytest.mark.skipif(C.cuda_usable(), reason="a usable GPU makes pinned=True valid")
def test_pinned_true_without_a_gpu_says_why():
    with pytest.raises(RuntimeError, match="pinned=True needs a usable CUDA device"):
        C.HostArena(PAGE, pinned=True)


def test_cuda_usable_never_raises_and_reason_is_consistent():
    usable = C.cuda_usable()
    assert isinstance(usable, bool)
    assert (C.cuda_unusable_reason() == "") == usable
    assert isinstance(C.cuda_compiled, bool)
