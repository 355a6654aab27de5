// What autograd holds for a saved tensor whose storage moved to a tier, in C: saved_handles.py's
// `Moved` (moved_save.cpp). Made by the hooks' move path (pack_moved.cpp) and unpacked by
// the Unpacker (hook_unpacker.cpp) or its `unpack(lock)` method, with no Python frame between
// the hook and the tier but the prefetcher's.
#pragma once

#include <Python.h>

namespace offload::bind {

extern PyTypeObject moved_save_type;

inline bool is_moved_save(PyObject* obj) { return Py_TYPE(obj) == &moved_save_type; }

// A MovedSave of tensor `t` (its grad_fn `node`, its `_base` `base`, its `version` at pack)
// whose storage is the core's `record`: the view layout to rebuild (the record's snapshot
// layout if it has one), a version sentinel, what autograd's message needs, and one more
// save of the record (`handles_left`). A new reference, or nullptr with a Python error set.
// `storage_offset`: t's, when the caller read it already; -1: read it.
PyObject* new_moved_save(PyObject* t, PyObject* record, PyObject* node, PyObject* base,
                         long long version, PyObject* next_sequence_nr, PyObject* empty,
                         long long storage_offset = -1);

// The saved tensor back (saved_handles.py `Moved.unpack`): its version checked (NOTE [Version
// check]), its record's bytes loaded under the hooks' `lock`, its layout rebuilt over them.
// A new reference, or nullptr with a Python error set.
PyObject* unpack_moved(PyObject* save, PyObject* lock);

}  // namespace offload::bind
