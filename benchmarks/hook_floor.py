"""How low a saved tensor that stays can go: the floor under `offload stay`.

    python benchmarks/hook_floor.py                 # CPU, 1 thread, 5,000 x 4 KiB, 7 rounds
    python benchmarks/hook_floor.py --rounds 9 --cpu 1

The runtime's small path (csrc/hook_front.cpp) reads the tensor through Python attributes
(`layout`, `grad_fn`, `_version`, `_base`, `untyped_storage().nbytes()`), because the core
links no libtorch: one build serves every torch version (DESIGN.md, "The C++ core"). This
measures what that choice costs, beside what no hook can avoid. Each row is timed the way
hook_cost.py times its rows (its chain and `timed_block`, alternating rounds, medians of the
total per saved tensor above plain):

| path | what it is |
|---|---|
| identity (Python) | `saved_tensors_hooks(lambda t: t, lambda t: t)` |
| identity (C) | the same in C: torch's own cost of calling a pack and an unpack hook |
| stay through libtorch | a C hook reading the tensor through libtorch (no Python object made): the checks the small path makes (exact type, strided layout, a node, not a view of a leaf, under min_bytes), its output test and detach, its per-storage count, a handle holding the version, the unpack's version check |
| offload stay | `offload.activations()` with tensors below OFFLOAD_MIN_BYTES |

The libtorch row is built here with `torch.utils.cpp_extension` (a C++ compiler and ninja;
~30 s the first time, cached under --build-dir). It is a measurement, not a code path of
the runtime: a module compiled against one torch's headers must not be loaded by another.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch

import offload
from hook_cost import _identity, timed_block, timed_step

# The libtorch stay path: what the runtime's C packer decides for a small save, reading the
# tensor in C++ instead of through Python attributes.
SOURCE = r"""
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/function.h>
#include <ATen/SequenceNumber.h>
#include <unordered_map>

static PyObject* identity(PyObject*, PyObject* arg) { return Py_NewRef(arg); }

static std::unordered_map<const void*, int64_t> bytes_by_storage;  // the per-storage count
static int64_t packed = 0;
static constexpr int64_t min_bytes = 1 << 20;

static PyObject* stay_pack(PyObject*, PyObject* arg) {
  if (Py_TYPE(arg) != reinterpret_cast<PyTypeObject*>(THPVariableClass))
    return Py_NewRef(arg);
  const at::Tensor& t = THPVariable_Unpack(arg);
  if (t.layout() != at::kStrided) return Py_NewRef(arg);
  const int64_t version = t._version();
  const auto& node = t.grad_fn();
  const int64_t nbytes = static_cast<int64_t>(t.storage().nbytes());
  bool small = nbytes < min_bytes && node != nullptr;
  if (small && t.is_view()) small = !t._base().is_leaf();   // a view of a weight moves
  if (!small) return Py_NewRef(arg);
  bytes_by_storage.emplace(t.storage().unsafeGetStorageImpl(), nbytes);
  ++packed;
  // An output of the node saving it is held detached (breaks node -> save -> tensor -> node).
  PyObject* held = node->sequence_nr() == at::sequence_number::peek() - 1
                       ? THPVariable_Wrap(t.detach()) : Py_NewRef(arg);
  PyObject* saved_version = PyLong_FromLongLong(version);
  PyObject* handle = PyTuple_Pack(2, held, saved_version);
  Py_DECREF(held);
  Py_DECREF(saved_version);
  return handle;
}

static PyObject* stay_unpack(PyObject*, PyObject* handle) {
  if (!PyTuple_CheckExact(handle)) return Py_NewRef(handle);
  PyObject* held = PyTuple_GET_ITEM(handle, 0);
  if (THPVariable_Unpack(held)._version() != PyLong_AsLongLong(PyTuple_GET_ITEM(handle, 1))) {
    PyErr_SetString(PyExc_RuntimeError, "a saved tensor was modified in place");
    return nullptr;
  }
  return Py_NewRef(held);
}

static PyMethodDef hooks[] = {
    {"identity", identity, METH_O, nullptr},
    {"stay_pack", stay_pack, METH_O, nullptr},
    {"stay_unpack", stay_unpack, METH_O, nullptr},
};
py::object hook(int i) {
  return py::reinterpret_steal<py::object>(PyCFunction_New(&hooks[i], nullptr));
}
void reset() { bytes_by_storage.clear(); }
"""


def build(build_dir: str):
    from torch.utils.cpp_extension import load_inline
    os.makedirs(build_dir, exist_ok=True)
    print(f"building the C hooks in {build_dir} (~30 s the first time)", file=sys.stderr,
          flush=True)
    return load_inline("offload_hook_floor", cpp_sources=[SOURCE], functions=["hook", "reset"],
                       build_directory=build_dir, extra_cflags=["-O2"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=5000, help="saved tensors per step")
    ap.add_argument("--bytes", type=int, default=4096, help="bytes of each saved tensor")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds (median)")
    ap.add_argument("--steps", type=int, default=5, help="consecutive steps per path and round")
    ap.add_argument("--cpu", type=int, help="pin the timed thread to this CPU")
    ap.add_argument("--build-dir",
                    default=os.path.join(tempfile.gettempdir(), "offload-hook-floor"),
                    help="where the C hooks are built (kept: a rerun reuses the build)")
    args = ap.parse_args()
    for name, least in (("tensors", 1), ("bytes", 4), ("rounds", 1), ("steps", 1)):
        if getattr(args, name) < least:
            ap.error(f"--{name}={getattr(args, name)}: must be at least {least}")
    if args.bytes >= 1 << 20:
        ap.error(f"--bytes={args.bytes}: the floor is for tensors that stay, below 1 MiB "
                 "(the runtime's default OFFLOAD_MIN_BYTES)")
    ext = build(args.build_dir)
    torch.set_num_threads(1)
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    hooks = torch.autograd.graph.saved_tensors_hooks
    c_identity, stay_pack, stay_unpack = ext.hook(0), ext.hook(1), ext.hook(2)
    paths = {
        "plain": contextlib.nullcontext,
        "identity (Python)": lambda: hooks(_identity, _identity),
        "identity (C)": lambda: hooks(c_identity, c_identity),
        "stay through libtorch": lambda: hooks(stay_pack, stay_unpack),
        "offload stay": lambda: offload.activations(tiers="host"),  # default min_bytes
    }
    n, clock, sync = args.tensors, time.thread_time, (lambda: None)
    x0 = torch.randn(args.bytes // 4)
    for make in paths.values():   # warm-up
        timed_step(x0, n, make(), sync, clock)
    totals: dict[str, list[float]] = {name: [] for name in paths}
    for r in range(args.rounds):
        plain = sum(timed_block(x0, n, paths["plain"], args.steps, sync, clock)[:3])
        totals["plain"].append(plain / n)
        for name, make in list(paths.items())[1:]:
            got = sum(timed_block(x0, n, make, args.steps, sync, clock)[:3])
            ext.reset()
            totals[name].append((got - plain) / n)
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    print(f"\n{n} saved tensors of {args.bytes} B, CPU, 1 thread, thread clock, medians of "
          f"{args.rounds} alternating rounds of {args.steps} steps (µs per saved tensor, "
          f"forward + backward + step end; plain: absolute, others: above plain)\n")
    print("| path | median | rounds |")
    print("|---|---|---|")
    for name, values in totals.items():
        rounds = " ".join(f"{v * 1e6:.2f}" for v in values)
        print(f"| {name} | {statistics.median(values) * 1e6:.2f} | {rounds} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
