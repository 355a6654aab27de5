// Python classes NvmeStore, Extent and IoFuture.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <memory>
#include <optional>

#include "bindings.hpp"
#include "error.hpp"
#include "io_request.hpp"
#include "nvme_store.hpp"

namespace py = pybind11;

namespace offload::bind {

namespace {

// Accepts a list of str / os.PathLike (or a single one) for `dirs`.
std::vector<std::string> to_dirs(const py::object& dirs) {
  py::module_ os = py::module_::import("os");
  std::vector<std::string> out;
  if (py::isinstance<py::str>(dirs) || py::hasattr(dirs, "__fspath__")) {
    out.push_back(py::str(os.attr("fspath")(dirs)));
    return out;
  }
  for (py::handle d : dirs) out.push_back(py::str(os.attr("fspath")(d)));
  return out;
}

uint64_t wait_request(IoRequest& r, std::optional<double> timeout_s) {
  if (timeout_s && std::isnan(*timeout_s))
    throw InvalidArgument("IoFuture.wait: timeout_s is NaN; give seconds, or None to wait until "
                          "the transfer is done");
  if (timeout_s && *timeout_s < 0) timeout_s = 0.0;
  // A request already seen done (the tier polls before it retires) returns at once:
  // handing the GIL over and back costs more than the rest of the call.
  bool finished = r.done();
  if (!finished) {
    py::gil_scoped_release nogil;
    finished = r.wait(timeout_s);
  }
  if (!finished) {
    PyErr_SetString(PyExc_TimeoutError,
                    ("I/O request of " + std::to_string(r.nbytes()) + " bytes not finished after " +
                     std::to_string(*timeout_s) + " s").c_str());
    throw py::error_already_set();
  }
  return r.result();
}

// The last Python reference to a store may go away in garbage collection; its destructor
// waits for in-flight I/O, so let other Python threads run meanwhile. (Workers never take
// the GIL, so holding it would not deadlock, only stall.)
void delete_store(NvmeStore* store) {
#if PY_VERSION_HEX >= 0x030D0000
  const bool finalizing = Py_IsFinalizing();
#else
  const bool finalizing = _Py_IsFinalizing();
#endif
  if (!finalizing && PyGILState_Check()) {
    py::gil_scoped_release nogil;
    delete store;
  } else {
    delete store;
  }
}

// Submissions keep the GIL: they only enqueue (microseconds), and holding it makes reading
// the Extent/HostBlock handles safe against a concurrent release() from another thread.
template <typename Fn>
std::shared_ptr<IoRequest> submit(Fn&& fn) {
  return fn();
}

}  // namespace

void bind_store(py::module_& m) {
  py::class_<IoRequest, std::shared_ptr<IoRequest>>(m, "IoFuture",
                                                    "Handle of an asynchronous NVMe transfer.")
      .def("wait", &wait_request, py::arg("timeout_s") = py::none(),
           "Block (GIL released, unless it is done already) until done; return the bytes "
           "moved. Raises StorageError for a failed transfer, TimeoutError when timeout_s "
           "passes first.")
      .def("done", &IoRequest::done)
      .def_property_readonly("nbytes", &IoRequest::nbytes)
      .def_property_readonly("end_s", &IoRequest::end_s,
                             "When it finished, on time.perf_counter()'s clock; None until done.")
      .def("__repr__", [](const IoRequest& r) {
        return "<IoFuture nbytes=" + std::to_string(r.nbytes()) + (r.done() ? " done>" : " pending>");
      });

  py::class_<Extent, std::shared_ptr<Extent>>(m, "Extent", "A range of an NvmeStore's slab space.")
      .def_property_readonly("nbytes", &Extent::nbytes)
      .def_property_readonly("released", &Extent::released)
      .def_property_readonly("offset", [](const Extent& e) { return e.range()->offset(); },
                             "Logical offset in the striped slab space.")
      .def("release", &Extent::release, "Give the range back (idempotent; in-flight I/O keeps it until done).")
      .def("__repr__", [](const Extent& e) {
        return "<Extent nbytes=" + std::to_string(e.nbytes()) + (e.released() ? " released>" : ">");
      });

  using Store = NvmeStore;
  const StoreOptions defaults;   // the keyword arguments' defaults are the options' own
  py::class_<Store, std::shared_ptr<Store>>(
      m, "NvmeStore",
      "Private preallocated slab files (one per directory, striped), O_DIRECT, async I/O.")
      .def(py::init([](const py::object& dirs, int64_t capacity_bytes, int64_t workers,
                       int64_t chunk_bytes, int64_t max_inflight_bytes, bool checksum,
                       int64_t throttle_bytes_per_s, bool direct, int64_t coalesce_bytes) {
             StoreOptions o;
             o.workers = non_negative(workers, "NvmeStore: workers");
             o.chunk_bytes = non_negative(chunk_bytes, "NvmeStore: chunk_bytes");
             o.max_inflight_bytes = non_negative(max_inflight_bytes, "NvmeStore: max_inflight_bytes");
             o.checksum = checksum;
             o.throttle_bytes_per_s = non_negative(throttle_bytes_per_s, "NvmeStore: throttle_bytes_per_s");
             o.direct = direct;
             o.coalesce_bytes = non_negative(coalesce_bytes, "NvmeStore: coalesce_bytes");
             const uint64_t cap = non_negative(capacity_bytes, "NvmeStore: capacity_bytes");
             std::vector<std::string> paths = to_dirs(dirs);
             std::vector<LogNote> notes;
             std::shared_ptr<Store> store;
             {
               py::gil_scoped_release nogil;  // fallocate of a large slab can take a while
               store = std::shared_ptr<Store>(new Store(paths, cap, o, &notes), &delete_store);
             }
             emit_log_notes(notes);
             return store;
           }),
           py::arg("dirs"), py::arg("capacity_bytes"), py::kw_only(),
           py::arg("workers") = defaults.workers, py::arg("chunk_bytes") = defaults.chunk_bytes,
           py::arg("max_inflight_bytes") = defaults.max_inflight_bytes,
           py::arg("checksum") = defaults.checksum,
           py::arg("throttle_bytes_per_s") = defaults.throttle_bytes_per_s,
           py::arg("direct") = defaults.direct, py::arg("coalesce_bytes") = defaults.coalesce_bytes)
      .def(
          "allocate",
          [](Store& s, int64_t nbytes, int64_t phase) -> std::shared_ptr<Extent> {
            auto range = s.allocate(non_negative(nbytes, "NvmeStore.allocate: nbytes"),
                                    non_negative(phase, "NvmeStore.allocate: phase"));
            if (!range) return nullptr;
            return std::make_shared<Extent>(std::move(range));
          },
          py::arg("nbytes"), py::arg("phase") = 0,
          "An extent of `nbytes`, or None when no contiguous range is free. With `phase` "
          "(below `alignment`) the data starts that far past an aligned offset: memory whose "
          "address % alignment equals it is written and read in place (no bounce copy).")
      .def("write", [](Store& s, const Extent& e, const HostBlock& b) {
             return submit([&] { return s.write(e, b); });
           }, py::arg("extent"), py::arg("block"))
      .def("read", [](Store& s, const Extent& e, const HostBlock& b) {
             return submit([&] { return s.read(e, b); });
           }, py::arg("extent"), py::arg("block"))
      .def("write_ptr", [](Store& s, const Extent& e, uintptr_t ptr, int64_t nbytes) {
             const uint64_t n = non_negative(nbytes, "write_ptr: nbytes");
             return submit([&] { return s.write_ptr(e, ptr, n); });
           }, py::arg("extent"), py::arg("ptr"), py::arg("nbytes"))
      .def("write_ptr_many", [](Store& s, const std::vector<std::shared_ptr<Extent>>& extents,
                                const std::vector<uintptr_t>& ptrs,
                                const std::vector<int64_t>& nbytes) {
             std::vector<const Extent*> e;
             e.reserve(extents.size());
             for (const auto& x : extents) {
               if (!x) throw InvalidArgument("write_ptr_many: an extent is None");
               e.push_back(x.get());
             }
             std::vector<uint64_t> n;
             n.reserve(nbytes.size());
             for (int64_t v : nbytes) n.push_back(non_negative(v, "write_ptr_many: nbytes"));
             return s.write_ptr_many(e, ptrs, n);
           }, py::arg("extents"), py::arg("ptrs"), py::arg("nbytes"),
           "Several write_ptr in one hand-off to the engine; their IoFutures, in order.")
      .def("read_ptr", [](Store& s, const Extent& e, uintptr_t ptr, int64_t nbytes) {
             const uint64_t n = non_negative(nbytes, "read_ptr: nbytes");
             return submit([&] { return s.read_ptr(e, ptr, n); });
           }, py::arg("extent"), py::arg("ptr"), py::arg("nbytes"))
      .def("write_after_event", [](Store& s, const Extent& e, const HostBlock& b, uintptr_t event) {
             return submit([&] { return s.write_after_event(e, b, event); });
           }, py::arg("extent"), py::arg("block"), py::arg("event"))
      .def("read_then_h2d", [](Store& s, const Extent& e, const HostBlock& b, uintptr_t dst_ptr,
                               int64_t nbytes, uintptr_t stream, uintptr_t event) {
             const uint64_t n = non_negative(nbytes, "read_then_h2d: nbytes");
             return submit([&] { return s.read_then_h2d(e, b, dst_ptr, n, stream, event); });
           }, py::arg("extent"), py::arg("block"), py::arg("dst_ptr"), py::arg("nbytes"),
           py::arg("stream"), py::arg("event"))
      .def("close", [](Store& s) {
             py::gil_scoped_release nogil;
             s.close();
           }, "Wait for in-flight I/O, stop the workers, close the slabs (idempotent).")
      .def("_abandon_after_fork", &Store::abandon_after_fork,
           "In a forked child only: close the inherited slab descriptors, never touch the "
           "parent's I/O threads; the store is closed afterwards.")
      .def("__enter__", [](const std::shared_ptr<Store>& s) { return s; })
      .def("__exit__", [](Store& s, const py::args&) {
        py::gil_scoped_release nogil;
        s.close();
      })
      .def("_corrupt_for_test", [](Store& s, const Extent& e, int64_t offset) {
             const uint64_t off = non_negative(offset, "offset");
             py::gil_scoped_release nogil;
             s.corrupt_for_test(e, off);
           }, py::arg("extent"), py::arg("offset"),
           "Test hook: flip one byte of the extent's data on disk.")
      .def("_hold_workers_for_test", &Store::hold_workers_for_test, py::arg("held"),
           "Test hook: while held, the I/O workers start nothing queued (close() releases).")
      .def_property_readonly("direct", &Store::direct)
      .def_property_readonly("alignment", &Store::alignment)
      .def_property_readonly("paths", &Store::paths)
      .def_property_readonly("closed", &Store::closed)
      .def_property_readonly("capacity_bytes", &Store::capacity_bytes,
                             "Bytes the slabs hold: the requested capacity rounded up to whole "
                             "stripes in every directory (slab_bytes * len(dirs)), so it can "
                             "exceed the capacity_bytes passed in.")
      .def_property_readonly("used_bytes", [](const Store& s) { return s.stats().used_bytes; })
      .def_property_readonly("free_bytes", [](const Store& s) { return s.stats().free_bytes; })
      .def_property_readonly("peak_bytes", [](const Store& s) { return s.stats().peak_bytes; })
      .def_property_readonly("largest_free_bytes", [](const Store& s) { return s.stats().largest_free_bytes; })
      .def_property_readonly("bytes_written", &Store::bytes_written)
      .def_property_readonly("bytes_read", &Store::bytes_read)
      .def_property_readonly("bytes_bounced", &Store::bytes_bounced,
                             "Payload bytes copied through bounce buffers (memory whose address "
                             "is out of phase with the extent, partial end sectors, small "
                             "neighbours moved as one transfer).")
      .def_property_readonly("transfers", &Store::transfers,
                             "Reads and writes issued to the slab files; small adjacent chunks "
                             "queued together move as one (coalesce_bytes).")
      .def_property_readonly("coalesce_bytes", [](const Store& s) { return s.options().coalesce_bytes; })
      .def_property_readonly("workers", [](const Store& s) { return s.options().workers; })
      .def_property_readonly("chunk_bytes", [](const Store& s) { return s.options().chunk_bytes; })
      .def_property_readonly("stripe_bytes", &Store::stripe_bytes)
      .def_property_readonly("max_inflight_bytes", [](const Store& s) { return s.options().max_inflight_bytes; })
      .def_property_readonly("checksum", [](const Store& s) { return s.options().checksum; })
      .def_property_readonly("throttle_bytes_per_s", [](const Store& s) { return s.options().throttle_bytes_per_s; })
      .def("__repr__", [](const Store& s) {
        std::string dirs;
        for (const auto& p : s.paths()) dirs += (dirs.empty() ? "'" : ", '") + p + "'";
        return "<NvmeStore dirs=[" + dirs + "] capacity_bytes=" + std::to_string(s.capacity_bytes()) +
               " direct=" + (s.direct() ? "True" : "False") + (s.closed() ? " closed>" : ">");
      });
}

}  // namespace offload::bind
