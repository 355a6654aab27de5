// tiers/host.py's CPU payload and byte count in C (storage_ref.cpp): the StorageRef and the
// HostLedger whose `store` makes them.
#pragma once

#include <Python.h>

namespace offload::bind {

// Whether `obj` is a StorageRef: a resident payload (its bytes stay the device's memory).
bool is_storage_ref(PyObject* obj);

}  // namespace offload::bind
