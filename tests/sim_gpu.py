"""A simulated GPU for testing stream protocols on a CPU (see tests/test_copy_protocol.py).

* a stream is a FIFO of operations that run only when the test lets the "device" progress,
  picking a random stream each time (seeded), so work on different streams interleaves in
  every order that CUDA allows and no other;
* a copy is resolved to raw addresses when it is enqueued and moves bytes when it runs, like
  DMA on raw pointers: it does not keep any Python object alive;
* the device allocator gives a freed block to the next allocation of the same size on the
  same stream at once (most recent first), as the caching allocator does, unless
  `record_stream` added other streams; the host arena reuses a block as soon as the block
  object is garbage;
* events follow CUDA: a stream wait covers the record made before the wait was enqueued.

`SimGpu` has the methods of offload.cuda_streams._TorchCuda, so `CopyStreams(_backend=sim)`
runs its real code against it. Not a test module (no test_ prefix).
"""
from __future__ import annotations

import random
import weakref
from collections import deque

import numpy as np
import torch

__all__ = ["SimStream", "SimEvent", "SimGpu", "SimBlock", "SimArena", "SimFuture", "SimStore"]


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


class SimGpu:
    """A backend for CopyStreams (same methods as cuda_streams._TorchCuda)."""

    def __init__(self, seed, device_bytes=1 << 20):
        self.rng = random.Random(seed)
        self.dev = torch.zeros(device_bytes, dtype=torch.uint8)
        self.spaces = [(self.dev.data_ptr(), device_bytes, self.dev)]
        self._bump = 0
        self._free: dict[tuple[int, int], list[int]] = {}
        self._blocks: dict[int, dict] = {}
        self.streams: list[SimStream] = []
        self.handles: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._copy_streams = None
        self.compute = self.new_stream(None)
        self.current = self.compute
        self.pinned = True
        self.bytes_per_s = 1e9

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

    def new_event(self, timing, blocking=False):
        ev = SimEvent(timing)
        self.handles[id(ev)] = ev
        return ev

    def record(self, ev, stream):
        ev.records += 1
        stream.ops.append(("record", ev, ev.records))

    def wait_event(self, stream, ev):
        stream.ops.append(("wait", ev, ev.records))

    def query(self, ev):
        return ev.completed >= ev.records

    def synchronize(self, ev):
        while not self.query(ev):
            assert self.step(), "deadlock: waiting for an event no stream can reach"

    def elapsed_s(self, start, end):
        return end.time_s - start.time_s

    def empty(self, nbytes, device, stream):
        free = self._free.get((id(stream), nbytes))
        if free:
            off = free.pop()
        else:
            off = self._bump
            self._bump += (nbytes + 15) // 16 * 16
            assert self._bump <= self.dev.numel(), "simulated device memory exhausted"
        t = self.dev[off:off + nbytes]
        blk = {"off": off, "n": nbytes, "stream": stream, "recorded": set()}
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
        return self.pinned

    def stream_handle(self, stream):
        return id(stream)

    def event_handle(self, ev):
        return id(ev)

    # --- raw-pointer work, as the engine or a kernel would issue it
    def copy_raw(self, dst_ptr, src_ptr, nbytes, stream):
        stream.ops.append(("copy", self._resolve(dst_ptr, nbytes), self._resolve(src_ptr, nbytes)))

    def fill(self, t, value, stream=None):
        (stream or self.current).ops.append(("fill", self._resolve(t.data_ptr(), t.numel()), value))

    def read(self, t, out: list, stream=None):
        (stream or self.current).ops.append(("read", self._resolve(t.data_ptr(), t.numel()), out))

    def add_host_space(self, tensor):
        self.spaces.append((tensor.data_ptr(), tensor.numel(), tensor))

    def _resolve(self, ptr, nbytes):
        for base, size, mem in self.spaces:
            if base <= ptr and ptr + nbytes <= base + size:
                return mem, ptr - base, nbytes
        raise AssertionError(f"address {ptr:#x} is in no simulated memory")

    def _release(self, ptr, blk):
        self._blocks.pop(ptr, None)
        others = blk["recorded"] - {blk["stream"]}
        key = (id(blk["stream"]), blk["n"])
        if not others:
            self._free.setdefault(key, []).append(blk["off"])
            return
        left = [len(others)]   # like the caching allocator: events on the recorded streams

        def one_done():
            left[0] -= 1
            if left[0] == 0:
                self._free.setdefault(key, []).append(blk["off"])

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
    def __init__(self, sim, capacity=1 << 18):
        self.buf = np.zeros(capacity, dtype=np.uint8)
        sim.add_host_space(torch.from_numpy(self.buf))
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
