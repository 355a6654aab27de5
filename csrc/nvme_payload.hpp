// The nvme tier's payload and the write and read in flight for it (nvme_payload.cpp makes
// the payload a Python object; nvme_transfers.cpp owns and works on the transfers). A
// payload is one stored storage's place in the store; it calls nothing (tiers/base.py
// NOTE [One owner]): its write and read are set and cleared by the tier's NvmeTransfers.
//
// Everything here is touched with the GIL held: the C++ members that hold Python objects
// drop them in their destructors, so the last owner of a write or read must hold the GIL
// (nvme_transfers.cpp lets the GIL go only around a wait, holding its own references).
#pragma once

#include <Python.h>

#include <cstdint>
#include <exception>
#include <memory>

#include "host_arena.hpp"
#include "io_request.hpp"
#include "nvme_store.hpp"

namespace offload::bind {

// How many writes and reads are alive (tests/test_leaks.py: the collector does not see them).
extern Py_ssize_t nvme_writes_alive;
extern Py_ssize_t nvme_reads_alive;

// A transfer's completion: the core's request, or a Python object with done(), wait() and
// an `end_s` (a chained write's nvme_device.WriteBehind, a chained read's H2DTicket). Unset
// while a direct write waits in its batch (nvme_transfers.hpp NOTE [Write batches]).
struct Completion {
  std::shared_ptr<IoRequest> request;
  PyObject* future = nullptr;   // owned

  Completion() = default;
  Completion(const Completion&) = delete;
  Completion& operator=(const Completion&) = delete;
  ~Completion() { Py_XDECREF(future); }
  bool set() const noexcept { return request || future != nullptr; }
};

// One payload's write, from `store` until the transfers retire it.
struct NvmeWrite {
  explicit NvmeWrite(uint64_t n) : nbytes(n) { ++nvme_writes_alive; }
  NvmeWrite(const NvmeWrite&) = delete;
  NvmeWrite& operator=(const NvmeWrite&) = delete;
  ~NvmeWrite() {
    Py_XDECREF(source);
    Py_XDECREF(d2h);
    --nvme_writes_alive;
  }

  const uint64_t nbytes;
  Completion done;
  PyObject* source = nullptr;   // memory a direct write reads from, kept until it is retired
  //                               (nvme_transfers.hpp NOTE [Deferred free])
  PyObject* d2h = nullptr;      // the D2HTicket of the device copy a chained write follows
  uintptr_t address = 0;        // where a direct write reads from
  std::shared_ptr<HostRegion> copy;  // a copy of `source`'s bytes written instead (its memory
  //                                    moved: nvme_transfers.hpp NOTE [A source that moved])
  uint64_t direct_bytes = 0;    // bytes of `source` counted against the direct-write cap
  double start_s = 0.0;         // when it was queued (time.perf_counter()'s clock)
};

// One payload's read, from its prefetch or fetch until its bytes are handed out.
struct NvmeRead {
  NvmeRead(uint64_t n, bool on_device) : nbytes(n), chained(on_device) { ++nvme_reads_alive; }
  NvmeRead(const NvmeRead&) = delete;
  NvmeRead& operator=(const NvmeRead&) = delete;
  ~NvmeRead() { --nvme_reads_alive; }

  const uint64_t nbytes;
  const bool chained;           // read → H2D in the engine: `done.future` is the H2DTicket
  Completion done;
  std::shared_ptr<HostRegion> memory;   // where a host read lands (its request holds it too)
  uint64_t skip = 0;            // the bytes start this far into `memory` (NOTE [Phase])
  bool observed = false;        // its completion counted (busy clock, trace)
  double start_s = 0.0;
};

// The payload: where one storage's bytes are in the store, and its transfers in flight.
// `nbytes`, `device`, `phase` and `cuda` are also object members (read from Python at
// __slots__ speed: the prefetcher reads `nbytes` per read).
struct NvmePayload {
  PyObject_HEAD
  PyObject* nbytes_obj;
  PyObject* device;
  PyObject* phase_obj;
  PyObject* cuda_obj;
  PyObject* weakrefs;
  uint64_t nbytes;
  uint64_t phase;              // address % alignment of the bytes in memory (NOTE [Phase])
  bool cuda;
  bool released;
  std::shared_ptr<Extent> extent;   // the core store's extent ...
  PyObject* foreign_extent;         // ... or another store's (a test's simulated engine)
  std::shared_ptr<NvmeWrite> write;  // in flight, or null
  std::shared_ptr<NvmeRead> read;    // in flight or landed, not yet fetched, or null
  // Why its write failed (NOTE [A failed write stays failed] in nvme_writes.cpp): its bytes
  // are not on the disk, and every read of it raises this.
  std::exception_ptr write_error;
};

extern PyTypeObject nvme_payload_type;

inline bool is_payload(PyObject* obj) { return Py_TYPE(obj) == &nvme_payload_type; }

// A new payload, its transfers empty; nullptr with a Python error set.
PyObject* new_payload(uint64_t nbytes, PyObject* device, uint64_t phase, bool cuda,
                      std::shared_ptr<Extent> extent, PyObject* foreign_extent);

// A Python object exporting `nbytes` of `memory` from `skip` on through the buffer protocol
// (torch.frombuffer makes the read's tensor of it), holding the memory while it lives; not
// tracked by the collector. nullptr with a Python error set.
PyObject* new_read_buffer(std::shared_ptr<HostRegion> memory, uint64_t skip, uint64_t nbytes);

}  // namespace offload::bind
