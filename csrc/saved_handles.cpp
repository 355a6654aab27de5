// The saved-tensor hooks' front in C: Python classes SavedBytes, SmallSave, KeptSave, Packer
// and Unpacker.
//
// Why C (offload/runtime/hooks.py NOTE [Handles in C]): every saved tensor passes through
// the hooks, and in Python the object each save keeps alive costs the garbage collector
// ~1-2 us (walked by every collection while the step holds it) besides its making. The
// handles made here (SmallSave: a tensor below OFFLOAD_MIN_BYTES; KeptSave: a tensor that
// stays with its storage's record) are not tracked by the collector (pybind11 instances
// without a __dict__ are not). That is safe because autograd alone holds a handle: any
// cycle through one runs through an autograd node, whose references to its saved handles
// the collector cannot see whatever the handle's type, so tracking the handle would not
// make such a cycle collectable. (An output is held as a detached alias, as autograd holds
// it, so no such cycle is made by the handle itself.)
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
#include "saved_record.hpp"

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
  PyObject* unpacked;
  PyObject* epoch;
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

// A saved tensor that stays where it is: the tensor (or, for an output of the node saving
// it, a detached alias sharing its version counter) and what autograd's "modified by an
// inplace operation" message needs (version_check.py, records.kept_version_error).
struct HeldTensor {
  py::object tensor;
  int64_t version = 0;
  py::object node_name;   // the saving node's name for an output; None for an input
  int64_t output_nr = 0;

  // The tensor, or None when it changed in place since pack (the caller raises).
  py::object tensor_if_unchanged() const {
    return as_int(attr(tensor.ptr(), names.version)) == version ? tensor : py::none();
  }
};

// What autograd holds for a saved tensor below OFFLOAD_MIN_BYTES: counted in the step's
// meter once per storage while any save of it lives.
struct SmallSave : HeldTensor {
  uintptr_t key = 0;
  std::shared_ptr<SavedBytes> meter;

  // No meter: made, but an error came before it was counted (the packer sets the meter
  // right before counting it).
  ~SmallSave() {
    if (meter) meter->small_freed(key);
  }
};

// What autograd holds for any other saved tensor that stays (a weight, a storage the
// placement kept, a CPU storage on the host tier): its storage's record (records.Record:
// dedup, timing, the tier's reference), None for a weight. The record lives as long as
// some save of it (records.py NOTE [Record lifetime]).
struct KeptSave : HeldTensor {
  py::object record;
};

// The handles' Python types (registered at import; the module keeps them for the process).
PyTypeObject* small_save_type() {
  static PyTypeObject* type =
      reinterpret_cast<PyTypeObject*>(py::type::of<SmallSave>().ptr());
  return type;
}

PyTypeObject* kept_save_type() {
  static PyTypeObject* type =
      reinterpret_cast<PyTypeObject*>(py::type::of<KeptSave>().ptr());
  return type;
}

