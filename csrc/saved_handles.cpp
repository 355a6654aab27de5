// What autograd holds for a saved tensor that stays, in C: Python classes HeldTensor,
// SmallSave and KeptSave (made by the hooks' front, hook_front.cpp), and the binding of the
// step's SavedBytes meter (saved_bytes.hpp).
//
// Why C (offload/runtime/hooks.py NOTE [Handles in C]): every saved tensor passes through
// the hooks, and in Python the object each save keeps alive costs the garbage collector
// ~1-2 us (walked by every collection while the step holds it) besides its making. The
// handles made here (SmallSave: a tensor below OFFLOAD_MIN_BYTES; KeptSave: a tensor that
// stays with its storage's record) are not tracked by the collector (their types have no
// Py_TPFLAGS_HAVE_GC). That is safe because autograd alone holds a handle: any
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
//
// The handles are written against the CPython API, not pybind11 (as saved_record.cpp's
// Record): a handle is made with one allocation (a pybind11 instance is registered in its
// instance map, several hundred ns per save: docs/benchmarks.md *Hook cost*). The meter,
// called from Python at the step's edges, stays a pybind11 class.
#include <Python.h>
#include <structmember.h>

#include <pybind11/pybind11.h>

#include <memory>

#include "bindings.hpp"
#include "py_calls.hpp"
#include "py_type.hpp"
#include "saved_bytes.hpp"
#include "saved_handles.hpp"

namespace py = pybind11;

namespace offload::bind {

Names names;

PyObject* tensor_if_unchanged(HeldTensor* self) {
  PyObject* now = PyObject_GetAttr(self->tensor, names.version);
  if (now == nullptr) return nullptr;
  const long long version = PyLong_AsLongLong(now);
  Py_DECREF(now);
  if (version == -1 && PyErr_Occurred()) return nullptr;
  return Py_NewRef(version == self->version ? self->tensor : Py_None);
}

namespace {

void held_clear(HeldTensor* self) {
  Py_CLEAR(self->tensor);
  Py_CLEAR(self->node_name);
}

void small_save_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<SmallSave*>(obj);
  if (self->meter) self->meter->small_freed(self->key);
  self->meter.~shared_ptr();
  held_clear(&self->held);
  Py_TYPE(obj)->tp_free(obj);
}

void kept_save_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<KeptSave*>(obj);
  held_clear(&self->held);
  Py_CLEAR(self->record);   // may free the record: it gives its payload back (ledger)
  Py_TYPE(obj)->tp_free(obj);
}


PyObject* held_tensor_if_unchanged(PyObject* self, PyObject*) {
  return tensor_if_unchanged(reinterpret_cast<HeldTensor*>(self));
}

#define HELD_MEMBER(name, type) \
  {const_cast<char*>(#name), type, offsetof(HeldTensor, name), READONLY, nullptr}

PyMemberDef held_members[] = {
    HELD_MEMBER(tensor, T_OBJECT),
    HELD_MEMBER(version, T_LONGLONG),
    HELD_MEMBER(node_name, T_OBJECT),
    HELD_MEMBER(output_nr, T_LONGLONG),
    {nullptr, 0, 0, 0, nullptr},
};

#undef HELD_MEMBER

PyMemberDef kept_members[] = {
    {const_cast<char*>("record"), T_OBJECT, offsetof(KeptSave, record), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};

PyMethodDef held_methods[] = {
    {"tensor_if_unchanged", held_tensor_if_unchanged, METH_NOARGS,
     "The tensor, or None when it changed in place since it was saved."},
    {nullptr, nullptr, 0, nullptr},
};

PyTypeObject held_type = [] {
  PyTypeObject type = plain_type("offload._C.HeldTensor", sizeof(HeldTensor),
                                  "A saved tensor that stays (hooks.py).", nullptr, nullptr);
  type.tp_flags |= Py_TPFLAGS_BASETYPE;
  type.tp_members = held_members;
  type.tp_methods = held_methods;
  return type;
}();

}  // namespace

PyTypeObject small_save_type = [] {
  PyTypeObject type = plain_type(
      "offload._C.SmallSave", sizeof(SmallSave),
      "What autograd holds for a saved tensor below OFFLOAD_MIN_BYTES.", nullptr,
      small_save_dealloc);
  type.tp_base = &held_type;
  return type;
}();

PyTypeObject kept_save_type = [] {
  PyTypeObject type = plain_type(
      "offload._C.KeptSave", sizeof(KeptSave),
      "What autograd holds for another saved tensor that stays (hooks.py).", nullptr,
      kept_save_dealloc);
  type.tp_base = &held_type;
  type.tp_members = kept_members;
  return type;
}();

void bind_saved_handles(py::module_& m) {
  names = Names{intern("layout"),    intern("untyped_storage"), intern("nbytes"),
                intern("grad_fn"),   intern("_base"),           intern("is_leaf"),
                intern("_version"),  intern("detach"),          intern("output_nr"),
                intern("__name__"),  intern("epoch"),           intern("closed"),
                intern("fetch"),     intern("storage_offset"),  intern("clone")};

  py::class_<SavedBytes, std::shared_ptr<SavedBytes>>(
      m, "SavedBytes",
      "Bytes of saved activations resident on the device in one step (current and peak), "
      "the small saves' storages counted once while any save of them lives (saves of "
      "either path), and the records holding tier space (the core's records count "
      "themselves in and out in C).")
      .def(py::init<>())
      .def("small_saved", &SavedBytes::small_saved, py::arg("key"), py::arg("nbytes"),
           "A small storage saved (again) by the Python path: counted once while any save "
           "of it lives, with the C path's saves of it.")
      .def("small_freed", &SavedBytes::small_freed, py::arg("key"))
      .def("take_counts", &SavedBytes::take_counts,
           "(saves the C path packed, of them held by resident records, storages saved "
           "(small ones and records), their bytes, of those the kept bytes, [(tier, bytes "
           "stored in it)]) since the last call.")
      .def_property_readonly("resident", &SavedBytes::resident)
      .def_property_readonly("peak", &SavedBytes::peak)
      .def_property_readonly("small_storages_alive", &SavedBytes::small_storages_alive)
      .def_property_readonly("live_records", &SavedBytes::live_records,
                             "The step's records holding tier space (the core's count "
                             "themselves in, saved_record.cpp).")
      .def_property_readonly("idle_since_s", &SavedBytes::idle_since_s,
                             "time.perf_counter() when the last of them died; None before.");

  add_type(m, "HeldTensor", held_type);   // first: the base of the other two
  add_type(m, "SmallSave", small_save_type);
  add_type(m, "KeptSave", kept_save_type);
}

}  // namespace offload::bind
