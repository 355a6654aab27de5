// tiers/host.py's payload for a CPU storage: the storage's bytes held by reference (on a
// CPU run host RAM is the device's memory, so nothing is copied).
//
// Why C: the host tier makes one for every storage it stores on a CPU run, and a Python
// payload is an object the garbage collector walks again and again while the step holds it
// (~1-2 us per object over its life: docs/benchmarks.md *Hook cost*). This type is not
// tracked (no Py_TPFLAGS_HAVE_GC), which is safe: it refers only to a storage and a
// device, neither of which refers to anything of the user's, so no cycle can run through
// it. Same fields as a Python `Payload` (`nbytes`, `device`, `resident`) plus `storage`,
// which the tier sets to None when it releases the bytes.
#include <Python.h>
#include <structmember.h>

#include <pybind11/pybind11.h>

#include "bindings.hpp"
#include "py_type.hpp"

namespace py = pybind11;

namespace offload::bind {

namespace {

struct StorageRef {
  PyObject_HEAD
  PyObject* storage;   // None once released
  Py_ssize_t nbytes;
  PyObject* device;    // where the bytes came from and go back to
  PyObject* weakrefs;
};

PyObject* make(PyTypeObject* type, PyObject* storage, Py_ssize_t nbytes, PyObject* device) {
  PyObject* self_obj = type->tp_alloc(type, 0);
  if (self_obj == nullptr) return nullptr;
  auto* self = reinterpret_cast<StorageRef*>(self_obj);
  self->storage = Py_NewRef(storage);
  self->nbytes = nbytes;
  self->device = Py_NewRef(device);
  return self_obj;
}

// `StorageRef(storage, nbytes, device)`, by position only: the tier makes one per storage,
// without an argument tuple.
PyObject* storage_ref_vectorcall(PyObject* type_obj, PyObject* const* args, size_t nargsf,
                                 PyObject* kwnames) {
  auto* type = reinterpret_cast<PyTypeObject*>(type_obj);
  if (PyVectorcall_NARGS(nargsf) != 3 || (kwnames != nullptr && PyTuple_GET_SIZE(kwnames))) {
    PyErr_SetString(PyExc_TypeError, "offload: StorageRef(storage, nbytes, device) takes "
                                     "its 3 arguments by position");
    return nullptr;
  }
  const Py_ssize_t nbytes = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
  if (nbytes == -1 && PyErr_Occurred()) return nullptr;
  return make(type, args[0], nbytes, args[2]);
}

void storage_ref_dealloc(PyObject* self_obj) {
  auto* self = reinterpret_cast<StorageRef*>(self_obj);
  if (self->weakrefs != nullptr) PyObject_ClearWeakRefs(self_obj);
  Py_CLEAR(self->storage);
  Py_CLEAR(self->device);
  Py_TYPE(self_obj)->tp_free(self_obj);
}

PyMemberDef storage_ref_members[] = {
    {const_cast<char*>("storage"), T_OBJECT, offsetof(StorageRef, storage), 0,
     const_cast<char*>("The storage; None once the tier released it.")},
    {const_cast<char*>("nbytes"), T_PYSSIZET, offsetof(StorageRef, nbytes), READONLY, nullptr},
    {const_cast<char*>("device"), T_OBJECT, offsetof(StorageRef, device), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};

PyTypeObject storage_ref_type = [] {
  PyTypeObject type = plain_type(
      "offload._C.StorageRef", sizeof(StorageRef),
      "StorageRef(storage, nbytes, device): a CPU storage's bytes held by reference (the "
      "host tier's payload on a CPU run; `resident`: its bytes stay in the device's memory).",
      nullptr, storage_ref_dealloc);
  type.tp_vectorcall = storage_ref_vectorcall;
  type.tp_members = storage_ref_members;
  type.tp_weaklistoffset = offsetof(StorageRef, weakrefs);
  return type;
}();

}  // namespace

void bind_storage_ref(py::module_& m) {
  if (PyType_Ready(&storage_ref_type) < 0) throw py::error_already_set();
  // A class attribute, as Payload.resident: the bytes still occupy the device's memory.
  if (PyDict_SetItemString(storage_ref_type.tp_dict, "resident", Py_True) < 0)
    throw py::error_already_set();
  PyType_Modified(&storage_ref_type);
  Py_INCREF(&storage_ref_type);   // the module holds the type for the process
  m.add_object("StorageRef", reinterpret_cast<PyObject*>(&storage_ref_type));
}

}  // namespace offload::bind