// The pack hook. A small save is made here; a plain strided tensor that is not one goes on
// to `strided(owner, tensor, version, storage, nbytes, node)` with what was read here
// (hooks.py's `_pack_strided`), which returns the handle, or what this makes a KeptSave of:
// a Record (the tensor stays; its storage's record) or None (a weight that stays).
// Anything else goes to `full(owner, tensor)` (`pack_full`).
class Packer {
 public:
  Packer(py::object owner_ref, py::object full, py::object strided_pack,
         std::shared_ptr<SavedBytes> meter, int64_t min_bytes, py::object tensor_type,
         py::object strided, py::object profiling, py::object next_sequence_nr,
         py::object record_type)
      : owner_ref_(std::move(owner_ref)), full_(std::move(full)),
        strided_pack_(std::move(strided_pack)), meter_(std::move(meter)),
        min_bytes_(min_bytes), tensor_type_(std::move(tensor_type)),
        strided_(std::move(strided)), profiling_(std::move(profiling)),
        next_sequence_nr_(std::move(next_sequence_nr)), record_type_(std::move(record_type)) {}

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
    if (small) {
      auto save = std::make_unique<SmallSave>();
      hold(*save, t_handle, node, version);
      save->key = reinterpret_cast<uintptr_t>(storage.ptr());
      save->meter = meter_;
      meter_->small_saved(save->key, nbytes);
      meter_->packed();
      return py::cast(std::move(save));
    }
    py::object got =
        call_with(strided_pack_, owner(), t_handle, version, storage, nbytes_obj, node);
    if (!got.is_none() && Py_TYPE(got.ptr()) != record_type())
      return got;  // a finished handle (moved, or not a plain strided tensor)
    auto save = std::make_unique<KeptSave>();
    hold(*save, t_handle, node, version);
    save->record = std::move(got);
    return py::cast(std::move(save));
  }

  // The hooks object whose pack this is (hook_stack.py finds its owner through __self__),
  // None once it is gone.
  py::object owner_or_none() const { return owner_ref_(); }

 private:
  // What records.Kept holds, the same way: the tensor as autograd holds it, or for an
  // output of the saving node a detached alias (breaks the tensor -> node -> save cycle)
  // and that node's name. The saving node was made last, so its sequence number is the
  // one just before the thread's next (version_check.py).
  void hold(HeldTensor& save, py::handle t, const py::object& node,
            const py::object& version) const {
    save.version = as_int(version);
    const bool is_output = !node.is_none() && !next_sequence_nr_.is_none() &&
        as_int(call_method(node.ptr(), names.sequence_nr)) ==
            as_int(call(next_sequence_nr_.ptr())) - 1;
    if (is_output) {
      save.tensor = call_method(t.ptr(), names.detach);
      save.node_name = attr(reinterpret_cast<PyObject*>(Py_TYPE(node.ptr())), names.name);
      save.output_nr = as_int(attr(t.ptr(), names.output_nr));
    } else {
      save.tensor = py::reinterpret_borrow<py::object>(t);
      save.node_name = py::none();
      save.output_nr = 0;
    }
  }

  PyTypeObject* record_type() const {
    return reinterpret_cast<PyTypeObject*>(record_type_.ptr());
  }

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
  py::object tensor_type_, strided_, profiling_, next_sequence_nr_, record_type_;
};

// The unpack hook: a SmallSave or KeptSave here (version checked), everything else to
// `slow` (hooks.py's unpack). A KeptSave also marks the backward (`marks()`, the step's
// runtime.backward_marks.BackwardMarks, called again only when what it depends on may
// have changed: a new graph task, or a new `marks.epoch`) and notes its record's first
// unpack on the step's Timeline (hooks.py's `_kept_unpacked` does the same in Python). `slow`
// is a bound method: autograd holds this object with every save, and the saves keep the
// hooks alive through it, as they would hold the bound method itself.
struct UnpackerHooks {
  py::object slow;                // hooks.py's unpack
  py::object marks;               // the hooks' BackwardMarks
  py::object error;               // records.held_tensor_error
  py::object graph_task_id;       // torch._C._current_graph_task_id
  py::object perf_counter;        // time.perf_counter (the Timeline's clock)
  py::object profiling;           // torch._C._autograd._profiler_enabled
};

class Unpacker {
 public:
  Unpacker(py::object slow, py::object marks, py::object error, py::object graph_task_id,
           py::object perf_counter, py::object profiling)
      : hooks_{std::move(slow),          std::move(marks),        std::move(error),
               std::move(graph_task_id), std::move(perf_counter), std::move(profiling)} {}

  py::object operator()(py::handle packed) const {
    PyTypeObject* type = Py_TYPE(packed.ptr());
    const bool small = type == small_save_type();
    if ((!small && type != kept_save_type()) || profiler_on(hooks_.profiling))
      return call_with(hooks_.slow, packed);
    if (!small) kept_unpacked(packed.cast<const KeptSave&>().record);
    py::object tensor = packed.cast<const HeldTensor&>().tensor_if_unchanged();
    if (tensor.is_none()) {
      // autograd's own message, made in Python (records.held_tensor_error).
      py::object exc = hooks_.error(packed);
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
      throw py::error_already_set();
    }
    return tensor;
  }

  py::object slow() const { return hooks_.slow; }

