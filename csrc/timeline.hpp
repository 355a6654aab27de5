// What the hooks' C front (hook_front.cpp) uses of the core's Timeline (timeline.cpp)
// directly, without a Python call.
#pragma once

#include <Python.h>

namespace offload::bind {

// Whether `obj` is the core's Timeline.
bool is_timeline(PyObject* obj);

// Marks row `index` of the core's Timeline `timeline` unpacked at `now_s`, if it is its
// first unpack. False, with an IndexError set, for a row it does not have.
bool timeline_unpacked(PyObject* timeline, Py_ssize_t index, double now_s);

}  // namespace offload::bind
