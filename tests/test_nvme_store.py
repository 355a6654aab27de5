"""NvmeStore: byte-exact round trips, concurrency, striping, checksums, throttling, error
paths with errno, O_DIRECT fallback, and nothing left on disk after exit, exception or
SIGKILL. Tests that mount filesystems (root only) skip with the reason when not allowed."""
from __future__ import annotations

import contextlib
import errno
import gc
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch

from offload._ext import load_core
from offload.errors import UsedAfterCloseError, StorageError

from mounts import mounted as _mounted

C = load_core()
MiB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROUND_TRIP_SIZES = [1, 511, 4095, 4097, 716928, 64 * MiB + 3]


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _assert_round_trip(store, n: int, seed: int) -> None:
    """Write n random bytes through write_ptr, read them back, compare byte for byte."""
    src = _random_bytes(n, seed)
    ext = store.allocate(n)
    store.write_ptr(ext, src.data_ptr(), n).wait()
    dst = torch.empty(n, dtype=torch.uint8)
    store.read_ptr(ext, dst.data_ptr(), n).wait()
    assert torch.equal(src, dst)


def _unaligned(n: int, shift: int) -> torch.Tensor:
    """A uint8 tensor of n bytes whose address is `shift` bytes past a page boundary."""
    base = torch.empty(n + 8192, dtype=torch.uint8)
    start = (-base.data_ptr()) % 4096 + shift
    return base[start:start + n]


# ---------------------------------------------------------------------------- mounts