 private:
  // `record`: the core's Record (the packer exists only with the core's meter, whose ledger
  // makes the core's records), or None for a weight.
  void kept_unpacked(const py::object& record) const {
    const int64_t task = as_int(call(hooks_.graph_task_id.ptr()));
    const int64_t epoch = as_int(attr(hooks_.marks.ptr(), names.epoch));
    if (!marked_ || task != last_task_ || epoch != last_epoch_) {
      call(hooks_.marks.ptr());
      marked_ = true;
      last_task_ = task;
      last_epoch_ = epoch;
    }
    Py_ssize_t row = 0;
    PyObject* timeline = record.is_none() ? nullptr : record_timeline(record.ptr(), &row);
    if (timeline != nullptr) {
      py::object now = call(hooks_.perf_counter.ptr());
      py::object index = py::reinterpret_steal<py::object>(PyLong_FromSsize_t(row));
      if (!index) throw py::error_already_set();
      PyObject* argv[] = {timeline, index.ptr(), now.ptr()};
      PyObject* done = PyObject_VectorcallMethod(names.unpacked, argv,
                                                 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr);
      if (done == nullptr) throw py::error_already_set();
      Py_DECREF(done);
    }
  }

  UnpackerHooks hooks_;
  mutable bool marked_ = false;     // the backward marks were set ...
  mutable int64_t last_task_ = 0;   // ... for this graph task
  mutable int64_t last_epoch_ = 0;  // ... and this epoch of the marks
};

PyObject* intern(const char* s) {
  PyObject* name = PyUnicode_InternFromString(s);
  if (name == nullptr) throw py::error_already_set();
  return name;
}

}  // namespace

void bind_saved_handles(py::module_& m) {
  names = Names{intern("layout"),    intern("untyped_storage"), intern("nbytes"),
                intern("grad_fn"),   intern("_base"),           intern("is_leaf"),
                intern("_version"),  intern("detach"),          intern("_sequence_nr"),
                intern("output_nr"), intern("__name__"),        intern("unpacked"),
                intern("epoch")};

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

  py::class_<HeldTensor>(m, "HeldTensor", "A saved tensor that stays (hooks.py).")
      .def("tensor_if_unchanged", &HeldTensor::tensor_if_unchanged,
           "The tensor, or None when it changed in place since it was saved.")
      .def_readonly("tensor", &HeldTensor::tensor)
      .def_readonly("version", &HeldTensor::version)
      .def_readonly("node_name", &HeldTensor::node_name)
      .def_readonly("output_nr", &HeldTensor::output_nr);

  py::class_<SmallSave, HeldTensor>(
      m, "SmallSave", "What autograd holds for a saved tensor below OFFLOAD_MIN_BYTES.");

  py::class_<KeptSave, HeldTensor>(
      m, "KeptSave", "What autograd holds for another saved tensor that stays (hooks.py).")
      .def_readonly("record", &KeptSave::record);

  py::class_<Packer>(m, "Packer", "The pack hook's front (hooks.py NOTE [Handles in C]).")
      .def(py::init<py::object, py::object, py::object, std::shared_ptr<SavedBytes>, int64_t,
                    py::object, py::object, py::object, py::object, py::object>(),
           py::arg("owner_ref"), py::arg("full"), py::arg("strided_pack"), py::arg("meter"),
           py::arg("min_bytes"), py::arg("tensor_type"), py::arg("strided"),
           py::arg("profiling"), py::arg("next_sequence_nr"), py::arg("record_type"))
      .def("__call__", &Packer::operator(), py::arg("tensor"))
      .def_property_readonly("__self__", &Packer::owner_or_none);

  py::class_<Unpacker>(m, "Unpacker", "The unpack hook's front (hooks.py NOTE [Handles in C]).")
      .def(py::init<py::object, py::object, py::object, py::object, py::object, py::object>(),
           py::arg("slow"), py::arg("marks"), py::arg("error"), py::arg("graph_task_id"),
           py::arg("perf_counter"), py::arg("profiling"))
      .def("__call__", &Unpacker::operator(), py::arg("packed"))
      .def_property_readonly("slow", &Unpacker::slow);
}

}  // namespace offload::bind
