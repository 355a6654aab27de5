"""The core's CUDA calls from its own threads, on the strict stand-in runtime (CPU only).

tests/fake_cudart.c runs copies later, on its own "device" thread, spins on events created
without cudaEventBlockingSync, keeps the current device per thread and refuses waits during
another thread's graph capture (its header says how). The first tests show it catches each
mistake it is there for (a missing wait, a spinning event, a call on a thread without a
device, a wait during a capture); the others hold the store's engine threads to it: the
D2H-event waiter, the I/O workers that queue the H2D after an NVMe read, the release
thread that keeps the pinned block until the H2D has read it, and the thread that frees
the pinned arena.
"""
from __future__ import annotations

import pytest

from fake_runtime import fake_cudart, prelude, run  # noqa: F401 (fixture)
from offload._ext import load_core

pytestmark = pytest.mark.skipif(not load_core().cuda_compiled,
                                reason="offload._C built with OFFLOAD_BUILD_CUDA=0")

SLOW_COPY = {"FAKE_CUDART_COPY_DELAY_US": "300000"}   # 0.3 s: a race cannot be won by luck

# A D2H of `src` into a pinned block, its event recorded behind it (as CopyStreams does).
_SETUP = """
src = torch.arange(1024, dtype=torch.int32)          # 4096 bytes: the "device" tensor
def new_event(flags=1 | 2):                           # blocking, no timing: Note 4's D2H events
    event = ctypes.c_void_p()
    assert fake.cudaEventCreateWithFlags(ctypes.byref(event), flags) == 0
    return event
arena = C.HostArena(1 << 20)
store = C.NvmeStore([NVME_DIR], 1 << 20)
extent = store.allocate(4096)
def stored_bytes():
    fake.fake_drain()
    check = arena.allocate(4096)
    store.read(extent, check).wait()
    return bytes(check)
"""


def _script(fake: str, nvme_dir: str, body: str, device: int = 0) -> str:
    return prelude(fake, device=device) + f"\n    NVME_DIR = {nvme_dir!r}\n" + "\n".join(
        "    " + line for line in (_SETUP + body).splitlines())


# --------------------------------------------------------------------------- the stand-in
def test_the_stand_in_catches_a_missing_wait_a_thread_without_device_and_a_wait_in_capture(
        fake_cudart):
    out = run(prelude(fake_cudart) + """
    src = torch.arange(1024, dtype=torch.int32)
    dst = torch.zeros_like(src)
    C.copy_d2h(dst.data_ptr(), src.data_ptr(), 4096, 0, 0)
    print("read at once:", torch.equal(dst, src))          # the copy has not run yet
    fake.cudaStreamSynchronize(None)
    print("read after the wait:", torch.equal(dst, src))

    def stray():                                          # a thread that never set a device
        C.copy_h2d(dst.data_ptr(), src.data_ptr(), 4096, 0, 0)
    t = threading.Thread(target=stray)
    t.start(); t.join()
    fake.fake_drain()                                     # before its tensors go at exit
    print("without device:", counter("fake_calls_without_device"),
          text("fake_first_call_without_device"), bin(counter("fake_contexts")))

    fake.fake_begin_capture(ctypes.c_void_p(777))         # another thread captures (global)
    event = ctypes.c_void_p()
    fake.cudaEventCreateWithFlags(ctypes.byref(event), 1)
    print("sync in capture:", fake.cudaEventSynchronize(event), fake.fake_end_capture())
    """, env=SLOW_COPY)
    assert out.splitlines() == [
        "read at once: False", "read after the wait: True",
        "without device: 1 cudaMemcpyAsync 0b1",
        "sync in capture: 900 1"]   # refused (cudaErrorStreamCaptureUnsupported), invalidated


def test_a_write_that_skips_its_d2h_wait_stores_stale_bytes(fake_cudart, nvme_dir):
    """The engine's wait for the D2H event is what makes the write-behind exact: with the
    stand-in's event wait turned into a no-op, the write stores the block before the copy."""
    script = _script(fake_cudart, nvme_dir, """
block = arena.allocate(4096)
event = new_event()
C.copy_d2h(block.ptr, src.data_ptr(), 4096, 7, event.value)   # lands 0.3 s from now
assert store.write_after_event(extent, block, event.value).wait() == 4096
print(stored_bytes() == src.numpy().tobytes())
store.close()
""")
    assert run(script, env=SLOW_COPY).split() == ["True"]
    assert run(script, env={**SLOW_COPY, "FAKE_CUDART_SKIP_EVENT_SYNC": "1"}).split() == ["False"]


def test_a_spinning_wait_is_counted(fake_cudart, nvme_dir):
    """An event made without cudaEventBlockingSync, handed to the write-behind, is waited on
    by spinning: the stand-in counts it (the D2H events of CopyStreams are blocking, Note 4)."""
    out = run(_script(fake_cudart, nvme_dir, """
block = arena.allocate(4096)
event = new_event(flags=2)
C.copy_d2h(block.ptr, src.data_ptr(), 4096, 7, event.value)
store.write_after_event(extent, block, event.value).wait()
print(counter("fake_spin_syncs"))
store.close()
"""))
    assert out.split() == ["1"]