def _supports_o_direct(directory: str) -> bool:
    path = os.path.join(directory, ".probe")
    try:
        os.close(os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:   # the file can exist even when the open failed on O_DIRECT
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# ---------------------------------------------------------------------- round trips

# One unaligned shift is enough for the 64 MiB case (it is the slow one).
@pytest.mark.parametrize("nbytes,shift", [(n, s) for n in ROUND_TRIP_SIZES
                                          for s in ((1, 4096 - 3) if n <= MiB else (1,))])
def test_round_trip_through_unaligned_pointers(nvme_dir, nbytes, shift):
    store = C.NvmeStore([nvme_dir], nbytes + MiB)
    src = _unaligned(nbytes, shift)
    src.copy_(_random_bytes(nbytes, seed=nbytes))
    dst = _unaligned(nbytes, shift + 1)
    dst.zero_()
    ext = store.allocate(nbytes)
    assert store.write_ptr(ext, src.data_ptr(), nbytes).wait() == nbytes
    assert store.read_ptr(ext, dst.data_ptr(), nbytes).wait() == nbytes
    assert torch.equal(src, dst)
    assert store.direct and store.alignment >= 4096
    store.close()


@pytest.mark.parametrize("nbytes", ROUND_TRIP_SIZES)
@pytest.mark.parametrize("checksum", [False, True])
def test_round_trip_through_host_blocks(nvme_dir, nbytes, checksum):
    arena = C.HostArena(2 * nbytes + 2 * MiB)
    store = C.NvmeStore([nvme_dir], nbytes + MiB, checksum=checksum)
    out, back = arena.allocate(nbytes), arena.allocate(nbytes)
    torch.frombuffer(out, dtype=torch.uint8).copy_(_random_bytes(nbytes, seed=3))
    ext = store.allocate(nbytes)
    assert store.write(ext, out).wait() == nbytes
    assert store.read(ext, back).wait() == nbytes
    assert torch.equal(torch.frombuffer(out, dtype=torch.uint8),
                       torch.frombuffer(back, dtype=torch.uint8))
    assert store.bytes_written == nbytes and store.bytes_read == nbytes
    store.close()


def _expected_in_place_bounce(nbytes: int, phase: int, align: int) -> int:
    """Bytes of one in-place transfer that go through the bounce buffer: the partial
    sectors at the two ends (middle chunks start and end on stripe boundaries)."""
    head = min(nbytes, (align - phase) % align)
    return head + (nbytes - head) % align


# Striped over two directories with small chunks, so a transfer spans several chunks.
@pytest.mark.parametrize("nbytes", [1, 4095, 4097, 716928, 3 * MiB + 5])
@pytest.mark.parametrize("phase", [0, 64, 4032])
def test_memory_in_phase_with_the_extent_moves_in_place(nvme_dir, tmp_path, nbytes, phase):
    store = C.NvmeStore([nvme_dir, str(tmp_path)], 8 * MiB, chunk_bytes=256 * 1024,
                        checksum=True)
    align = store.alignment
    src = _unaligned(nbytes, phase).copy_(_random_bytes(nbytes, seed=nbytes + phase))
    ext = store.allocate(nbytes, phase=phase)
    assert ext.offset % align == phase
    assert store.write_ptr(ext, src.data_ptr(), nbytes).wait() == nbytes
    dst = _unaligned(nbytes, phase).zero_()
    assert store.read_ptr(ext, dst.data_ptr(), nbytes).wait() == nbytes
    assert torch.equal(src, dst)
    assert store.bytes_bounced == 2 * _expected_in_place_bounce(nbytes, phase, align)
    store.close()


def test_memory_out_of_phase_is_bounced_whole_and_neighbours_stay_intact(nvme_dir):
    # One chunk's own path (each a transfer of its own): small neighbours queued together
    # would merge and bounce whole (the merge tests below).
    store = C.NvmeStore([nvme_dir], 8 * MiB, chunk_bytes=64 * 1024, coalesce_bytes=0)
    sizes_phases = [(5000, 64), (7000, 4000), (70_001, 128), (1, 4095)]
    exts, srcs = [], []
    for i, (n, phase) in enumerate(sizes_phases):  # adjacent extents, written at once
        exts.append(store.allocate(n, phase=phase))
        srcs.append(_unaligned(n, phase).copy_(_random_bytes(n, seed=i)))
    for f in [store.write_ptr(e, s.data_ptr(), s.numel()) for e, s in zip(exts, srcs)]:
        f.wait()
    in_place = store.bytes_bounced
    assert in_place == sum(_expected_in_place_bounce(n, p, store.alignment)
                           for n, p in sizes_phases)
    for (n, phase), ext, src in zip(sizes_phases, exts, srcs):
        dst = _unaligned(n, (phase + 64) % 4096).zero_()   # out of phase: all bounced
        store.read_ptr(ext, dst.data_ptr(), n).wait()
        assert torch.equal(src, dst)
    assert store.bytes_bounced == in_place + sum(n for n, _ in sizes_phases)
    store.close()


# ------------------------------------------------ small chunks travel together

def _small_neighbours(store, sizes_phases, seed=0):
    """Adjacent extents (a fresh store's allocator carves them in order) and a source of
    random bytes for each, at its phase."""
    exts = [store.allocate(n, phase=p) for n, p in sizes_phases]
    for a, b in zip(exts, exts[1:]):
        assert b.offset // store.alignment * store.alignment == \
            -(-(a.offset + a.nbytes) // store.alignment) * store.alignment, "not adjacent"
    srcs = [_unaligned(n, p).copy_(_random_bytes(n, seed=seed + i))
            for i, (n, p) in enumerate(sizes_phases)]
    return exts, srcs


def _read_back_queued(store, exts, sizes_phases, order, busy=False):
    """Reads in `order`, queued one by one as the read-ahead queues them; returns the
    destinations (out of phase for odd positions: every byte bounced). `busy`: the workers
    take nothing until all are queued, as when the read-ahead runs ahead of the disk (held,
    not timed: a 2-core machine under load may wake a worker between any two reads)."""
    dsts = [_unaligned(n, (p + 64 * (i % 2)) % 4096).zero_()
            for i, (n, p) in enumerate(sizes_phases)]
    if busy:
        store._hold_workers_for_test(True)
    reads = [(i, store.read_ptr(exts[i], dsts[i].data_ptr(), dsts[i].numel())) for i in order]
    if busy:
        store._hold_workers_for_test(False)
    return dsts, reads


# What the nvme tier queues on a CPU run: a write batch of small tensors at torch's phases.
_SMALL = [(4096, 64 * k % 4096) for k in range(16)] + [(1, 4095), (5000, 64), (7000, 4000)]


@pytest.mark.parametrize("checksum", [False, True])
def test_small_neighbours_queued_together_move_as_one_transfer_each_way(nvme_dir, checksum):
    # One worker, busy while the reads queue one by one behind each other (the read-ahead
    # running ahead of the disk): it takes them all as one transfer.
    store = C.NvmeStore([nvme_dir], 8 * MiB, checksum=checksum, workers=1)
    exts, srcs = _small_neighbours(store, _SMALL)
    writes = store.write_ptr_many(exts, [s.data_ptr() for s in srcs], [s.numel() for s in srcs])
    assert [w.wait() for w in writes] == [n for n, _ in _SMALL]
    assert store.transfers == 1            # one batch, queued at once: one pwrite
    assert store.bytes_written == sum(n for n, _ in _SMALL)
    assert store.bytes_bounced == sum(n for n, _ in _SMALL)
    order = list(reversed(range(len(_SMALL))))   # the backward's order: walking down
    dsts, reads = _read_back_queued(store, exts, _SMALL, order, busy=True)
    assert [r.wait() for _, r in reads] == [_SMALL[i][0] for i in order]
    assert store.transfers == 2            # 19 reads, one pread
    for i, (src, dst) in enumerate(zip(srcs, dsts)):
        assert torch.equal(src, dst), f"extent {i} differs"
    assert store.bytes_read == sum(n for n, _ in _SMALL)
    store.close()


def test_merged_writes_leave_the_neighbours_they_do_not_cover_intact(nvme_dir):
    store = C.NvmeStore([nvme_dir], 8 * MiB, throttle_bytes_per_s=8 * MiB)
    exts, srcs = _small_neighbours(store, _SMALL, seed=10)
    for w in store.write_ptr_many(exts, [s.data_ptr() for s in srcs], [s.numel() for s in srcs]):
        w.wait()
    # Two runs written again, each one transfer between neighbours it does not cover (the
    # first run ends in a block of its own, the second at an odd phase next to them).
    again = [_unaligned(n, p).copy_(_random_bytes(n, seed=99 + i))
             for i, (n, p) in enumerate(_SMALL)]
    covered = [*range(3, 9), *range(12, 17)]
    before = store.transfers
    for w in store.write_ptr_many([exts[i] for i in covered],
                                  [again[i].data_ptr() for i in covered],
                                  [again[i].numel() for i in covered]):
        w.wait()
    assert store.transfers - before == 2
    dsts, reads = _read_back_queued(store, exts, _SMALL, range(len(_SMALL)))
    for _, r in reads:
        r.wait()
    for i, dst in enumerate(dsts):
        assert torch.equal(dst, again[i] if i in covered else srcs[i]), f"extent {i} differs"
    store.close()


def test_a_corrupt_chunk_in_a_merged_read_fails_alone(nvme_dir):
    store = C.NvmeStore([nvme_dir], 8 * MiB, checksum=True, workers=1)
    exts, srcs = _small_neighbours(store, _SMALL, seed=20)
    for w in store.write_ptr_many(exts, [s.data_ptr() for s in srcs], [s.numel() for s in srcs]):
        w.wait()
    bad = 5
    store._corrupt_for_test(exts[bad], 100)
    before = store.transfers
    dsts, reads = _read_back_queued(store, exts, _SMALL, list(reversed(range(len(_SMALL)))),
                                    busy=True)
    for i, r in reads:
        if i == bad:
            with pytest.raises(StorageError, match="checksum mismatch") as info:
                r.wait()
            assert info.value.errno == errno.EBADMSG
        else:
            r.wait()
            assert torch.equal(dsts[i], srcs[i]), f"extent {i} differs"
    assert store.transfers - before == 1   # 19 reads in one run, the corrupt one among them
    store.close()


def test_a_held_read_stays_queued_and_close_releases_the_hold(nvme_dir):
    store = C.NvmeStore([nvme_dir], MiB, workers=1)
    (ext,), (src,) = _small_neighbours(store, [(4096, 0)])
    store.write_ptr(ext, src.data_ptr(), src.numel()).wait()
    dst = torch.zeros_like(src)
    store._hold_workers_for_test(True)
    read = store.read_ptr(ext, dst.data_ptr(), dst.numel())
    time.sleep(0.05)
    assert not read.done()                 # held: queued, not started
    closer = threading.Thread(target=store.close, daemon=True)
    closer.start()                         # close drains the queue: the hold must not hang it
    closer.join(timeout=30)
    assert not closer.is_alive(), "close() hangs on a held queue"
    assert read.done() and read.wait() == 4096 and torch.equal(dst, src)
    with pytest.raises(UsedAfterCloseError):
        store._hold_workers_for_test(False)


def test_coalesce_bytes_zero_keeps_every_chunk_a_transfer_of_its_own(nvme_dir):
    store = C.NvmeStore([nvme_dir], 8 * MiB, coalesce_bytes=0)
    assert store.coalesce_bytes == 0
    sizes = [(4096, 0)] * 8     # aligned, in phase: each one pwrite in place
    exts, srcs = _small_neighbours(store, sizes)
    for w in store.write_ptr_many(exts, [s.data_ptr() for s in srcs], [s.numel() for s in srcs]):
        w.wait()
    assert store.transfers == 8 and store.bytes_bounced == 0
    with pytest.raises(ValueError, match="coalesce_bytes"):
        C.NvmeStore([nvme_dir], MiB, coalesce_bytes=-1)
    store.close()


def test_hundreds_of_concurrent_requests(nvme_dir):
    rng = random.Random(7)
    sizes = [rng.randint(1, 300_000) for _ in range(400)]
    store = C.NvmeStore([nvme_dir], sum(sizes) + 400 * 8192, workers=8, chunk_bytes=64 * 1024)
    srcs = [_unaligned(n, rng.randint(0, 4095)).copy_(_random_bytes(n, seed=i))
            for i, n in enumerate(sizes)]
    exts = [store.allocate(n) for n in sizes]
    writes = [store.write_ptr(e, s.data_ptr(), s.numel()) for e, s in zip(exts, srcs)]
    assert [f.wait() for f in writes] == sizes
    dsts = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    order = list(range(len(sizes)))
    rng.shuffle(order)
    reads = {i: store.read_ptr(exts[i], dsts[i].data_ptr(), sizes[i]) for i in order}
    for i in order:
        assert reads[i].wait() == sizes[i]
        assert torch.equal(srcs[i], dsts[i]), f"request {i} ({sizes[i]} bytes) differs"
    store.close()


def _slab_bytes(directory: str, nbytes: int) -> bytes:
    """The first `nbytes` of the (nameless) slab file open in `directory`, read through
    /proc/self/fd: what is really on disk there."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(directory + "/"):
            with open(f"/proc/self/fd/{fd}", "rb", buffering=0) as f:
                return f.read(nbytes)
    raise AssertionError(f"no slab open in {directory}")


def test_striping_across_directories(nvme_dir):
    second = tempfile.mkdtemp(prefix="offload-test-b-", dir="/var/tmp")
    stripe = 256 * 1024
    try:
        store = C.NvmeStore([nvme_dir, second], 16 * MiB, chunk_bytes=stripe)
        assert store.paths == [nvme_dir, second]
        assert store.capacity_bytes >= 16 * MiB
        n = 5 * MiB + 123
        src = _random_bytes(n, seed=11)
        ext = store.allocate(n)
        assert ext.offset == 0
        store.write_ptr(ext, src.data_ptr(), n).wait()
        # RAID-0 in stripe units: even stripes in the first slab, odd ones in the second.
        data = src.numpy().tobytes()
        on_disk = [_slab_bytes(d, 10 * stripe) for d in (nvme_dir, second)]
        for k in range(20):
            slab, row = k % 2, k // 2
            assert on_disk[slab][row * stripe:(row + 1) * stripe] == \
                data[k * stripe:(k + 1) * stripe], f"stripe {k} is not in slab {slab}"
        dst = torch.empty(n, dtype=torch.uint8)
        store.read_ptr(ext, dst.data_ptr(), n).wait()
        assert torch.equal(src, dst)
        store.close()
        assert os.listdir(second) == []
    finally:
        shutil.rmtree(second, ignore_errors=True)


def test_partial_reads_and_writes_of_an_extent(nvme_dir):
    store = C.NvmeStore([nvme_dir], 4 * MiB, checksum=True)
    ext = store.allocate(3 * MiB)
    src = _random_bytes(2 * MiB + 5, seed=5)
    store.write_ptr(ext, src.data_ptr(), src.numel()).wait()
    head = torch.empty(1000, dtype=torch.uint8)
    store.read_ptr(ext, head.data_ptr(), 1000).wait()
    assert torch.equal(head, src[:1000])
    store.close()


def test_allocate_none_when_full_and_release_gives_space_back(nvme_dir):
    store = C.NvmeStore([nvme_dir], 4 * MiB)
    cap = store.capacity_bytes
    a = store.allocate(cap // 2)
    b = store.allocate(cap // 2)
    assert store.used_bytes == cap and store.free_bytes == 0
    assert store.allocate(1) is None
    a.release()
    a.release()
    assert a.released and store.used_bytes == cap // 2
    with pytest.raises(UsedAfterCloseError, match="Extent was released"):
        store.write_ptr(a, 0, 0)
    del b
    gc.collect()
    assert store.used_bytes == 0 and store.peak_bytes == cap
    store.close()


def test_in_flight_write_keeps_block_and_extent_alive(nvme_dir):
    arena = C.HostArena(8 * MiB)
    # Throttled to 2 s for the write: the checks below run well inside it, also on a
    # loaded machine (at 5 MiB/s, 0.8 s, a collection under load once outlasted it).
    store = C.NvmeStore([nvme_dir], 8 * MiB, throttle_bytes_per_s=2 * MiB, chunk_bytes=256 * 1024)
    block = arena.allocate(4 * MiB)
    torch.frombuffer(block, dtype=torch.uint8).copy_(_random_bytes(4 * MiB, seed=9))
    expected = bytes(memoryview(block))
    ext = store.allocate(4 * MiB)
    fut = store.write(ext, block)
    block.release()                      # caller drops its claims at once (the block was
    del block                            # exported to torch: release completes at GC)
    gc.collect()
    ext_offset = ext.offset
    ext.release()
    assert not fut.done()
    assert arena.used_bytes == 4 * MiB    # the write still holds the block ...
    assert store.used_bytes == 4 * MiB    # ... and the extent
    with pytest.raises(TimeoutError, match="not finished after"):
        fut.wait(timeout_s=0.01)
    assert fut.wait() == 4 * MiB
    assert arena.used_bytes == 0 and store.used_bytes == 0
    again = store.allocate(4 * MiB)       # the same range comes back; data is what was written
    assert again.offset == ext_offset
    out = torch.empty(4 * MiB, dtype=torch.uint8)
    store.read_ptr(again, out.data_ptr(), out.numel()).wait()
    assert out.numpy().tobytes() == expected
    store.close()


def test_throttle_caps_throughput(nvme_dir):
    rate = 40 * MiB
    store = C.NvmeStore([nvme_dir], 16 * MiB, throttle_bytes_per_s=rate, chunk_bytes=256 * 1024)
    src = _random_bytes(8 * MiB, seed=1)
    ext = store.allocate(src.numel())
    start = time.perf_counter()
    store.write_ptr(ext, src.data_ptr(), src.numel()).wait()
    elapsed = time.perf_counter() - start
    # 8 MiB at 40 MiB/s: 0.2 s; the first chunk starts at once, so at least 31/32 of that.
    assert elapsed >= 0.2 * 31 / 32 * 0.95
    store.close()


def test_close_waits_for_in_flight_io_and_is_idempotent(nvme_dir):
    store = C.NvmeStore([nvme_dir], 8 * MiB, throttle_bytes_per_s=40 * MiB, chunk_bytes=256 * 1024)
    src = _random_bytes(4 * MiB, seed=2)
    fut = store.write_ptr(store.allocate(src.numel()), src.data_ptr(), src.numel())
    store.close()
    assert fut.done() and fut.wait() == src.numel()
    store.close()
    assert store.closed
    with pytest.raises(UsedAfterCloseError, match="NvmeStore is closed"):
        store.allocate(10)


def test_context_manager_closes(nvme_dir):
    with C.NvmeStore([nvme_dir], MiB) as store:
        ext = store.allocate(10)
    assert store.closed
    with pytest.raises(UsedAfterCloseError, match="NvmeStore is closed"):
        store.read_ptr(ext, 0, 0)


def test_zero_byte_transfer_completes_at_once(nvme_dir):
    store = C.NvmeStore([nvme_dir], MiB)
    ext = store.allocate(0)
    assert store.write_ptr(ext, 0, 0).wait() == 0
    store.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to an unprivileged user")
def test_thread_start_failure_is_a_clear_error_not_a_crash():
    # RLIMIT_NPROC (which root ignores) lets a few threads start, then refuses the rest:
    # the store must stop the started workers and raise, not std::terminate the process.
    with tempfile.TemporaryDirectory(dir="/var/tmp") as work:   # reachable by "nobody"
        os.chmod(work, 0o777)
        _thread_start_failure(work)


def _thread_start_failure(work: str) -> None:
    script = textwrap.dedent(f"""
        import os, resource
        from offload._ext import load_core
        C = load_core()
        os.setgid(65534); os.setuid(65534)
        resource.setrlimit(resource.RLIMIT_NPROC, (6, 6))
        try:
            C.NvmeStore([{str(work)!r}], 1 << 20, workers=64)
        except RuntimeError as e:
            print("ERR", e)
        store = C.NvmeStore([{str(work)!r}], 1 << 20, workers=2)  # still usable after
        store.close()
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "ERR cannot start NvmeStore I/O worker" in proc.stdout
    assert "of 64" in proc.stdout and "ulimit -u" in proc.stdout
    assert proc.stdout.rstrip().endswith("OK")
    assert os.listdir(work) == []


# --------------------------------------------------------------------------- checksums

def test_crc32c_matches_the_standard_check_value_on_both_backends():
    assert C.crc32c(b"123456789") == 0xE3069283
    assert C._crc32c_portable(b"123456789") == 0xE3069283
    rng = random.Random(3)
    for n in (0, 1, 7, 8, 9, 63, 4096, 100_003):
        data = bytes(rng.getrandbits(8) for _ in range(n))
        assert C.crc32c(data) == C._crc32c_portable(data)
        half = n // 2
        assert C.crc32c(data[half:], C.crc32c(data[:half])) == C.crc32c(data)


def test_crc32c_refuses_non_contiguous_buffers():
    import numpy as np
    data = np.arange(64, dtype=np.uint8)
    for strided in (data[::2], data.reshape(8, 8).T, data[::-1]):
        with pytest.raises(ValueError, match=r"crc32c: data must be C-contiguous, got shape"):
            C.crc32c(strided)
        with pytest.raises(ValueError, match=r"crc32c: data must be C-contiguous"):
            C._crc32c_portable(strided)
    # Contiguous views of any shape are one flat byte range and still accepted.
    assert C.crc32c(data.reshape(8, 8)) == C.crc32c(data.tobytes())
    assert C.crc32c(data[8:16]) == C.crc32c(data.tobytes()[8:16])
    assert C.crc32c(data.reshape(8, 8)[2:3]) == C.crc32c(data.tobytes()[16:24])


def test_corruption_is_detected_with_checksums(nvme_dir):
    n = 3 * MiB + 17
    store = C.NvmeStore([nvme_dir], 8 * MiB, checksum=True)
    src = _random_bytes(n, seed=4)
    ext = store.allocate(n)
    store.write_ptr(ext, src.data_ptr(), n).wait()
    store._corrupt_for_test(ext, 2 * MiB + 5)
    dst = torch.empty(n, dtype=torch.uint8)
    with pytest.raises(StorageError, match="checksum mismatch") as info:
        store.read_ptr(ext, dst.data_ptr(), n).wait()
    assert info.value.errno == errno.EBADMSG
    assert info.value.filename == nvme_dir
    assert "offset=" in str(info.value) and "size=" in str(info.value)
    store.close()


def test_without_checksums_the_same_corruption_goes_unnoticed(nvme_dir):
    """Control for the test above: the error comes from the checksum, nothing else."""
    n = 3 * MiB + 17
    store = C.NvmeStore([nvme_dir], 8 * MiB, checksum=False)
    src = _random_bytes(n, seed=4)
    ext = store.allocate(n)
    store.write_ptr(ext, src.data_ptr(), n).wait()
    store._corrupt_for_test(ext, 2 * MiB + 5)
    dst = torch.empty(n, dtype=torch.uint8)
    store.read_ptr(ext, dst.data_ptr(), n).wait()
    assert int((dst != src).sum()) == 1 and dst[2 * MiB + 5] == src[2 * MiB + 5] ^ 0xFF
    store.close()


# ------------------------------------------------------------------------ error paths

def test_missing_directory(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(StorageError, match="NVMe directory does not exist") as info:
        C.NvmeStore([missing], MiB)
    assert info.value.errno == errno.ENOENT and info.value.filename == missing


def test_not_a_directory(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"x")
    with pytest.raises(StorageError, match="NVMe path is not a directory") as info:
        C.NvmeStore([str(path)], MiB)
    assert info.value.errno == errno.ENOTDIR and info.value.filename == str(path)


def test_bad_second_directory_creates_nothing_in_the_first(nvme_dir, tmp_path):
    with pytest.raises(StorageError, match="does not exist"):
        C.NvmeStore([nvme_dir, str(tmp_path / "nope")], MiB)
    assert os.listdir(nvme_dir) == []


def test_read_only_directory():
    with _mounted("tmpfs", "ro", size_bytes=MiB) as ro_dir:
        with pytest.raises(StorageError, match="NVMe directory is not writable") as info:
            C.NvmeStore([ro_dir], 64 * 1024)
        assert info.value.errno == errno.EROFS and info.value.filename == ro_dir


def test_directory_without_write_permission():
    """Root ignores permission bits, so as root the check runs in a child that drops to
    "nobody" (CI runs as root)."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as work:
        os.chmod(work, 0o755)
        locked = os.path.join(work, "locked")
        os.mkdir(locked, 0o500)
        script = textwrap.dedent(f"""
            import errno, os
            from offload._ext import load_core
            from offload.errors import StorageError
            if os.geteuid() == 0:
                os.setgid(65534); os.setuid(65534)
            try:
                load_core().NvmeStore([{locked!r}], 1 << 20)
            except StorageError as e:
                print("ERRNO", errno.errorcode[e.errno], e)
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ERRNO EACCES") and "not writable" in out.stdout


def test_enospc_when_the_slab_does_not_fit():
    with _mounted("ext4", size_bytes=16 * MiB) as small:
        with pytest.raises(StorageError, match="cannot reserve .* bytes for the NVMe slab") as info:
            C.NvmeStore([small], 64 * MiB)
        assert info.value.errno == errno.ENOSPC and info.value.filename == small
        assert "bytes free there" in str(info.value)
        assert [f for f in os.listdir(small) if f != "lost+found"] == []


def test_enospc_during_a_write_reaches_the_future():
    """ext2 has no fallocate: the slab is not reserved and a full disk fails the write."""
    with _mounted("ext2", size_bytes=8 * MiB) as small:
        store = C.NvmeStore([small], 32 * MiB, chunk_bytes=256 * 1024)
        src = _random_bytes(16 * MiB, seed=6)
        ext = store.allocate(src.numel())
        with pytest.raises(StorageError, match="write to the NVMe slab file failed: the disk is "
                           r"full \(its file system reserves no space up front; free space "
                           "there or lower OFFLOAD_NVME_BYTES") as info:
            store.write_ptr(ext, src.data_ptr(), src.numel()).wait()
        assert info.value.errno == errno.ENOSPC and info.value.filename == small
        assert info.value.offset is not None and info.value.nbytes is not None
        store.close()
        assert [f for f in os.listdir(small) if f != "lost+found"] == []


def test_fallocate_fallback_is_a_warning(caplog):
    """Without fallocate a full disk fails a later step's write (ENOSPC): said up front, at
    WARNING (a DEBUG note was all a user got before the failure)."""
    with _mounted("ext2", size_bytes=8 * MiB) as small:
        with caplog.at_level(logging.WARNING, logger="offload"):
            store = C.NvmeStore([small], MiB)
        store.close()
    assert any("fallocate is not supported" in r.message and r.levelno == logging.WARNING
               and "fails that step with ENOSPC" in r.message for r in caplog.records)


def test_bad_arguments_name_the_argument(nvme_dir):
    with pytest.raises(ValueError, match="dirs must name at least one directory"):
        C.NvmeStore([], MiB)
    with pytest.raises(ValueError, match="lists .* twice"):
        C.NvmeStore([nvme_dir, nvme_dir], MiB)
    with pytest.raises(ValueError, match="capacity_bytes must be positive, got 0"):
        C.NvmeStore([nvme_dir], 0)
    with pytest.raises(ValueError, match="chunk_bytes must be a positive multiple of 4096, got 1000"):
        C.NvmeStore([nvme_dir], MiB, chunk_bytes=1000)
    with pytest.raises(ValueError, match="workers must be between 1 and 1024, got 0"):
        C.NvmeStore([nvme_dir], MiB, workers=0)
    with pytest.raises(ValueError, match=r"max_inflight_bytes \(4096\) must be at least chunk_bytes"):
        C.NvmeStore([nvme_dir], MiB, max_inflight_bytes=4096)
    with pytest.raises(ValueError, match="workers must be >= 0, got -1"):
        C.NvmeStore([nvme_dir], MiB, workers=-1)
    store = C.NvmeStore([nvme_dir], MiB)
    other = C.NvmeStore([nvme_dir], MiB)
    ext = store.allocate(100)
    buf = torch.empty(200, dtype=torch.uint8)
    with pytest.raises(ValueError, match="write of 200 bytes does not fit the extent of 100 bytes"):
        store.write_ptr(ext, buf.data_ptr(), 200)
    with pytest.raises(ValueError, match="ptr is 0"):
        store.read_ptr(ext, 0, 10)
    with pytest.raises(ValueError, match="phase must be below the alignment"):
        store.allocate(100, phase=store.alignment)
    with pytest.raises(ValueError, match="phase must be >= 0, got -1"):
        store.allocate(100, phase=-1)
    with pytest.raises(ValueError, match="Extent belongs to a different NvmeStore"):
        other.read_ptr(ext, buf.data_ptr(), 10)
    arena = C.HostArena(MiB)
    with pytest.raises(ValueError, match="does not fit the extent"):
        store.write(ext, arena.allocate(101))
    released = arena.allocate(10)
    released.release()
    with pytest.raises(UsedAfterCloseError, match="HostBlock was released"):
        store.write(ext, released)
    store.close()
    other.close()


@pytest.mark.skipif(C.cuda_compiled and C.cuda_usable(), reason="CUDA present")
def test_cuda_paths_without_a_gpu_raise_runtime_error(nvme_dir):
    store = C.NvmeStore([nvme_dir], MiB)
    arena = C.HostArena(MiB)
    block = arena.allocate(4096)
    ext = store.allocate(4096)
    with pytest.raises(RuntimeError, match="CUDA|cuda"):
        store.write_after_event(ext, block, 1)
    with pytest.raises(RuntimeError, match="CUDA|cuda"):
        store.read_then_h2d(ext, block, 1, 4096, 0, 1)
    with pytest.raises(RuntimeError, match="CUDA|cuda"):
        C.copy_d2h(1, 1, 1, 0, 0)
    store.close()


# ------------------------------------------------------------------ O_DIRECT fallback

@pytest.mark.parametrize("fstype", ["tmpfs", "ramfs"])
def test_filesystems_without_o_direct_fall_back_with_one_warning(fstype, caplog):
    with _mounted(fstype) as first, _mounted(fstype) as second:
        expect_direct = _supports_o_direct(first)
        if fstype == "ramfs":
            assert not expect_direct      # the case that must fall back on any kernel
        with caplog.at_level(logging.WARNING, logger="offload"):
            store = C.NvmeStore([first, second], 4 * MiB)
        warnings = [r for r in caplog.records if r.name == "offload" and r.levelno == logging.WARNING]
        assert store.direct == expect_direct
        if expect_direct:                 # tmpfs on Linux >= 6.6 supports O_DIRECT
            assert warnings == []
        else:
            assert len(warnings) == 1, [r.message for r in warnings]
            assert "O_DIRECT is not supported" in warnings[0].message
            assert first in warnings[0].message and second in warnings[0].message
        n = MiB + 3
        _assert_round_trip(store, n, seed=8)
        store.close()
        assert os.listdir(first) == [] and os.listdir(second) == []


def test_direct_false_uses_buffered_io_without_a_warning(nvme_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="offload"):
        store = C.NvmeStore([nvme_dir], MiB, direct=False)
    assert not store.direct and caplog.records == []
    _assert_round_trip(store, 5000, seed=1)
    store.close()


# ------------------------------------------------------- nothing is left on disk, ever

_CHILD = textwrap.dedent("""
    import sys, time, torch
    from offload._ext import load_core
    C = load_core()
    mode, directory = sys.argv[1], sys.argv[2]
    store = C.NvmeStore([directory], 64 << 20, chunk_bytes=1 << 20)
    src = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8)
    ext = store.allocate(src.numel())
    store.write_ptr(ext, src.data_ptr(), src.numel()).wait()
    import os
    print("listing", os.listdir(directory), flush=True)
    if mode == "exception":
        raise RuntimeError("boom")
    if mode == "kill":
        print("ready", flush=True)
        while True:   # keep writes in flight until SIGKILL lands
            store.write_ptr(ext, src.data_ptr(), src.numel()).wait()
    # mode == "exit": leave without close(); interpreter teardown must not leave files
""")


@pytest.mark.parametrize("mode", ["exit", "exception"])
def test_nothing_left_after_exit_or_exception(nvme_dir, mode):
    proc = subprocess.run([sys.executable, "-c", _CHILD, mode, nvme_dir], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert "listing []" in proc.stdout, proc.stdout + proc.stderr   # nameless while open, too
    if mode == "exception":
        assert proc.returncode != 0 and "boom" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
    assert os.listdir(nvme_dir) == []


def test_nothing_left_after_sigkill_mid_write(nvme_dir):
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, "kill", nvme_dir], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        line = ""
        while "ready" not in line and time.time() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                pytest.fail(f"child exited early: {proc.stderr.read()}")
        time.sleep(0.2)                    # let writes be in flight
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert os.listdir(nvme_dir) == []


def test_garbage_collecting_a_store_waits_for_its_io(nvme_dir):
    store = C.NvmeStore([nvme_dir], 8 * MiB, throttle_bytes_per_s=40 * MiB, chunk_bytes=256 * 1024)
    src = _random_bytes(2 * MiB, seed=12)
    fut = store.write_ptr(store.allocate(src.numel()), src.data_ptr(), src.numel())
    del store
    gc.collect()
    assert fut.done() and fut.wait() == src.numel()


@pytest.mark.parametrize("timeout_s", [float("inf"), 1e30])
def test_a_timeout_of_forever_waits_for_the_transfer(timeout_s, nvme_dir):
    """`wait(timeout_s=inf)` converted the timeout to the clock's ticks, which overflowed:
    TimeoutError at once (found by a code review). NaN is refused, naming the argument."""
    import threading

    store = C.NvmeStore([nvme_dir], 4 * MiB)
    ext = store.allocate(MiB)
    data = torch.ones(MiB, dtype=torch.uint8)
    store._hold_workers_for_test(True)
    fut = store.write_ptr(ext, data.data_ptr(), MiB)
    with pytest.raises(ValueError, match="timeout_s is NaN"):
        fut.wait(timeout_s=float("nan"))
    release = threading.Timer(0.3, store._hold_workers_for_test, (False,))
    release.start()
    assert fut.wait(timeout_s=timeout_s) == MiB
    release.join()
    store.close()
