"""A simulated GPU for testing stream protocols on a CPU (see tests/test_copy_protocol.py).

Strict like CUDA and torch where our stream protocols depend on them:

* a stream is a FIFO of operations that run only when the test lets the "device" progress,
  picking a random stream each time (seeded), so work on different streams interleaves in
  every order that CUDA allows and no other;
* a copy is resolved to raw addresses when it is enqueued and moves bytes when it runs, like
  DMA on raw pointers: it does not keep any Python object alive;
* the device allocator is torch's caching allocator in small (`SimAllocator`): sizes are
  rounded up to 512 bytes, a freed block goes back to the pool of the stream it was
  allocated on and is handed at once to the next request of that stream that fits (best
  fit, split when the rest is worth keeping, merged again with free neighbours), so a block
  freed by one size is reused by others, unless `record_stream` added other streams;
* the host arena reuses a block as soon as the block object is garbage; `is_pinned` is True
  only for memory of a pinned space (the arena), as torch answers for page-locked memory;
* the current stream is per thread (torch's is: autograd runs backward on a device thread
  of its own, whose current stream is the one each node ran on in forward);
* events follow CUDA: a stream wait covers the record made before the wait was enqueued;
* graph capture in global mode (`begin_capture`): work queued on a capturing stream, or on
  a stream that waited on an event recorded in the capture, is captured, not run; an event
  query or synchronization raises, as CUDA refuses it, and invalidates the capture.

`SimGpu` has the methods of offload.tiers.cuda_backend.TorchCuda, so `CopyStreams(_backend=sim)`
runs its real code against it. Not a test module (no test_ prefix).
"""
from __future__ import annotations

import random
import threading
import weakref
from collections import deque

import numpy as np
import torch

__all__ = ["SimStream", "SimEvent", "SimGpu", "SimAllocator", "SimBlock", "SimArena", "SimFuture",
           "SimStore", "CAPTURE_REFUSED"]

CAPTURE_REFUSED = "operation not permitted when stream is capturing"   # CUDA's message


class SimStream:
    def __init__(self, name):
        self.name = name
        self.ops = deque()
        self.clock_s = 0.0   # each stream its own engine: copies on two streams overlap


class SimEvent:
    def __init__(self, timing):
        self.timing = timing
        self.records = 0      # records enqueued so far
        self.completed = 0    # highest record that ran
        self.time_s = None
        self.captured = False  # its last record was captured into a graph


class _Block:
    __slots__ = ("off", "size", "stream", "pool", "free", "prev", "next")

    def __init__(self, off, size, stream, pool):
        self.off, self.size, self.stream, self.pool = off, size, stream, pool
        self.free, self.prev, self.next = True, None, None


class SimAllocator:
    """torch's CUDACachingAllocator (c10/cuda/CUDACachingAllocator.cpp), reduced to what
    decides which address a request gets: the constants are torch's.

    Requests are rounded up to 512 bytes. Up to 1 MiB they come from the small pool, whose
    segments are 2 MiB; larger ones from the large pool (20 MiB segments below 10 MiB, else
    their size rounded to 2 MiB). A request takes the smallest free block of its stream and
    pool that fits (lowest address among equals); the rest is split off as a free block when
    it is at least 512 bytes (small pool) or more than 1 MiB (large pool). A freed block
    merges with the free blocks next to it in its segment.
    """

    MIN_BLOCK = 512
    SMALL_SIZE = 1 << 20
    SMALL_BUFFER = 2 << 20
    LARGE_BUFFER = 20 << 20
    MIN_LARGE_ALLOC = 10 << 20
    ROUND_LARGE = 2 << 20

    def __init__(self, capacity_bytes):
        self.capacity_bytes = capacity_bytes
        self._bump = 0
        self._free: dict[tuple[int, str], list[_Block]] = {}
        self._used: dict[int, _Block] = {}   # offset -> allocated block

    @staticmethod
    def _round(n, unit):
        return (n + unit - 1) // unit * unit

    def allocate(self, nbytes, stream) -> int:
        size = self._round(max(nbytes, 1), self.MIN_BLOCK)
        pool = "small" if size <= self.SMALL_SIZE else "large"
        free = self._free.setdefault((id(stream), pool), [])
        fits = [b for b in free if b.size >= size]
        if fits:
            block = min(fits, key=lambda b: (b.size, b.off))
            free.remove(block)
        else:
            if pool == "small":
                seg = self.SMALL_BUFFER
            elif size < self.MIN_LARGE_ALLOC:
                seg = self.LARGE_BUFFER
            else:
                seg = self._round(size, self.ROUND_LARGE)
            assert self._bump + seg <= self.capacity_bytes, "simulated device memory exhausted"
            block = _Block(self._bump, seg, stream, pool)
            self._bump += seg
        rest = block.size - size
        if (rest >= self.MIN_BLOCK) if pool == "small" else (rest > self.SMALL_SIZE):
            tail = _Block(block.off + size, rest, stream, pool)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            free.append(tail)
        block.free = False
        self._used[block.off] = block
        return block.off

    def release(self, off) -> None:
        block = self._used.pop(off)
        free = self._free[(id(block.stream), block.pool)]
        for other in (block.prev, block.next):
            if other is not None and other.free:
                free.remove(other)
                lo, hi = (other, block) if other is block.prev else (block, other)
                lo.size += hi.size
                lo.next = hi.next
                if hi.next is not None:
                    hi.next.prev = lo
                block = lo
        block.free = True
        free.append(block)


