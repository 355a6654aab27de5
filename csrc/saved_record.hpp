// What the hooks' C front (hook_front.cpp) reads of the core's records and storage index
// (saved_record.cpp) directly, without a Python call.
#pragma once

#include <Python.h>

namespace offload::bind {

// The Timeline and row where `record`'s unpack is noted (timeline borrowed; nullptr when the
// storage is not timed or `record` is not the core's Record).
PyObject* record_timeline(PyObject* record, Py_ssize_t* row);

// Whether `record` is the core's Record and has a payload in a tier.
bool record_holds_space(PyObject* record);

}  // namespace offload::bind
