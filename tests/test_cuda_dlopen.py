"""The CUDA paths compiled in without a toolkit and resolved at run time (csrc/cudart.hpp).

On this CPU machine no real GPU runs, so the resolution is checked three ways, each in a
subprocess (a runtime loaded into the test process would stay for every later test):
- tests/fake_cudart.c, a stand-in runtime whose "device" is host memory: the core finds it
  among the loaded libraries and its pinned arena, copies and the store's chained write and
  read move real bytes through it;
- the CUDA toolkit's own libcudart where one is installed: every entry point resolves, and
  without a driver the core says why it cannot use it;
- our declarations compiled against the toolkit's cuda_runtime_api.h: same signatures and
  constants.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import textwrap

import pytest
import torch

from fake_runtime import compiler, fake_cudart, prelude, run  # noqa: F401 (fixture)
from offload._ext import load_core

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
C = load_core()

pytestmark = pytest.mark.skipif(not C.cuda_compiled,
                                reason="offload._C built with OFFLOAD_BUILD_CUDA=0")


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA torch loads its runtime")
def test_without_a_loaded_runtime_the_core_says_so_and_finds_one_loaded_later(fake_cudart):
    out = run(prelude() + f"""
    assert C.cuda_compiled and C.build_flavour == "cuda-dlopen"
    assert not C.cuda_usable() and C.cuda_runtime() is None
    print(C.cuda_unusable_reason())
    try:
        C.copy_h2d(1, 1, 1, 0, 0)
    except RuntimeError as exc:
        print("copy:", exc)
    else:
        raise AssertionError("copy_h2d ran without a runtime")
    assert C.HostArena(1 << 20).pinned is False   # pinned=None: pins only when usable
    ctypes.CDLL({fake_cudart!r})   # "no runtime" was not cached
    assert C.cuda_usable(), C.cuda_unusable_reason()
    assert C.cuda_runtime() == {{"path": {fake_cudart!r}, "runtime_version": 99000,
                                "driver_version": 99010}}
    print("ok")
    """)
    reason, copy, ok = out.strip().splitlines()
    assert reason.startswith("no CUDA runtime library (libcudart.so.*) is loaded in this process")
    assert copy == "copy: cudaMemcpyAsync (host to device) needs CUDA, but " + reason
    assert ok == "ok"


def test_pinned_arena_copies_and_chained_store_io_run_through_the_loaded_runtime(
        fake_cudart, nvme_dir):
    run(prelude(fake_cudart) + f"""
    assert C.cuda_usable() and C.cuda_unusable_reason() == ""
    arena = C.HostArena(1 << 20)                  # pinned=None: CUDA is usable
    assert arena.pinned and counter("fake_host_allocs") == 1

    src = torch.arange(1000, dtype=torch.int32)
    dst = torch.zeros_like(src)
    C.copy_d2h(dst.data_ptr(), src.data_ptr(), 4000, 0, 0)
    assert fake.cudaStreamSynchronize(None) == 0   # the copy is asynchronous
    assert torch.equal(dst, src) and counter("fake_memcpy_bytes") == 4000

    # device -> pinned block -> NVMe after the D2H event, and NVMe -> pinned -> "device"
    event = ctypes.c_void_p()
    fake.cudaEventCreateWithFlags(ctypes.byref(event), 1 | 2)   # blocking, as Note 4's
    store = C.NvmeStore([{nvme_dir!r}], 1 << 20)
    block = arena.allocate(4000)
    C.copy_d2h(block.ptr, src.data_ptr(), 4000, 7, event.value)
    extent = store.allocate(4000)
    assert store.write_after_event(extent, block, event.value).wait() == 4000
    assert counter("fake_event_syncs") >= 1
    out = torch.zeros(1000, dtype=torch.int32)
    block2 = arena.allocate(4000)
    store.read_then_h2d(extent, block2, out.data_ptr(), 4000, 12345, event.value).wait()
    assert fake.cudaEventSynchronize(event) == 0   # recorded behind the H2D (Note 7)
    assert torch.equal(out, src), out[:8]
    del block, block2, extent
    store.close()
    gc.collect()
    del arena
    gc.collect()
    assert counter("fake_host_frees") == 1
    check_engine_threads()
    """)


def test_runtime_errors_name_the_call_and_are_cleared_from_the_runtime(fake_cudart, nvme_dir):
    out = run(prelude(fake_cudart) + f"""
    src = torch.arange(16, dtype=torch.uint8)
    try:
        C.copy_h2d(src.data_ptr(), src.data_ptr(), 16, 0, 0)
    except RuntimeError as exc:
        print(exc)
    # torch checks the runtime's last error after its own launches: ours must not linger
    assert fake.cudaGetLastError() == 0
    arena = C.HostArena(1 << 20)
    store = C.NvmeStore([{nvme_dir!r}], 1 << 20)
    extent = store.allocate(16)
    store.write_ptr(extent, src.data_ptr(), 16).wait()
    try:
        store.read_then_h2d(extent, arena.allocate(16), src.data_ptr(), 16, 1, 0).wait()
    except RuntimeError as exc:
        print(exc)
    store.close()
    """, env={"FAKE_CUDART_FAIL": "memcpy"})
    assert out.splitlines() == ["cudaMemcpyAsync (host to device) failed: fake failure"] * 2


def test_no_device_is_a_reason_not_an_error(fake_cudart):
    out = run(prelude(fake_cudart, device=None) + """
    print(C.cuda_usable(), C.cuda_unusable_reason())
    print(C.HostArena(1 << 20).pinned)
    try:
        C.HostArena(1 << 20, pinned=True)
    except RuntimeError as exc:
        print(exc)
    """, env={"FAKE_CUDART_DEVICES": "0"})
    assert out.splitlines() == [
        "False no CUDA device found", "False",
        "HostArena: pinned=True needs a usable CUDA device, but no CUDA device found (pass "
        "pinned=None to pin only when a GPU is present)"]


def _toolkit_runtime() -> str | None:
    roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    for root in filter(None, roots):
        found = sorted(glob.glob(os.path.join(root, "lib64", "libcudart.so.*")))
        if found:
            return found[0]
    return None


def _toolkit_include() -> str | None:
    roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")] + ["/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for root in filter(None, roots):
        if os.path.exists(os.path.join(root, "include", "cuda_runtime_api.h")):
            return os.path.join(root, "include")
    return None


@pytest.mark.skipif(_toolkit_runtime() is None, reason="no CUDA toolkit runtime installed here")
def test_the_toolkits_own_runtime_resolves_and_explains_a_missing_driver():
    path = _toolkit_runtime()
    out = run(prelude(path, device=None) + f"""
    rt = C.cuda_runtime()
    assert rt is not None and rt["runtime_version"] >= 10000, rt
    assert rt["path"] == {path!r} or (torch.version.cuda and "libcudart.so" in rt["path"]), rt
    print(C.cuda_usable(), C.cuda_unusable_reason())
    """)
    usable, _, reason = out.strip().partition(" ")
    if usable == "False":   # a machine with the toolkit but no GPU driver, like the dev box
        assert reason.startswith(("cudaGetDeviceCount failed: ", "no CUDA device found")), reason


# cuda_toolkit: the GPU check (benchmarks/gpu_check.sh) selects it with the cuda tests, so the
# machine whose runtime the declarations meet checks them against its own headers too.
@pytest.mark.cuda_toolkit
@pytest.mark.skipif(_toolkit_include() is None, reason="no CUDA toolkit headers installed here")
def test_our_declarations_match_the_toolkit_headers(tmp_path):
    check = tmp_path / "check.cpp"
    check.write_text(textwrap.dedent("""
        #include <cuda_runtime_api.h>
        #include <type_traits>
        #include "cudart.hpp"
        namespace rt = offload::cudart;
        // Our types for the runtime's: same ABI (enums are int-sized, handles the same structs).
        template <class T> struct Ours { using type = T; };
        template <> struct Ours<cudaError_t> { using type = rt::Error; };
        template <> struct Ours<cudaMemcpyKind> { using type = rt::MemcpyKind; };
        template <> struct Ours<cudaStreamCaptureStatus*> { using type = rt::StreamCaptureStatus*; };
        template <> struct Ours<cudaStreamCaptureMode*> { using type = rt::StreamCaptureMode*; };
        template <class F> struct Sig;
        template <class R, class... A> struct Sig<R(A...)> {
          using type = typename Ours<R>::type (*)(typename Ours<A>::type...);
        };
        #define SAME(fn, member) static_assert(std::is_same_v<Sig<decltype(::fn)>::type, \\
            decltype(rt::Api::member)>, #fn " differs from offload::cudart::Api::" #member);
        SAME(cudaGetDeviceCount, GetDeviceCount)
        SAME(cudaGetErrorString, GetErrorString)
        SAME(cudaGetLastError, GetLastError)
        SAME(cudaRuntimeGetVersion, RuntimeGetVersion)
        SAME(cudaDriverGetVersion, DriverGetVersion)
        SAME(cudaHostAlloc, HostAlloc)
        SAME(cudaFreeHost, FreeHost)
        SAME(cudaGetDevice, GetDevice)
        SAME(cudaSetDevice, SetDevice)
        SAME(cudaMemcpyAsync, MemcpyAsync)
        SAME(cudaEventCreateWithFlags, EventCreateWithFlags)
        SAME(cudaEventDestroy, EventDestroy)
        SAME(cudaEventRecord, EventRecord)
        SAME(cudaEventSynchronize, EventSynchronize)
        SAME(cudaStreamSynchronize, StreamSynchronize)
        SAME(cudaStreamIsCapturing, StreamIsCapturing)
        SAME(cudaThreadExchangeStreamCaptureMode, ThreadExchangeStreamCaptureMode)
        SAME(cudaStreamGetDevice, StreamGetDevice)
        static_assert(sizeof(cudaError_t) == sizeof(rt::Error));
        static_assert(sizeof(cudaMemcpyKind) == sizeof(rt::MemcpyKind));
        static_assert(std::is_same_v<cudaStream_t, rt::Stream> && std::is_same_v<cudaEvent_t, rt::Event>);
        static_assert(cudaSuccess == rt::kSuccess);
        static_assert(int(cudaMemcpyHostToDevice) == rt::kMemcpyHostToDevice);
        static_assert(int(cudaMemcpyDeviceToHost) == rt::kMemcpyDeviceToHost);
        static_assert(cudaHostAllocPortable == rt::kHostAllocPortable);
        static_assert(cudaEventDisableTiming == rt::kEventDisableTiming);
        static_assert(cudaEventBlockingSync == rt::kEventBlockingSync);
        static_assert(sizeof(cudaStreamCaptureStatus) == sizeof(rt::StreamCaptureStatus));
        static_assert(sizeof(cudaStreamCaptureMode) == sizeof(rt::StreamCaptureMode));
        static_assert(int(cudaStreamCaptureStatusNone) == rt::kStreamCaptureStatusNone);
        static_assert(int(cudaStreamCaptureStatusActive) == rt::kStreamCaptureStatusActive);
        static_assert(int(cudaStreamCaptureStatusInvalidated) == rt::kStreamCaptureStatusInvalidated);
        static_assert(int(cudaStreamCaptureModeGlobal) == rt::kStreamCaptureModeGlobal);
        static_assert(int(cudaStreamCaptureModeThreadLocal) == rt::kStreamCaptureModeThreadLocal);
        static_assert(int(cudaStreamCaptureModeRelaxed) == rt::kStreamCaptureModeRelaxed);
    """))
    proc = subprocess.run([compiler("c++"), "-std=c++17", "-fsyntax-only", "-I", _toolkit_include(),
                           "-I", os.path.join(REPO, "csrc"), str(check)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_found_runtime_that_cannot_run_is_named_when_the_context_is_built(fake_cudart):
    out = run(prelude(fake_cudart, device=None) + """
    import offload
    torch.cuda.is_available = lambda: True   # torch sees a GPU; the runtime found has none
    try:
        offload.activations(tiers="host")
    except offload.ConfigError as exc:
        print(exc)
    info = offload.build_info()
    print(info["gpu_usable"], info["cuda_runtime"]["path"])
    """, env={"FAKE_CUDART_DEVICES": "0"})
    error, info = out.strip().splitlines()
    assert error.startswith("offload.activations(tiers='host'): CUDA tensors would be moved, but "
                            "the GPU paths cannot be used: torch can use the GPU but offload's "
                            "core cannot: no CUDA device found (the core calls " + fake_cudart)
    assert info == f"False {fake_cudart}"
