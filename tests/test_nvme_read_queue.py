"""The nvme tier's read queue (tiers/nvme_reads.py): each read counted once, polled oldest
first, in any order of fetching, with fake futures (no engine)."""
from __future__ import annotations

import pytest

from offload._ext import core_available
from offload.tiers.nvme_reads import Read, ReadQueue
from offload.util.stats import Stats

# A read is the core's NvmeRead (csrc/nvme_records.cpp); the queue itself is Python.
pytestmark = pytest.mark.skipif(not core_available(), reason="needs the compiled core")


class FakeFuture:
    """An I/O that lands when the test says so; counts how often it was asked."""

    def __init__(self, end_s: float) -> None:
        self.finished = False
        self.end_s = end_s
        self.asked = 0
        self.waited = 0

    def done(self) -> bool:
        self.asked += 1
        return self.finished

    def wait(self, timeout_s=None) -> int:
        self.waited += 1
        self.finished = True
        return 1


def make_reads(queue: ReadQueue, n: int) -> list[Read]:
    reads = []
    for i in range(n):
        read = Read(1, FakeFuture(end_s=float(i + 1)), None, False)
        read.start_s = float(i)
        queue.add(read)
        reads.append(read)
    return reads


def intervals(stats: Stats) -> list:
    return sorted(stats.read_clock._intervals)


def test_poll_counts_landed_reads_oldest_first_and_stops_at_the_first_in_flight():
    stats = Stats()
    queue = ReadQueue(stats)
    reads = make_reads(queue, 4)
    assert stats.peak_reads_inflight == 4
    reads[0].future.finished = reads[2].future.finished = True
    queue.poll()
    # the oldest is seen; the third landed too but waits behind the second (FIFO engine)
    assert [r.observed for r in reads] == [True, False, False, False]
    assert intervals(stats) == [(0.0, 1.0)]
    assert not queue.idle
    for r in reads[1:]:
        r.future.finished = True
    queue.poll()
    assert all(r.observed for r in reads)
    assert intervals(stats) == [(float(i), float(i + 1)) for i in range(4)]
    assert queue.idle and queue.futures() == []
    assert len(queue._reads) == 0               # nothing seen stays behind


def test_a_read_fetched_out_of_order_is_counted_once_and_leaves_the_queue_later():
    stats = Stats()
    queue = ReadQueue(stats)
    reads = make_reads(queue, 3)
    reads[2].future.finished = True
    queue.observe(reads[2])                     # fetched first (the backward jumped)
    queue.observe(reads[2])                     # counted once, whoever asks again
    assert intervals(stats) == [(2.0, 3.0)]
    assert queue.futures() == [reads[0].future, reads[1].future]
    for r in reads[:2]:
        r.future.finished = True
    queue.poll()
    assert len(intervals(stats)) == 3
    assert queue.idle and len(queue._reads) == 0
    # a new read after the queue emptied counts toward the peak from zero again
    make_reads(queue, 1)
    assert stats.peak_reads_inflight == 3


def test_polling_never_asks_a_read_already_seen():
    # The backward fetches in the order the reads were issued and polls before each fetch:
    # every poll asks only the oldest read still in flight, once.
    stats = Stats()
    queue = ReadQueue(stats)
    reads = make_reads(queue, 500)
    for r in reads:
        queue.poll()
        r.future.finished = True
        queue.observe(r)
    queue.poll()
    assert max(r.future.asked for r in reads) == 1
    assert queue.idle and len(queue._reads) == 0


def test_a_released_payloads_read_keeps_its_memory_until_it_lands():
    stats = Stats()
    queue = ReadQueue(stats)
    (read,) = make_reads(queue, 1)
    read.buf = memory = bytearray(8)
    queue.defer(read)                           # released mid-read
    assert read.observed and not queue.idle
    assert queue.futures() == [read.future]
    queue.poll()
    assert read.buf is memory                   # still in flight: kept
    read.future.finished = True
    queue.poll()
    assert read.buf is None and queue.idle
    assert len(intervals(stats)) == 1


@pytest.mark.parametrize("wait", [True, False])
def test_reap_waits_only_when_asked(wait):
    stats = Stats()
    queue = ReadQueue(stats)
    (read,) = make_reads(queue, 1)
    read.buf = bytearray(8)
    queue.defer(read)
    queue.reap(wait=wait)
    assert (read.buf is None) == wait
    assert read.future.waited == (1 if wait else 0)


def test_a_read_deferred_from_inside_reap_is_not_lost():
    # A record dies (the collector) while the queue reaps, on the same thread: its read
    # must stay deferred, its memory kept, until it lands, and the reentrant lock must let
    # it in. (The race the lock closes, a defer on another thread that took the list before
    # reap swapped it, is not made to happen here.)
    stats = Stats()
    queue = ReadQueue(stats)
    first, late = make_reads(queue, 2)
    first.buf, late.buf = bytearray(8), bytearray(8)
    queue.defer(first)
    asked = first.future.done

    def done_and_a_release_meanwhile() -> bool:
        if not late.observed:
            queue.defer(late)                   # released while reap walks the list
        return asked()

    first.future.done = done_and_a_release_meanwhile
    queue.reap(wait=False)
    assert first.buf is not None and late.buf is not None
    assert set(map(id, queue.futures())) == {id(first.future), id(late.future)}
    first.future.finished = late.future.finished = True
    queue.reap(wait=False)
    assert first.buf is None and late.buf is None and queue.idle
    # The closure refers back to the queue and the reads, which the collector does not
    # track (csrc/nvme_records.cpp): such a cycle would never be freed. A real future
    # refers to none of them.
    del first.future.done
