// The CPython types of the hooks' C front (hook_front.cpp, saved_handles.cpp,
// saved_record.cpp, storage_index.cpp, storage_ref.cpp, timeline.cpp, moved_save.cpp,
// prefetcher.cpp) and of the nvme tier's records (nvme_payload.cpp, nvme_transfers.cpp)
// start here: written against the C API, not pybind11. Most are not tracked by the garbage collector (no Py_TPFLAGS_HAVE_GC;
// each file says why that is safe for its types); the per-step objects that hold the step's
// own (the packer's move path, the prefetcher) are, through `tracked`.
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

// `type` tracked by the garbage collector, with these slots.
inline void tracked(PyTypeObject& type, traverseproc traverse, inquiry clear) {
  type.tp_flags |= Py_TPFLAGS_HAVE_GC;
  type.tp_traverse = traverse;
  type.tp_clear = clear;
  type.tp_free = PyObject_GC_Del;
}

// Sequence slots with only a length (`len(obj)`).
inline PySequenceMethods length_only(lenfunc length) {
  PySequenceMethods methods{};
  methods.sq_length = length;
  return methods;
}

}  // namespace offload::bind