class SimGpu:
    """A backend for CopyStreams (same methods as cuda_streams._TorchCuda)."""

    def __init__(self, seed, device_bytes=64 << 20):
        self.rng = random.Random(seed)
        # numpy's zeros are lazily committed: untouched simulated memory costs no RAM
        self.dev = torch.from_numpy(np.zeros(device_bytes, dtype=np.uint8))
        self.spaces = [(self.dev.data_ptr(), device_bytes, self.dev, False)]
        self.allocator = SimAllocator(device_bytes)
        self._blocks: dict[int, dict] = {}
        self.streams: list[SimStream] = []
        self.handles: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._copy_streams = None
        self.compute = self.new_stream(None)
        self._local = threading.local()
        self._capturing: set[SimStream] = set()   # the capture's streams (joined ones too)
        self.capture_invalidated = False
        self.captured_ops = 0
        self.bytes_per_s = 1e9

    @property
    def current(self):
        """The calling thread's current stream (the compute stream until it sets one)."""
        return getattr(self._local, "stream", self.compute)

    @current.setter
    def current(self, stream):
        self._local.stream = stream

    # --- backend API
    def device(self, device):
        return torch.device("cpu")

    def new_stream(self, device):
        s = SimStream(f"s{len(self.streams)}")
        self.streams.append(s)
        self.handles[id(s)] = s
        return s

    def copy_streams(self, device):
        """One offload/prefetch pair per simulated device, reused like the real ones (Note 13)."""
        if self._copy_streams is None:
            self._copy_streams = (self.new_stream(device), self.new_stream(device))
        return self._copy_streams

    def current_stream(self, device):
        return self.current

    def capturing(self):
        return self.current in self._capturing

    def new_event(self, timing, blocking=False):
        ev = SimEvent(timing)
        self.handles[id(ev)] = ev
        return ev

    def record(self, ev, stream):
        ev.records += 1
        ev.captured = stream in self._capturing
        self._enqueue(stream, ("record", ev, ev.records))

    def wait_event(self, stream, ev):
        if ev.captured and self._capturing:
            self._capturing.add(stream)   # a wait on a captured record joins the capture
        self._enqueue(stream, ("wait", ev, ev.records))

    def query(self, ev):
        self._refuse_in_capture()
        return ev.completed >= ev.records

    def synchronize(self, ev):
        self._refuse_in_capture()
        while not self.query(ev):
            assert self.step(), "deadlock: waiting for an event no stream can reach"

    def elapsed_s(self, start, end):
        return end.time_s - start.time_s

    def empty(self, nbytes, device, stream):
        off = self.allocator.allocate(nbytes, stream)
        t = self.dev[off:off + nbytes]
        blk = {"off": off, "stream": stream, "recorded": set()}
        self._blocks[t.data_ptr()] = blk
        weakref.finalize(t, self._release, t.data_ptr(), blk)
        return t

    def copy(self, dst, src, stream):
        n = dst.numel() * dst.element_size()
        assert n == src.numel() * src.element_size()
        self.copy_raw(dst.data_ptr(), src.data_ptr(), n, stream)

    def record_stream(self, tensor, stream):
        self._blocks[tensor.data_ptr()]["recorded"].add(stream)

    def is_pinned(self, host):
        ptr = host.data_ptr()
        return any(pinned and base <= ptr < base + size
                   for base, size, _, pinned in self.spaces)

    def stream_handle(self, stream):
        return id(stream)

    def event_handle(self, ev):
        return id(ev)

    # --- graph capture (global mode), as a test drives it
    def begin_capture(self, stream=None):
        self._capturing = {stream or self.current}
        self.capture_invalidated = False

    def end_capture(self) -> bool:
        """Ends the capture; True if it was invalidated (a refused call during it)."""
        self._capturing = set()
        return self.capture_invalidated

    def _refuse_in_capture(self):
        if self._capturing:
            self.capture_invalidated = True
            raise RuntimeError(f"CUDA error: {CAPTURE_REFUSED}")

    def _enqueue(self, stream, op):
        if stream in self._capturing:
            self.captured_ops += 1   # part of the graph; runs only when it is replayed
        else:
            stream.ops.append(op)

    # --- raw-pointer work, as the engine or a kernel would issue it
    def copy_raw(self, dst_ptr, src_ptr, nbytes, stream):
        self._enqueue(stream, ("copy", self._resolve(dst_ptr, nbytes), self._resolve(src_ptr, nbytes)))

    def fill(self, t, value, stream=None):
        self._enqueue(stream or self.current, ("fill", self._resolve(t.data_ptr(), t.numel()), value))

    def read(self, t, out: list, stream=None):
        self._enqueue(stream or self.current, ("read", self._resolve(t.data_ptr(), t.numel()), out))

    def add_host_space(self, tensor, pinned=False):
        self.spaces.append((tensor.data_ptr(), tensor.numel(), tensor, pinned))

    def _resolve(self, ptr, nbytes):
        for base, size, mem, _ in self.spaces:
            if base <= ptr and ptr + nbytes <= base + size:
                return mem, ptr - base, nbytes
        raise AssertionError(f"address {ptr:#x} is in no simulated memory")

    def _release(self, ptr, blk):
        self._blocks.pop(ptr, None)
        others = blk["recorded"] - {blk["stream"]}
        if not others:
            self.allocator.release(blk["off"])
            return
        left = [len(others)]   # like the caching allocator: events on the recorded streams

        def one_done():
            left[0] -= 1
            if left[0] == 0:
                self.allocator.release(blk["off"])

        for s in others:
            s.ops.append(("call", one_done))

    # --- progress
    def _runnable(self, s):
        if not s.ops:
            return False
        op = s.ops[0]
        return op[0] != "wait" or op[1].completed >= op[2]

    def step(self):
        ready = [s for s in self.streams if self._runnable(s)]
        if not ready:
            return False
        stream = self.rng.choice(ready)
        op = stream.ops.popleft()
        kind = op[0]
        if kind == "record":
            op[1].completed = max(op[1].completed, op[2])
            op[1].time_s = stream.clock_s
        elif kind == "wait":
            stream.clock_s = max(stream.clock_s, op[1].time_s or 0.0)
        elif kind == "copy":
            (dm, do, n), (sm, so, _) = op[1], op[2]
            dm[do:do + n].copy_(sm[so:so + n])
            stream.clock_s += n / self.bytes_per_s
        elif kind == "fill":
            m, o, n = op[1]
            m[o:o + n] = op[2]
        elif kind == "read":
            m, o, n = op[1]
            op[2].append(bytes(m[o:o + n].numpy()))
        elif kind == "call":
            op[1]()
        return True

    def run_some(self):
        for _ in range(self.rng.randint(0, 3)):
            if not self.step():
                return

    def finish(self):
        while self.step():
            pass
        stuck = [s.name for s in self.streams if s.ops]
        assert not stuck, f"streams blocked forever: {stuck}"


