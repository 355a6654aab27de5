"""Both build configurations of offload._C: the CPU-only one (CUDA switched off) is built
from csrc/ into a temporary directory and imported in a subprocess; the installed one is
checked for CUDA when the toolkit is present, and for a static CUDA runtime."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from offload._ext import load_core

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C = load_core()


def _cuda_toolkit_present() -> bool:
    return shutil.which("nvcc") is not None or os.path.exists("/usr/local/cuda/include/cuda_runtime_api.h")


def _needed_libraries(path: str) -> list[str]:
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


@pytest.mark.skipif(not _cuda_toolkit_present(), reason="no CUDA toolkit on this machine")
@pytest.mark.skipif(os.environ.get("OFFLOAD_BUILD_CUDA") == "0", reason="CUDA build switched off")
def test_installed_build_has_cuda_compiled_in_when_the_toolkit_is_present():
    assert C.cuda_compiled is True


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf not installed")
def test_cuda_runtime_is_linked_statically():
    needed = _needed_libraries(C.__file__)
    assert not [lib for lib in needed if "cudart" in lib or "libcuda" in lib], needed
    assert not [lib for lib in needed if "torch" in lib or "c10" in lib], needed


def test_import_without_a_driver_does_not_fail():
    # This machine may have the toolkit but no driver: cuda_usable() answers, never raises.
    proc = subprocess.run([sys.executable, "-c", "from offload._ext import load_core; "
                           "C = load_core(); print(C.cuda_compiled, C.cuda_usable())"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_cpu_only_build_from_scratch(tmp_path):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake not installed")
    pybind11 = pytest.importorskip("pybind11")
    build = tmp_path / "build"
    configure = [cmake, "-S", REPO, "-B", str(build), "-DOFFLOAD_WITH_CUDA=OFF",
                 f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
                 f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    env = {k: v for k, v in os.environ.items() if k != "OFFLOAD_BUILD_CUDA"}
    proc = subprocess.run(configure, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "offload: CUDA copy engine OFF" in proc.stdout
    proc = subprocess.run([cmake, "--build", str(build), "-j", str(os.cpu_count() or 2)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (module,) = glob.glob(str(build / "offload" / "_C*.so"))
    if shutil.which("readelf"):
        assert not [lib for lib in _needed_libraries(module) if "cuda" in lib]

    check = textwrap.dedent(f"""
        import importlib.util, tempfile, os, torch
        spec = importlib.util.spec_from_file_location("_C", {module!r})
        C = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(C)
        assert C.cuda_compiled is False and C.cuda_usable() is False
        assert "without the CUDA toolkit" in C.cuda_unusable_reason()
        try:
            C.copy_h2d(1, 1, 1, 0, 0)
        except RuntimeError as exc:
            assert "built without the CUDA toolkit" in str(exc), exc
        else:
            raise AssertionError("copy_h2d must raise in a CPU-only build")
        arena = C.HostArena(1 << 20)
        assert arena.pinned is False
        d = tempfile.mkdtemp(dir="/var/tmp")
        store = C.NvmeStore([d], 1 << 20)
        src = torch.arange(1000, dtype=torch.int32)
        ext = store.allocate(4000)
        store.write_ptr(ext, src.data_ptr(), 4000).wait()
        dst = torch.zeros(1000, dtype=torch.int32)
        store.read_ptr(ext, dst.data_ptr(), 4000).wait()
        assert torch.equal(src, dst)
        store.close()
        assert os.listdir(d) == []
        os.rmdir(d)
        print("cpu-only ok")
    """)
    proc = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "cpu-only ok" in proc.stdout, proc.stdout + proc.stderr
