"""Both build configurations of offload._C, and the installed one.

The CUDA paths need no toolkit (csrc/cudart.hpp): the from-scratch builds run with the
toolkit hidden (no nvcc on PATH, no CUDA_HOME / CUDA_PATH, CMake told not to find it), and
the module links no CUDA library and no libtorch."""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import offload
from offload._ext import load_core

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C = load_core()


def _needed_libraries(path: str) -> list[str]:
    out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def toolkit_hidden_env() -> dict[str, str]:
    """The environment with every way to the CUDA toolkit removed (PATH entries holding
    nvcc, CUDA_HOME, CUDA_PATH, CUDACXX); pair it with -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_HOME", "CUDA_PATH", "CUDACXX", "OFFLOAD_BUILD_CUDA")}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep)
        if p and not os.path.exists(os.path.join(p, "nvcc")))
    return env


@pytest.mark.skipif(os.environ.get("OFFLOAD_BUILD_CUDA") == "0", reason="CUDA build switched off")
def test_installed_build_has_the_cuda_paths_compiled_in():
    assert C.cuda_compiled is True and C.build_flavour == "cuda-dlopen"
    info = offload.build_info()
    assert info["cuda_compiled"] and info["build_flavour"] == "cuda-dlopen"
    assert info["version"] == offload.__version__ == C.__version__


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf not installed")
def test_no_cuda_library_or_libtorch_is_linked():
    needed = _needed_libraries(C.__file__)
    assert not [lib for lib in needed if "cuda" in lib or "torch" in lib or "c10" in lib], needed


def test_import_without_a_driver_does_not_fail():
    # This machine may have the toolkit but no driver: cuda_usable() answers, never raises.
    proc = subprocess.run([sys.executable, "-c", "from offload._ext import load_core; "
                           "C = load_core(); print(C.cuda_compiled, C.cuda_usable())"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


_CHECK_CPU_ONLY = """
    assert C.cuda_compiled is False and C.cuda_usable() is False and C.build_flavour == "cpu"
    assert "OFFLOAD_BUILD_CUDA=0" in C.cuda_unusable_reason()
    try:
        C.copy_h2d(1, 1, 1, 0, 0)
    except RuntimeError as exc:
        assert "built without its CUDA paths" in str(exc), exc
    else:
        raise AssertionError("copy_h2d must raise in a CPU-only build")
"""
_CHECK_CUDA = """
    assert C.cuda_compiled is True and C.build_flavour == "cuda-dlopen"
    assert C.cuda_usable() is False   # no runtime loaded: CPU torch
    assert "no CUDA runtime library" in C.cuda_unusable_reason()
"""


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    """One build tree for both configurations: the first test builds it from scratch, the
    other flips OFFLOAD_WITH_CUDA there, which recompiles only csrc/cuda_copy.cpp (the one
    file that reads it: CMakeLists.txt) and links again. Two trees from scratch took 70-180 s
    each, a fifth of the suite."""
    return tmp_path_factory.mktemp("build")


def test_only_the_file_cmake_gives_the_cuda_switch_reads_it():
    # Else flipping the option in one tree (build_dir) would leave that file as it was, and
    # an ON build would compile it without its CUDA paths (CMakeLists.txt sets the switch
    # on csrc/cuda_copy.cpp alone).
    readers = sorted(os.path.basename(path) for path in glob.glob(os.path.join(REPO, "csrc", "*"))
                     if re.search(r"^\s*#\s*(if|ifdef|ifndef|elif)\b.*\bOFFLOAD_WITH_CUDA\b",
                                  open(path).read(), re.M))
    assert readers == ["cuda_copy.cpp"]
    cmake = open(os.path.join(REPO, "CMakeLists.txt")).read()
    assert "set_source_files_properties(csrc/cuda_copy.cpp PROPERTIES COMPILE_DEFINITIONS " \
           "OFFLOAD_WITH_CUDA=1)" in cmake


@pytest.mark.slow
@pytest.mark.parametrize("with_cuda", [False, True], ids=["cpu-only", "cuda-toolkit-hidden"])
def test_build_from_scratch(build_dir, with_cuda):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("cmake not installed")
    pybind11 = pytest.importorskip("pybind11")
    build = build_dir
    configure = [cmake, "-S", REPO, "-B", str(build), f"-DOFFLOAD_WITH_CUDA={'ON' if with_cuda else 'OFF'}",
                 "-DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
                 f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
                 f"-DPython_EXECUTABLE={sys.executable}", "-DCMAKE_BUILD_TYPE=Release"]
    if shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    env = toolkit_hidden_env()
    proc = subprocess.run(configure, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"CUDA paths {'ON' if with_cuda else 'OFF'}" in proc.stdout
    proc = subprocess.run([cmake, "--build", str(build), "-j", str(os.cpu_count() or 2)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    commands = (build / "compile_commands.json").read_text()
    # A flag starts a word (a checkout path like ".../wt-issue20/csrc/cuda_copy.cpp" holds "-i").
    toolkit_dirs = re.findall(r"(?<!\S)(?:-I|-isystem)\s*(\S*(?i:cuda)\S*)", commands)
    assert toolkit_dirs == []   # nothing is compiled against a toolkit's headers
    # round_trip.cpp computes what runtime/round_trip.py does, float for float: no fused
    # multiply-add, and no precompiled header (built without the flag, it drops it in the
    # LTO link: CMakeLists.txt).
    (round_trip,) = [c["command"] for c in json.loads(commands)
                     if c["file"].endswith("csrc/round_trip.cpp")]
    assert "-ffp-contract=off" in round_trip and "cmake_pch" not in round_trip
    (module,) = glob.glob(str(build / "offload" / "_C*.so"))
    if shutil.which("readelf"):
        assert not [lib for lib in _needed_libraries(module) if "cuda" in lib]

    check = textwrap.dedent(f"""
        import importlib.util, tempfile, os, torch
        spec = importlib.util.spec_from_file_location("_C", {module!r})
        C = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(C)
    """) + textwrap.dedent(_CHECK_CUDA if with_cuda else _CHECK_CPU_ONLY) + textwrap.dedent(f"""
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
        print("build ok")
    """)
    proc = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "build ok" in proc.stdout, proc.stdout + proc.stderr
