// The CPython types of the hooks' C front (hook_front.cpp, saved_handles.cpp,
// saved_record.cpp, storage_ref.cpp, timeline.cpp) and of the nvme tier's records
// (nvme_payload.cpp, nvme_transfers.cpp) start here: written against the C API, not pybind11, and not tracked
// by the garbage collector (no Py_TPFLAGS_HAVE_GC; each file says why that is safe for its
// types).
#pragma once

#include <Python.h>

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

// Sequence slots with only a length (`len(obj)`).
inline PySequenceMethods length_only(lenfunc length) {
  PySequenceMethods methods{};
  methods.sq_length = length;
  return methods;
}

}  // namespace offload::bind
