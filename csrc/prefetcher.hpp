// The backward's read-ahead in C (prefetcher.cpp): Python class Prefetcher, the same order,
// budget and figures as offload/runtime/prefetch.py's (whose docstring says how it reads
// ahead). A CPU payload of the nvme tier is read and handed out through its NvmeTransfers
// with no Python call; any other payload through its tier's methods.
#pragma once

#include <Python.h>

namespace offload::bind {

// Whether `obj` is the core's Prefetcher.
bool is_prefetcher(PyObject* obj);

// `prefetcher.register(tier, payload)` for the core's Prefetcher; false with a Python error
// set.
bool prefetcher_register(PyObject* prefetcher, PyObject* tier, PyObject* payload);

// `prefetcher.fetch(tier, payload)` for the core's Prefetcher: the payload's bytes as the
// tier hands them out (a new reference), or nullptr with a Python error set. A CPU nvme
// payload's are a tensor of `dtype` with storage offset 0 (uint8 when null; see
// nvme::fetch), any other's what its tier's `fetch` returns.
PyObject* prefetcher_fetch(PyObject* prefetcher, PyObject* tier, PyObject* payload,
                           PyObject* dtype = nullptr);

}  // namespace offload::bind