class SimBlock(np.ndarray):
    """Stands in for a HostBlock: buffer protocol, `.nbytes`, freed when garbage."""


class SimArena:
    def __init__(self, sim, capacity=1 << 18, pinned=True):
        self.buf = np.zeros(capacity, dtype=np.uint8)
        sim.add_host_space(torch.from_numpy(self.buf), pinned=pinned)
        self._bump = 0
        self._free: dict[int, list[int]] = {}

    def allocate(self, nbytes):
        free = self._free.get(nbytes)
        if free:
            off = free.pop()   # most recently freed first, like a real free list
        else:
            off = self._bump
            self._bump += (nbytes + 15) // 16 * 16
            assert self._bump <= self.buf.size, "simulated arena exhausted"
        block = self.buf[off:off + nbytes].view(SimBlock)
        weakref.finalize(block, self._free.setdefault(nbytes, []).append, off)
        return block


class SimFuture:
    def __init__(self):
        self._result = None
        self._error = None
        self._done = False

    def done(self):
        return self._done

    def wait(self, timeout_s=None):
        assert self._done, "test bug: a simulated future is waited on before it completed"
        if self._error:
            raise self._error
        return self._result

    def set(self, result=None, error=None):
        self._result, self._error, self._done = result, error, True


class SimStore:
    """NvmeStore's CUDA-chaining calls, run when the test calls `progress()`."""

    def __init__(self, sim):
        self.sim = sim
        self.data: dict[object, bytes] = {}
        self.jobs = deque()

    def read_then_h2d(self, extent, block, dst_ptr, nbytes, stream, event):
        fut = SimFuture()
        self.jobs.append(("read", extent, block, dst_ptr, nbytes, stream, event, fut))
        return fut

    def write_after_event(self, extent, block, event):
        fut = SimFuture()
        self.jobs.append(("write", extent, block, event, fut))
        return fut

    def progress(self, fail=False):
        job = self.jobs.popleft()
        if job[0] == "read":
            _, extent, block, dst_ptr, nbytes, stream, event, fut = job
            if fail:
                from offload.errors import StorageError
                fut.set(error=StorageError(5, "read failed", "/x", 0, nbytes))
                return
            block[:nbytes] = np.frombuffer(self.data[extent], dtype=np.uint8)
            stream = self.sim.handles[stream]
            self.sim.copy_raw(dst_ptr, block.ctypes.data, nbytes, stream)
            self.sim.record(self.sim.handles[event], stream)
            fut.set(nbytes)
        else:
            _, extent, block, event, fut = job
            self.sim.synchronize(self.sim.handles[event])
            self.data[extent] = bytes(block)
            fut.set(len(block))
