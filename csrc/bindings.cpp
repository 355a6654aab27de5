// Module `offload._C`: error translation, CUDA entry points, and the arena/store classes
// (bind_arena.cpp, bind_store.cpp). Loaded from Python only through offload/_ext.py.
#include "bindings.hpp"

#include <pybind11/stl.h>

#include "crc32c.hpp"
#include "cuda_copy.hpp"
#include "error.hpp"
#include "host_arena.hpp"

namespace py = pybind11;

namespace offload::bind {

uint64_t non_negative(int64_t value, const char* name) {
  if (value < 0)
    throw InvalidArgument(std::string(name) + " must be >= 0, got " + std::to_string(value));
  return static_cast<uint64_t>(value);
}

void set_used_after_close(const char* message) {
  try {
    py::object cls = py::module_::import("offload.errors").attr("UsedAfterCloseError");
    PyErr_SetObject(cls.ptr(), py::str(message).ptr());
  } catch (py::error_already_set&) {
    PyErr_SetString(PyExc_RuntimeError, message);
  }
}

void emit_log_notes(const std::vector<LogNote>& notes) {
  if (notes.empty()) return;
  py::object logger = py::module_::import("logging").attr("getLogger")("offload");
  for (const auto& note : notes) logger.attr("log")(note.level, note.message);
}

namespace {

py::object optional_int(int64_t v) { return v >= 0 ? py::object(py::int_(v)) : py::object(py::none()); }

// IoError -> offload.errors.StorageError(errno, message, filename, offset, nbytes), so
// Python code can catch OSError and branch on errno (ENOSPC stays ENOSPC).
void raise_storage_error(const IoError& e) {
  try {
    py::object cls = py::module_::import("offload.errors").attr("StorageError");
    py::object path = e.path().empty() ? py::object(py::none()) : py::object(py::str(e.path()));
    py::object exc = cls(e.err(), e.message(), path, optional_int(e.offset()), optional_int(e.nbytes()));
    PyErr_SetObject(cls.ptr(), exc.ptr());
  } catch (py::error_already_set&) {
    // offload.errors itself is broken: still keep errno through a plain OSError.
    py::object exc = py::reinterpret_steal<py::object>(
        PyObject_CallFunction(PyExc_OSError, "is", e.err(), e.what()));
    PyErr_SetObject(PyExc_OSError, exc.ptr());
  }
}

// Sets the Python error for one of the core's own exception types; false for any other.
bool set_core_error(std::exception_ptr p) {
  try {
    std::rethrow_exception(p);
  } catch (const IoError& e) {
    raise_storage_error(e);
  } catch (const InvalidArgument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const UseAfterClose& e) {
    set_used_after_close(e.what());
  } catch (...) {
    return false;
  }
  return true;
}

// pybind11's translator: the core's types here, any other to pybind11's own translation.
void translate(std::exception_ptr p) {
  if (p && !set_core_error(p)) std::rethrow_exception(p);
}

}  // namespace

void set_python_error(std::exception_ptr error) {
  if (set_core_error(error)) return;
  try {
    std::rethrow_exception(error);
  } catch (py::error_already_set& e) {
    // restore() without its run-once flag: an error kept to be raised again (a failed
    // write's, nvme_writes.cpp NOTE [A failed write stays failed]) is set each time it is
    // raised, with the traceback it was caught with.
    PyErr_Restore(e.type().inc_ref().ptr(), e.value().inc_ref().ptr(), e.trace().inc_ref().ptr());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "offload: unknown C++ exception");
  }
}

namespace {

void copy(bool d2h, uintptr_t dst, uintptr_t src, int64_t nbytes, uintptr_t stream, uintptr_t event) {
  const uint64_t n = non_negative(nbytes, "nbytes");
  py::gil_scoped_release nogil;  // cudaMemcpyAsync may block on pageable memory
  if (d2h)
    cuda::copy_d2h(dst, src, n, stream, event);
  else
    cuda::copy_h2d(dst, src, n, stream, event);
}

// The CRC runs over one flat byte range, so strided views (a transposed tensor, a
// sliced array with a step) would be read wrongly or past their end.
void require_c_contiguous(const py::buffer_info& info) {
  py::ssize_t expected = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] != 1 && info.strides[d] != expected) {
      std::string shape, strides;
      for (py::ssize_t i = 0; i < info.ndim; ++i) {
        shape += (i ? ", " : "") + std::to_string(info.shape[i]);
        strides += (i ? ", " : "") + std::to_string(info.strides[i]);
      }
      throw InvalidArgument("crc32c: data must be C-contiguous, got shape (" + shape +
                            ") with strides (" + strides +
                            ") bytes; pass a contiguous copy (tensor.contiguous(), "
                            "numpy.ascontiguousarray(data))");
    }
    expected *= info.shape[d];
  }
}

