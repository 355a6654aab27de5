// Python classes HostArena and HostBlock.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "error.hpp"
#include "host_arena.hpp"

namespace py = pybind11;

namespace offload::bind {

namespace {

// Buffer export: a writable 1-D byte view of the block. No release hook is needed: the
// view holds the HostBlock object, and an exported block defers release() to its garbage
// collection (see HostBlock), so the memory outlives every view.
int host_block_getbuffer(PyObject* obj, Py_buffer* view, int flags) {
  HostBlock* block = nullptr;
  try {
    block = py::cast<HostBlock*>(py::handle(obj));
  } catch (...) {
    PyErr_SetString(PyExc_TypeError, "not a HostBlock");
    view->obj = nullptr;
    return -1;
  }
  if (block->released()) {
    set_used_after_close("HostBlock was released; its memory is no longer usable");
    view->obj = nullptr;
    return -1;
  }
  block->mark_exported();
  return PyBuffer_FillInfo(view, obj, block->region()->data(),
                           static_cast<Py_ssize_t>(block->nbytes()), /*readonly=*/0, flags);
}

RangeStats stats(const HostArena& a) { return a.stats(); }

double fragmentation(const RangeStats& s) {
  if (s.free_bytes == 0) return 0.0;
  return 1.0 - double(s.largest_free_bytes) / double(s.free_bytes);
}

}  // namespace

void bind_arena(py::module_& m) {
  py::class_<HostArena, std::shared_ptr<HostArena>>(
      m, "HostArena",
      "One large 4096-aligned host allocation (pinned when a GPU is usable), sub-allocated.")
      .def(py::init([](int64_t capacity_bytes, std::optional<bool> pinned) {
             const uint64_t cap = non_negative(capacity_bytes, "HostArena: capacity_bytes");
             py::gil_scoped_release nogil;  // cudaHostAlloc of gigabytes takes a while
             return HostArena::create(cap, pinned);
           }),
           py::arg("capacity_bytes"), py::arg("pinned") = py::none())
      .def(
          "allocate",
          [](HostArena& a, int64_t nbytes) -> std::shared_ptr<HostBlock> {
            const uint64_t n = non_negative(nbytes, "HostArena.allocate: nbytes");
            auto region = a.allocate(n);
            if (!region) return nullptr;
            return std::make_shared<HostBlock>(std::move(region), n);
          },
          py::arg("nbytes"),
          "A block of `nbytes` (4096-aligned, padded to 4096 inside), or None when no "
          "contiguous range is free.")
      .def_property_readonly("capacity_bytes", [](const HostArena& a) { return stats(a).capacity_bytes; })
      .def_property_readonly("used_bytes", [](const HostArena& a) { return stats(a).used_bytes; })
      .def_property_readonly("peak_bytes", [](const HostArena& a) { return stats(a).peak_bytes; })
      .def_property_readonly("free_bytes", [](const HostArena& a) { return stats(a).free_bytes; })
      .def_property_readonly("largest_free_bytes",
                             [](const HostArena& a) { return stats(a).largest_free_bytes; })
      .def_property_readonly("fragmentation",
                             [](const HostArena& a) { return fragmentation(stats(a)); },
                             "1 - largest_free_bytes / free_bytes (0 when nothing is free).")
      .def_property_readonly("pinned", &HostArena::pinned)
      .def_property_readonly("base_ptr", [](const HostArena& a) { return reinterpret_cast<uintptr_t>(a.base()); })
      .def("reset_peak", &HostArena::reset_peak)
      .def("__repr__", [](const HostArena& a) {
        const RangeStats s = stats(a);
        return "<HostArena capacity_bytes=" + std::to_string(s.capacity_bytes) +
               " used_bytes=" + std::to_string(s.used_bytes) +
               " pinned=" + (a.pinned() ? "True" : "False") + ">";
      });

  py::class_<HostBlock, std::shared_ptr<HostBlock>> block(
      m, "HostBlock", py::buffer_protocol(),
      "A sub-allocation of a HostArena. Supports the buffer protocol, so "
      "torch.frombuffer(block, dtype=torch.uint8) is a zero-copy view that keeps it alive.");
  block.def_property_readonly("ptr", &HostBlock::ptr)
      .def_property_readonly("nbytes", &HostBlock::nbytes)
      .def_property_readonly("released", &HostBlock::released)
      .def("release", &HostBlock::release,
           "Give the memory back (idempotent). In-flight I/O keeps it until done; once the "
           "buffer was exported (torch.frombuffer, memoryview) it returns when the block "
           "object is garbage collected.")
      .def("__len__", [](const HostBlock& b) { return b.nbytes(); })
      .def("__repr__", [](const HostBlock& b) {
        if (b.released()) return std::string("<HostBlock released>");
        return "<HostBlock ptr=" + std::to_string(b.ptr()) + " nbytes=" + std::to_string(b.nbytes()) + ">";
      });
  auto* type = reinterpret_cast<PyTypeObject*>(block.ptr());
  type->tp_as_buffer->bf_getbuffer = host_block_getbuffer;
  type->tp_as_buffer->bf_releasebuffer = nullptr;
}

}  // namespace offload::bind
