// Shared helpers of the pybind11 binding files.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "direct_io.hpp"

namespace offload::bind {

// Sizes arrive as Python ints; a negative one gets a ValueError naming the argument
// instead of pybind11's generic "incompatible function arguments".
uint64_t non_negative(int64_t value, const char* name);

// Sets offload.errors.UsedAfterCloseError (a RuntimeError if that module cannot be imported)
// as the pending Python error: the one class for "used after close", from C++ and Python.
void set_used_after_close(const char* message);

// Sends notes gathered without the GIL to logging.getLogger("offload").
void emit_log_notes(const std::vector<LogNote>& notes);

void bind_arena(pybind11::module_& m);
void bind_store(pybind11::module_& m);
void bind_saved_handles(pybind11::module_& m);
void bind_hook_front(pybind11::module_& m);
void bind_saved_record(pybind11::module_& m);
void bind_timeline(pybind11::module_& m);
void bind_storage_ref(pybind11::module_& m);
void bind_nvme_records(pybind11::module_& m);

}  // namespace offload::bind
