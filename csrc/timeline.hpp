// What the core's records (saved_record.cpp) use of the core's Timeline (timeline.cpp)
// directly, without a Python call.
#pragma once

#include <Python.h>

namespace offload::bind {

// Whether `obj` is the core's Timeline.
bool is_timeline(PyObject* obj);

// Adds a row to the core's Timeline `timeline` for a storage packed at `pack_s`; its
// index, or -1 with a Python error set.
Py_ssize_t timeline_add_row(PyObject* timeline, long long position, long long nbytes,
                            double pack_s);

// Marks row `index` of the core's Timeline `timeline` unpacked at `now_s`, if it is its
// first unpack. False, with an IndexError set, for a row it does not have.
bool timeline_unpacked(PyObject* timeline, Py_ssize_t index, double now_s);

}  // namespace offload::bind
