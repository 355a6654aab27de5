"""Check an installed offload (wheel or sdist build) without importing torch.

    python tools/check_wheel.py            # run from anywhere but the source checkout

Used by cibuildwheel's test step (pyproject [tool.cibuildwheel]) and by .ci/run after it
installs the sdist and the wheel into fresh virtual environments. The compiled core is
loaded straight from the installed package (`offload/__init__` imports torch, the core does
not), and checked for: the installed version, the CUDA paths compiled in (`cuda-dlopen`),
no CUDA library and no libtorch linked, a reason why no GPU is usable when none is, the
license and `py.typed` files, and an NVMe store round trip through a temporary directory.
Exits non-zero with a message naming what is wrong.
"""
from __future__ import annotations

import ctypes
import glob
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile


def fail(message: str) -> None:
    sys.exit(f"check_wheel: {message}")


def main() -> int:
    spec = importlib.util.find_spec("offload")
    if spec is None or not spec.submodule_search_locations:
        fail("offload is not installed in this environment")
    package = list(spec.submodule_search_locations)[0]
    if os.path.exists(os.path.join(os.path.dirname(package), "pyproject.toml")):
        fail(f"{package} is a source checkout; run this outside it to check the installed copy")
    version = importlib.metadata.version("offload")
    modules = [p for s in importlib.machinery.EXTENSION_SUFFIXES
               for p in glob.glob(os.path.join(package, "_C" + s))]
    if len(modules) != 1:
        fail(f"expected one compiled core in {package}, found {modules}")
    core_spec = importlib.util.spec_from_file_location("offload._C", modules[0])
    core = importlib.util.module_from_spec(core_spec)
    core_spec.loader.exec_module(core)

    if core.__version__ != version:
        fail(f"the core says version {core.__version__}, the package {version}")
    if not core.cuda_compiled or core.build_flavour != "cuda-dlopen":
        fail(f"CUDA paths not compiled in (build_flavour={core.build_flavour!r})")
    if not core.cuda_usable() and not core.cuda_unusable_reason():
        fail("no GPU usable, and no reason given")
    needed = subprocess.run(["readelf", "-d", modules[0]], capture_output=True, text=True)
    if needed.returncode == 0:
        linked = [ln for ln in needed.stdout.splitlines() if "(NEEDED)" in ln]
        bad = [ln for ln in linked if any(w in ln for w in ("cuda", "torch", "c10"))]
        if bad:
            fail(f"the core links {bad}: it must load on machines without them")
    files = [str(f) for f in importlib.metadata.files("offload") or []]
    for wanted in ("py.typed", "LICENSE"):
        if not any(f.endswith(wanted) for f in files):
            fail(f"{wanted} is not in the installed files")
    meta = importlib.metadata.metadata("offload")
    if meta.get("License-Expression") != "Apache-2.0":
        fail(f"License-Expression is {meta.get('License-Expression')!r}, not 'Apache-2.0'")

    with tempfile.TemporaryDirectory(dir=os.environ.get("OFFLOAD_TEST_DIR", "/var/tmp")) as d:
        store = core.NvmeStore([d], 1 << 20)
        src = (ctypes.c_uint8 * 5000).from_buffer_copy(bytes(i % 251 for i in range(5000)))
        dst = (ctypes.c_uint8 * 5000)()
        extent = store.allocate(5000)
        store.write_ptr(extent, ctypes.addressof(src), 5000).wait()
        store.read_ptr(extent, ctypes.addressof(dst), 5000).wait()
        if bytes(dst) != bytes(src):
            fail("NVMe store round trip changed the bytes")
        store.close()
    print(f"check_wheel: offload {version} at {package}: core {core.build_flavour}, GPU "
          f"{'usable' if core.cuda_usable() else 'not usable: ' + core.cuda_unusable_reason()}; ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
