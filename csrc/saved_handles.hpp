// The handles autograd holds for a saved tensor that stays (saved_handles.cpp): made by the
// packer (hook_front.cpp) and read by the unpacker (hook_unpacker.cpp).
#pragma once

#include <Python.h>

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>

#include "saved_bytes.hpp"

namespace offload::bind {

namespace py = pybind11;

// A saved tensor that stays where it is: the tensor (or, for an output of the node saving
// it, a detached alias sharing its version counter) and what autograd's "modified by an
// inplace operation" message needs (version_check.py, saved_handles.held_tensor_error).
struct HeldTensor {
  PyObject_HEAD
  PyObject* tensor;
  long long version;
  PyObject* node_name;   // the saving node's name for an output; None for an input
  long long output_nr;
};

// What autograd holds for a saved tensor below OFFLOAD_MIN_BYTES: counted in the step's
// meter once per storage while any save of it lives.
struct SmallSave {
  HeldTensor held;
  uintptr_t key;
  // Empty: made, but an error came before it was counted (the packer sets the meter right
  // before counting it). Constructed by the packer, destroyed in small_save_dealloc.
  std::shared_ptr<SavedBytes> meter;
};

// What autograd holds for any other saved tensor that stays (a weight, a storage the
// placement kept, a CPU storage on the host tier): its storage's record (records.Record:
// dedup, timing, the tier's reference), None for a weight. The record lives as long as
// some save of it (records.py NOTE [Record lifetime]).
struct KeptSave {
  HeldTensor held;
  PyObject* record;
};

extern PyTypeObject small_save_type;
extern PyTypeObject kept_save_type;

// The tensor, or None when it changed in place since pack (the caller raises); nullptr
// with an error set when its version could not be read.
PyObject* tensor_if_unchanged(HeldTensor* self);

// A new handle of `type`, its fields empty (None / 0).
template <typename Handle>
inline Handle* new_handle(PyTypeObject* type) {
  PyObject* obj = type->tp_alloc(type, 0);   // zero-filled
  if (obj == nullptr) throw py::error_already_set();
  return reinterpret_cast<Handle*>(obj);
}

}  // namespace offload::bind
