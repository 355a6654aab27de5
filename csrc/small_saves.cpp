// The saved-tensor hooks' path for a tensor that stays (below OFFLOAD_MIN_BYTES), in C:
// Python classes SavedBytes, SmallSave, SmallPacker and SmallUnpacker.
//
// Why C (offload/runtime/hooks.py NOTE [Small saves]): every saved tensor below the size
// threshold takes this path, and in Python it cost ~4x the simplest hook, half of it in the
// garbage collector walking the one Python object per save that holds the tensor. A
// SmallSave is not tracked by the collector (pybind11 instances without a __dict__ are not),
// which is safe: it refers only to a tensor (an output is held as a detached alias, as
// autograd holds it, so no cycle runs through autograd's graph) and to None or a string.
//
// Still torch-independent: the tensor is only touched through Python attribute lookups
// (`_version`, `grad_fn`, `untyped_storage()`...), exactly what the Python path reads, so
// one build works with every torch version. Everything here runs with the GIL held (the
// hooks are called with it, and a SmallSave is freed by Python's deallocation), so the
// counters need no lock of their own.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "bindings.hpp"

namespace py = pybind11;

namespace offload::bind {

namespace {

// Attribute names, interned once at import (the module holds them for the process).
struct Names {
  PyObject* layout;
  PyObject* untyped_storage;
  PyObject* nbytes;
  PyObject* grad_fn;
  PyObject* base;
  PyObject* is_leaf;
  PyObject* version;
  PyObject* detach;
  PyObject* sequence_nr;
  PyObject* output_nr;
  PyObject* name;
};
Names names;

py::object attr(PyObject* obj, PyObject* name) {
  PyObject* value = PyObject_GetAttr(obj, name);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

py::object call_method(PyObject* obj, PyObject* name) {
  PyObject* value = PyObject_CallMethodNoArgs(obj, name);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

py::object call(PyObject* fn) {
  PyObject* value = PyObject_CallNoArgs(fn);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

// fn(args...) through vectorcall: no argument tuple (the hand-offs run once per save).
template <typename... Args>
py::object call_with(const py::object& fn, const Args&... args) {
  PyObject* argv[] = {py::handle(args).ptr()...};
  PyObject* value = PyObject_Vectorcall(fn.ptr(), argv, sizeof...(Args), nullptr);
  if (value == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(value);
}

// Whether torch's profiler runs (`profiling` is torch._C._autograd._profiler_enabled): then
// both hooks take the Python path, which records the `offload::pack` / `unpack` ranges.
bool profiler_on(const py::object& profiling) {
  return call(profiling.ptr()).ptr() == Py_True;
}

int64_t as_int(const py::object& value) {
  const long long v = PyLong_AsLongLong(value.ptr());
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

// Bytes of saved activations resident on the device during one step, and its peak: the
// step's records add and take theirs (records.py, Ledger), small saves theirs here. Small
// storages are counted once while any save of them lives, keyed by the address of the
// storage's Python object: torch keeps that object for as long as the storage lives, and a
// live save holds the storage, so a key is never reused while its entry exists.
class SavedBytes {
 public:
  void add(int64_t nbytes) {
    resident_ += nbytes;
    if (resident_ > peak_) peak_ = resident_;
  }
  void sub(int64_t nbytes) { resident_ -= nbytes; }

  void small_saved(uintptr_t key, int64_t nbytes) {
    auto [it, fresh] = small_.try_emplace(key, Small{0, nbytes});
    if (it->second.saves++ == 0) {
      ++new_storages_;
      new_bytes_ += nbytes;
      add(nbytes);
    }
  }
  void small_freed(uintptr_t key) {
    auto it = small_.find(key);
    if (it == small_.end()) return;
    if (--it->second.saves == 0) {
      sub(it->second.nbytes);
      small_.erase(it);
    }
  }

  void packed() { ++packed_; }

  // (saves the C path packed, storages first saved, their bytes) since the last call: the
  // step folds them into its Stats.
  py::tuple take_small() {
    py::tuple out = py::make_tuple(packed_, new_storages_, new_bytes_);
    packed_ = new_storages_ = new_bytes_ = 0;
    return out;
  }

  int64_t resident() const { return resident_; }
  int64_t peak() const { return peak_; }
  size_t small_storages_alive() const { return small_.size(); }

 private:
  struct Small {
    int64_t saves;
    int64_t nbytes;
  };
  int64_t resident_ = 0;
  int64_t peak_ = 0;
  int64_t packed_ = 0;
  int64_t new_storages_ = 0;
  int64_t new_bytes_ = 0;
  std::unordered_map<uintptr_t, Small> small_;
};

// What autograd holds for a saved tensor below OFFLOAD_MIN_BYTES: the tensor (or, for an
// output of the node saving it, a detached alias sharing its version counter) and what
// autograd's "modified by an inplace operation" message needs (version_check.py).
struct SmallSave {
  py::object tensor;
  int64_t version = 0;
  py::object node_name;   // the saving node's name for an output; None for an input
  int64_t output_nr = 0;
  uintptr_t key = 0;
  std::shared_ptr<SavedBytes> meter;

  // No meter: made, but an error came before it was counted (the packer sets the meter
  // right before counting it).
  ~SmallSave() {
    if (meter) meter->small_freed(key);
  }

  // The tensor, or None when it changed in place since pack (the caller raises).
  py::object tensor_if_unchanged() const {
    return as_int(attr(tensor.ptr(), names.version)) == version ? tensor : py::none();
  }
};

// SmallSave's Python type (registered at import; the module keeps it for the process).
PyTypeObject* small_save_type() {
  static PyTypeObject* type =
      reinterpret_cast<PyTypeObject*>(py::type::of<SmallSave>().ptr());
  return type;
}

// The pack hook: the small-save path here; a plain strided tensor that is not a small save
// goes on to `strided(owner, tensor, version, storage, nbytes, node)` with what was read
// here (hooks.py's `_pack_strided`), anything else to `full(owner, tensor)` (`pack_full`).
class SmallPacker {
 public:
  SmallPacker(py::object owner_ref, py::object full, py::object strided_pack,
              std::shared_ptr<SavedBytes> meter, int64_t min_bytes, py::object tensor_type,
              py::object strided, py::object profiling, py::object next_sequence_nr)
      : owner_ref_(std::move(owner_ref)), full_(std::move(full)),
        strided_pack_(std::move(strided_pack)), meter_(std::move(meter)),
        min_bytes_(min_bytes), tensor_type_(std::move(tensor_type)),
        strided_(std::move(strided)), profiling_(std::move(profiling)),
        next_sequence_nr_(std::move(next_sequence_nr)) {}

  py::object operator()(py::handle t_handle) const {
    PyObject* t = t_handle.ptr();
    // The same tests, in the same order, as hooks.py's `_pack` step 1.
    if (reinterpret_cast<PyObject*>(Py_TYPE(t)) != tensor_type_.ptr() ||
        profiler_on(profiling_) || attr(t, names.layout).ptr() != strided_.ptr())
      return call_with(full_, owner(), t_handle);
    py::object storage = call_method(t, names.untyped_storage);
    py::object nbytes_obj = call_method(storage.ptr(), names.nbytes);
    const int64_t nbytes = as_int(nbytes_obj);
    py::object node = attr(t, names.grad_fn);
    py::object version = attr(t, names.version);
    // A leaf (no grad_fn) or a view of one may be a weight: step 2 tells.
    bool small = nbytes < min_bytes_ && !node.is_none();
    if (small) {
      py::object base = attr(t, names.base);
      small = base.is_none() || attr(base.ptr(), names.is_leaf).ptr() != Py_True;
    }
    if (!small)
      return call_with(strided_pack_, owner(), t_handle, version, storage, nbytes_obj, node);
    auto save = std::make_unique<SmallSave>();
    save->version = as_int(version);
    // Saved by its own node (an output): that node was made last, so its sequence number
    // is the one just before the thread's next (version_check.py).
    const bool is_output = !next_sequence_nr_.is_none() &&
        as_int(call_method(node.ptr(), names.sequence_nr)) ==
            as_int(call(next_sequence_nr_.ptr())) - 1;
    if (is_output) {
      save->tensor = call_method(t, names.detach);  // breaks the tensor -> node -> save cycle
      save->node_name = attr(reinterpret_cast<PyObject*>(Py_TYPE(node.ptr())), names.name);
      save->output_nr = as_int(attr(t, names.output_nr));
    } else {
      save->tensor = py::reinterpret_borrow<py::object>(t_handle);  // as autograd holds it
      save->node_name = py::none();
      save->output_nr = 0;
    }
    save->key = reinterpret_cast<uintptr_t>(storage.ptr());
    save->meter = meter_;
    meter_->small_saved(save->key, nbytes);
    meter_->packed();
    return py::cast(std::move(save));
  }

  // The hooks object whose pack this is (hook_stack.py finds its owner through __self__),
  // None once it is gone.
  py::object owner_or_none() const { return owner_ref_(); }

 private:
  // The hooks hold this packer (its identity marks their entry on torch's hook stack), so
  // it holds them weakly: neither object is tracked by the garbage collector, and a cycle
  // between them would never be freed.
  py::object owner() const {
    py::object owner = owner_ref_();
    if (owner.is_none()) {
      PyErr_SetString(PyExc_RuntimeError,
                      "offload: a saved-tensor pack hook was called after its "
                      "offload.activations() context was freed");
      throw py::error_already_set();
    }
    return owner;
  }

  py::object owner_ref_, full_, strided_pack_;
  std::shared_ptr<SavedBytes> meter_;
  int64_t min_bytes_;
  py::object tensor_type_, strided_, profiling_, next_sequence_nr_;
};

// The unpack hook: a SmallSave here (version checked), everything else to `slow` (hooks.py's
// unpack, a bound method: autograd holds this object with every save, and the saves keep
// the hooks alive through it, as they would hold the bound method itself).
class SmallUnpacker {
 public:
  SmallUnpacker(py::object slow, py::object error, py::object profiling)
      : slow_(std::move(slow)), error_(std::move(error)), profiling_(std::move(profiling)) {}

  py::object operator()(py::handle packed) const {
    if (Py_TYPE(packed.ptr()) != small_save_type() || profiler_on(profiling_))
      return call_with(slow_, packed);
    py::object tensor = packed.cast<const SmallSave&>().tensor_if_unchanged();
    if (tensor.is_none()) {
      // autograd's own message, made in Python (records.small_save_error).
      py::object exc = error_(packed);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
      throw py::error_already_set();
    }
    return tensor;
  }

  py::object slow() const { return slow_; }

 private:
  py::object slow_, error_, profiling_;
};

PyObject* intern(const char* s) {
  PyObject* name = PyUnicode_InternFromString(s);
  if (name == nullptr) throw py::error_already_set();
  return name;
}

}  // namespace

void bind_small_saves(py::module_& m) {
  names = Names{intern("layout"),   intern("untyped_storage"), intern("nbytes"),
                intern("grad_fn"),  intern("_base"),           intern("is_leaf"),
                intern("_version"), intern("detach"),          intern("_sequence_nr"),
                intern("output_nr"), intern("__name__")};

  py::class_<SavedBytes, std::shared_ptr<SavedBytes>>(
      m, "SavedBytes",
      "Bytes of saved activations resident on the device in one step (current and peak), "
      "and the small saves' storages counted once while any save of them lives (saves of "
      "either path).")
      .def(py::init<>())
      .def("add", &SavedBytes::add, py::arg("nbytes"))
      .def("sub", &SavedBytes::sub, py::arg("nbytes"))
      .def("small_saved", &SavedBytes::small_saved, py::arg("key"), py::arg("nbytes"),
           "A small storage saved (again) by the Python path: counted once while any save "
           "of it lives, with the C path's saves of it.")
      .def("small_freed", &SavedBytes::small_freed, py::arg("key"))
      .def("take_small", &SavedBytes::take_small,
           "(saves packed, storages first saved, their bytes) since the last call.")
      .def_property_readonly("resident", &SavedBytes::resident)
      .def_property_readonly("peak", &SavedBytes::peak)
      .def_property_readonly("small_storages_alive", &SavedBytes::small_storages_alive);

  py::class_<SmallSave>(m, "SmallSave",
                        "What autograd holds for a saved tensor that stays (hooks.py).")
      .def("tensor_if_unchanged", &SmallSave::tensor_if_unchanged,
           "The tensor, or None when it changed in place since it was saved.")
      .def_readonly("tensor", &SmallSave::tensor)
      .def_readonly("version", &SmallSave::version)
      .def_readonly("node_name", &SmallSave::node_name)
      .def_readonly("output_nr", &SmallSave::output_nr);

  py::class_<SmallPacker>(m, "SmallPacker", "The pack hook's small-save path (hooks.py).")
      .def(py::init<py::object, py::object, py::object, std::shared_ptr<SavedBytes>, int64_t,
                    py::object, py::object, py::object, py::object>(),
           py::arg("owner_ref"), py::arg("full"), py::arg("strided_pack"), py::arg("meter"),
           py::arg("min_bytes"), py::arg("tensor_type"), py::arg("strided"),
           py::arg("profiling"), py::arg("next_sequence_nr"))
      .def("__call__", &SmallPacker::operator(), py::arg("tensor"))
      .def_property_readonly("__self__", &SmallPacker::owner_or_none);

  py::class_<SmallUnpacker>(m, "SmallUnpacker", "The unpack hook's small-save path (hooks.py).")
      .def(py::init<py::object, py::object, py::object>(), py::arg("slow"), py::arg("error"),
           py::arg("profiling"))
      .def("__call__", &SmallUnpacker::operator(), py::arg("packed"))
      .def_property_readonly("slow", &SmallUnpacker::slow);
}

}  // namespace offload::bind
