// Shared helpers of the pybind11 binding files.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <exception>
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

// Sets the pending Python error for a C++ exception as the module's translator does for a
// bound call (IoError -> StorageError keeping errno, InvalidArgument -> ValueError,
// UseAfterClose -> UsedAfterCloseError, py::error_already_set restored, std::bad_alloc ->
// MemoryError, anything else RuntimeError): for the CPython types' entry points.
void set_python_error(std::exception_ptr error);

// Sends notes gathered without the GIL to logging.getLogger("offload").
void emit_log_notes(const std::vector<LogNote>& notes);

void bind_arena(pybind11::module_& m);
void bind_store(pybind11::module_& m);
void bind_saved_handles(pybind11::module_& m);
void bind_hook_front(pybind11::module_& m);
void bind_hook_unpacker(pybind11::module_& m);
void bind_moved_save(pybind11::module_& m);
void bind_prefetcher(pybind11::module_& m);
void bind_saved_record(pybind11::module_& m);
void bind_storage_index(pybind11::module_& m);
void bind_timeline(pybind11::module_& m);
void bind_storage_ref(pybind11::module_& m);
void bind_nvme_payload(pybind11::module_& m);
void bind_nvme_transfers(pybind11::module_& m);

}  // namespace offload::bind