uint32_t crc_of(const py::buffer& data, uint32_t crc, bool portable) {
  py::buffer_info info = data.request();
  require_c_contiguous(info);
  const size_t n = static_cast<size_t>(info.size * info.itemsize);
  py::gil_scoped_release nogil;
  return portable ? crc32c_portable(info.ptr, n, crc) : crc32c(info.ptr, n, crc);
}

}  // namespace
}  // namespace offload::bind

PYBIND11_MODULE(_C, m) {
  using namespace offload;
  m.doc() = "offload's compiled core: host arena, NVMe store, CUDA copy engine, small saves";
  py::register_exception_translator(&bind::translate);

  m.attr("__version__") = OFFLOAD_VERSION;
  m.attr("cuda_compiled") = cuda::compiled();
  // "cuda-dlopen": CUDA paths compiled in, calling the runtime torch loaded (cudart.hpp);
  // "cpu": built with OFFLOAD_WITH_CUDA=OFF.
  m.attr("build_flavour") = cuda::compiled() ? "cuda-dlopen" : "cpu";
  m.attr("DEFAULT_ALIGNMENT") = kDefaultAlignment;
  m.def("cuda_usable", &cuda::usable,
        "True when a CUDA runtime is loaded (torch's), the driver accepts it and a device is "
        "present; never raises.");
  m.def("cuda_runtime", []() -> py::object {
          const cuda::RuntimeInfo info = cuda::runtime_info();
          if (info.path.empty()) return py::none();
          py::dict d;
          d["path"] = info.path;
          d["runtime_version"] = info.runtime_version;
          d["driver_version"] = info.driver_version;
          return d;
        },
        "The CUDA runtime the copy paths call ({path, runtime_version, driver_version}), or "
        "None when no runtime is loaded in the process (or the build is CPU-only).");
  m.def("cuda_unusable_reason", &cuda::unusable_reason,
        "Why cuda_usable() is False ('' when it is True).");

  m.def("copy_d2h", [](uintptr_t dst, uintptr_t src, int64_t nbytes, uintptr_t stream,
                       uintptr_t event) { bind::copy(true, dst, src, nbytes, stream, event); },
        py::arg("dst_ptr"), py::arg("src_ptr"), py::arg("nbytes"), py::arg("stream"),
        py::arg("event"),
        "cudaMemcpyAsync device->host on `stream`, then record `event` on it (0: none).");
  m.def("copy_h2d", [](uintptr_t dst, uintptr_t src, int64_t nbytes, uintptr_t stream,
                       uintptr_t event) { bind::copy(false, dst, src, nbytes, stream, event); },
        py::arg("dst_ptr"), py::arg("src_ptr"), py::arg("nbytes"), py::arg("stream"),
        py::arg("event"),
        "cudaMemcpyAsync host->device on `stream`, then record `event` on it (0: none).");

  m.def("crc32c", [](const py::buffer& data, uint32_t crc) { return bind::crc_of(data, crc, false); },
        py::arg("data"), py::arg("crc") = 0, "CRC-32C of a C-contiguous bytes-like object (extends `crc`); ValueError otherwise.");
  m.def("_crc32c_portable",
        [](const py::buffer& data, uint32_t crc) { return bind::crc_of(data, crc, true); },
        py::arg("data"), py::arg("crc") = 0, "Table-driven CRC-32C (test cross-check).");
  m.attr("crc32c_backend") = crc32c_backend();

  bind::bind_arena(m);
  bind::bind_store(m);
  bind::bind_saved_handles(m);
  bind::bind_hook_front(m);
  bind::bind_hook_unpacker(m);
  bind::bind_moved_save(m);
  bind::bind_prefetcher(m);
  bind::bind_saved_record(m);
  bind::bind_storage_index(m);
  bind::bind_timeline(m);
  bind::bind_storage_ref(m);
  bind::bind_nvme_payload(m);
  bind::bind_nvme_transfers(m);
}