# --------------------------------------------------------------------------- the engine's threads
def test_the_reload_release_sleeps_on_its_event_with_the_memorys_device_current(
        fake_cudart, nvme_dir):
    """NVMe -> pinned -> device on a rank whose GPU is device 1 of two: the I/O worker that
    queues the H2D, the release thread that waits for it (on a blocking-sync event) and
    lets go of the block, and the thread that frees the arena when the release thread held
    its last reference, all run with device 1 current: no context on device 0, no spin."""
    out = run(_script(fake_cudart, nvme_dir, """
store.write_ptr(extent, src.data_ptr(), 4096).wait()
out = torch.zeros_like(src)
done = new_event()
block = arena.allocate(4096)
store.read_then_h2d(extent, block, out.data_ptr(), 4096, 5, done.value).wait()
del block, arena                                       # the release task owns the arena now
gc.collect()
print("freed before the copy ran:", counter("fake_host_frees"))
fake.cudaEventSynchronize(done)                        # the consumer's wait (Note 7)
print("exact:", torch.equal(out, src))
store.close()                                          # joins the release thread
print("freed:", counter("fake_host_frees"), "on devices", bin(counter("fake_free_devices")))
device = ctypes.c_int()
fake.cudaGetDevice(ctypes.byref(device))
print("this thread's device:", device.value)
check_engine_threads(device=1)
""", device=1), env={**SLOW_COPY, "FAKE_CUDART_DEVICES": "2",
                    # 0.3 s passed between the read's wait and the count once, in a full run
                    # beside two other loads on 2 cores: the copy had run by then.
                    "FAKE_CUDART_COPY_DELAY_US": "2000000"})
    assert out.splitlines() == ["freed before the copy ran: 0", "exact: True",
                                "freed: 1 on devices 0b10", "this thread's device: 1"]


def test_engine_waits_are_legal_during_another_threads_graph_capture(fake_cudart, nvme_dir):
    """A capture in global mode on another thread forbids waits on every thread still in
    global mode: the write-behind's and the release thread's waits on our own events must
    neither fail nor invalidate that capture. An H2D onto a capturing stream is refused."""
    out = run(_script(fake_cudart, nvme_dir, """
fake.fake_begin_capture(ctypes.c_void_p(777))
block = arena.allocate(4096)
event = new_event()
C.copy_d2h(block.ptr, src.data_ptr(), 4096, 7, event.value)   # our offload stream: not captured
print("write:", store.write_after_event(extent, block, event.value).wait())
out = torch.zeros_like(src)
done = new_event()
store.read_then_h2d(extent, arena.allocate(4096), out.data_ptr(), 4096, 5, done.value).wait()
try:
    store.read_then_h2d(extent, arena.allocate(4096), out.data_ptr(), 4096, 777, 0)
except RuntimeError as exc:
    print("capturing stream:", exc)
store.close()                                   # the release thread waited during the capture
print("capture invalidated:", fake.fake_end_capture(), counter("fake_capture_violations"))
fake.cudaEventSynchronize(done)
print("exact:", torch.equal(out, src))
check_engine_threads()
"""))
    assert out.splitlines() == [
        "write: 4096",
        "capturing stream: read_then_h2d: the stream is capturing a CUDA graph; a copy "
        "chained behind an NVMe read cannot be part of a graph (capture outside "
        "offload.activations(), or wrap the captured region in offload.no_offload())",
        "capture invalidated: 0 0", "exact: True"]


def test_the_arena_is_freed_on_its_own_device_whatever_thread_lets_go_of_it(fake_cudart, nvme_dir):
    """The pinned arena belongs to the context of the device that allocated it. Its last
    owner may be a Python thread on another device, or an I/O worker that never set one
    (a write still in flight when Python let go): neither may free it on the wrong device,
    make a context elsewhere, or have its own current device changed."""
    out = run(prelude(fake_cudart, device=1) + f"""
    def device_now():
        d = ctypes.c_int()
        fake.cudaGetDevice(ctypes.byref(d))
        return d.value
    arena = C.HostArena(1 << 20)                          # allocated with device 1 current
    fake.cudaSetDevice(0)
    del arena
    gc.collect()
    print("python thread:", bin(counter("fake_free_devices")), "device now", device_now())

    fake.cudaSetDevice(1)
    arena = C.HostArena(1 << 20)
    store = C.NvmeStore([{nvme_dir!r}], 1 << 20, throttle_bytes_per_s=10_000)
    first = torch.zeros(4096, dtype=torch.uint8)
    store.write_ptr(store.allocate(4096), first.data_ptr(), 4096).wait()   # spends the credit
    extent = store.allocate(4096)
    store.write(extent, arena.allocate(4096))             # starts 0.4 s later (throttled)
    del arena
    gc.collect()
    print("while the write runs:", counter("fake_host_frees"))
    store.close()                                         # the I/O worker let go of it
    print("i/o worker:", counter("fake_host_frees"), bin(counter("fake_free_devices")),
          counter("fake_calls_without_device"), text("fake_first_call_without_device"))
    """, env={"FAKE_CUDART_DEVICES": "2"})
    assert out.splitlines() == ["python thread: 0b10 device now 0", "while the write runs: 1",
                                "i/o worker: 2 0b10 0 "]
