// The CPython types of the hooks' C front (hook_front.cpp, hook_unpacker.cpp,
// saved_handles.cpp, saved_record.cpp, storage_index.cpp, storage_ref.cpp, timeline.cpp,
// moved_save.cpp, prefetcher.cpp) and of the nvme tier's records (nvme_payload.cpp,
// nvme_transfers.cpp) start here: written against the C API, not pybind11. Most are not
// tracked by the garbage collector (no Py_TPFLAGS_HAVE_GC; each file says why that is safe
// for its types); the per-step objects that hold the step's own (the packer's move path,
// the prefetcher) are, through `tracked`.
#pragma once

#include <Python.h>

#include <pybind11/pybind11.h>

#include <cstddef>

namespace offload::bind {

// A type with every slot empty but these (the caller sets its members, methods, call...).
inline PyTypeObject plain_type(const char* name, Py_ssize_t size, const char* doc,
                               newfunc new_object, destructor dealloc) {
  PyTypeObject type{};
  PyVarObject head = {PyObject_HEAD_INIT(nullptr) 0};
  type.ob_base = head;
  type.tp_name = name;
  type.tp_basicsize = size;
  type.tp_flags = Py_TPFLAGS_DEFAULT;
  type.tp_doc = doc;
  type.tp_new = new_object;
  type.tp_dealloc = dealloc;
  return type;
}

// `type` tracked by the garbage collector, with these slots.
inline void tracked(PyTypeObject& type, traverseproc traverse, inquiry clear) {
  type.tp_flags |= Py_TPFLAGS_HAVE_GC;
  type.tp_traverse = traverse;
  type.tp_clear = clear;
  type.tp_free = PyObject_GC_Del;
}

// The fields every hook torch calls starts with: its vectorcall slot (torch calls a hook
// with one argument, through vectorcall where the callable has it).
struct Callable {
  PyObject_HEAD
  vectorcallfunc vectorcall;
};

// A hook's type: vectorcall through `Callable::vectorcall`, not tracked (hook_front.cpp
// and hook_unpacker.cpp say why that is safe for theirs).
inline PyTypeObject callable_type(const char* name, Py_ssize_t size, const char* doc,
                                  newfunc make, destructor dealloc) {
  PyTypeObject type = plain_type(name, size, doc, make, dealloc);
  type.tp_flags |= Py_TPFLAGS_HAVE_VECTORCALL;
  type.tp_vectorcall_offset = offsetof(Callable, vectorcall);
  type.tp_call = PyVectorcall_Call;
  return type;
}

// Whether a hook was called with one positional argument; a TypeError naming the hook if not.
inline bool one_argument(const char* what, size_t nargsf, PyObject* kwnames) {
  if (PyVectorcall_NARGS(nargsf) == 1 && (kwnames == nullptr || PyTuple_GET_SIZE(kwnames) == 0))
    return true;
  PyErr_Format(PyExc_TypeError, "offload: the %s hook takes one argument", what);
  return false;
}

// Readies one of these static types and adds it to the module as `name`; the module holds
// it for the process.
inline void add_type(pybind11::module_& m, const char* name, PyTypeObject& type) {
  if (PyType_Ready(&type) < 0) throw pybind11::error_already_set();
  Py_INCREF(&type);
  m.add_object(name, reinterpret_cast<PyObject*>(&type));
}

// Sequence slots with only a length (`len(obj)`).
inline PySequenceMethods length_only(lenfunc length) {
  PySequenceMethods methods{};
  methods.sq_length = length;
  return methods;
}

}  // namespace offload::bind
