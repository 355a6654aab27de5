// The nvme tier's per-storage records: its payload (`NvmePayload`) and the write and read in
// flight for it (`NvmeWrite`, `NvmeRead`). Plain fields, no methods: tiers/nvme.py and its
// queues (nvme_writes.py, nvme_reads.py) set and read them (tiers/base.py NOTE [One owner]).
//
// Why C: the tier makes a payload and a write for every storage it stores, and a read for
// every one it loads back. As Python objects these are three allocations of objects the
// garbage collector tracks, per saved tensor: they drive its young collections, and each
// tenth of those promotes what the step holds towards a full collection, which walks every
// object of the process (on the dev VM the full collections were the largest part of what
// the collector cost an nvme save: docs/benchmarks.md *Hook cost*). These types are not
// tracked (no Py_TPFLAGS_HAVE_GC). That is safe because nothing they refer to can refer
// back to them: an Extent and an IoFuture (the core's), a torch device, a storage or a
// uint8 tensor (a write's source, a read's buffer), the copy tickets and WriteBehind of a
// CUDA chain (tiers/copy_tickets.py, nvme_device.py: events, blocks and tensors), and a
// payload's own write and read. No cycle can run through them.
#include <Python.h>
#include <structmember.h>

#include <initializer_list>

#include <pybind11/pybind11.h>

#include "bindings.hpp"
#include "perf_clock.hpp"
#include "py_type.hpp"

namespace py = pybind11;

namespace offload::bind {

namespace {

// Positional arguments only: the tier makes these per storage, without an argument tuple.
bool positional(const char* call, Py_ssize_t want, size_t nargsf, PyObject* kwnames) {
  if (kwnames != nullptr && PyTuple_GET_SIZE(kwnames)) {
    PyErr_Format(PyExc_TypeError, "offload: %s takes its arguments by position only", call);
    return false;
  }
  const Py_ssize_t given = PyVectorcall_NARGS(nargsf);
  if (given == want) return true;
  PyErr_Format(PyExc_TypeError, "offload: %s takes %zd arguments (%zd given)", call, want,
               given);
  return false;
}

bool is_int(const char* call, const char* name, PyObject* value) {
  if (PyLong_Check(value) && !PyBool_Check(value)) return true;
  PyErr_Format(PyExc_TypeError, "offload: %s: %s must be an int, not %s", call, name,
               Py_TYPE(value)->tp_name);
  return false;
}

// A new reference to True or False; nullptr with an error set.
PyObject* as_bool(PyObject* value) {
  const int truth = PyObject_IsTrue(value);
  return truth < 0 ? nullptr : Py_NewRef(truth ? Py_True : Py_False);
}

// Every field is an object member (T_OBJECT_EX; numbers and flags as int, float and bool
// objects): the interpreter specializes reads and writes of those as it does a Python
// class's __slots__, but not of C numbers (T_PYSSIZET, T_BOOL, ... go through the generic
// descriptor call, about twice the cost). No field is ever NULL but after a `del`.
#define OBJECT_FIELD(Type, name, flags, doc) \
  {const_cast<char*>(#name), T_OBJECT_EX, offsetof(Type, name), flags, \
   const_cast<char*>(static_cast<const char*>(doc))}

PyObject** field_at(PyObject* self, const PyMemberDef& member) {
  return reinterpret_cast<PyObject**>(reinterpret_cast<char*>(self) + member.offset);
}

// How many of each type are alive (tests/test_leaks.py: untracked objects are not in
// gc.get_objects()). Changed with the GIL held, in `make` and `dealloc`.
Py_ssize_t payloads_alive = 0;
Py_ssize_t writes_alive = 0;
Py_ssize_t reads_alive = 0;

// A new object of `type` whose fields, in the order of its members, take `values`: new
// references, all of them taken over (dropped when one is nullptr, an error set by the
// call that made it, or when the object cannot be allocated).
PyObject* make(PyTypeObject* type, std::initializer_list<PyObject*> values,
               Py_ssize_t* alive) {
  bool all = true;
  for (PyObject* v : values) all = all && v != nullptr;
  PyObject* self = all ? type->tp_alloc(type, 0) : nullptr;   // zero-filled
  if (self == nullptr) {
    for (PyObject* v : values) Py_XDECREF(v);
    return nullptr;
  }
  const PyMemberDef* member = type->tp_members;
  for (PyObject* v : values) *field_at(self, *member++) = v;
  ++*alive;
  return self;
}

template <Py_ssize_t* alive>
void dealloc(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  if (type->tp_weaklistoffset != 0 &&
      *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(self) + type->tp_weaklistoffset))
    PyObject_ClearWeakRefs(self);
  for (const PyMemberDef* member = type->tp_members; member->name != nullptr; ++member)
    Py_CLEAR(*field_at(self, *member));
  type->tp_free(self);
  --*alive;
}

// ------------------------------------------------------------------------------ payload

struct NvmePayload {
  PyObject_HEAD
  PyObject* extent;    // the core's Extent: where the bytes are in the store
  PyObject* nbytes;    // int
  PyObject* device;    // where the bytes came from and go back to
  PyObject* phase;     // int: nvme.py NOTE [Phase]
  PyObject* cuda;      // bool: on_cuda(device), asked once
  PyObject* released;  // bool
  PyObject* write;     // the NvmeWrite in flight, or None (set and cleared by the tier)
  PyObject* read;      // the NvmeRead in flight or landed, not yet fetched, or None
  PyObject* weakrefs;
};

PyObject* payload_vectorcall(PyObject* type, PyObject* const* args, size_t nargsf,
                             PyObject* kwnames) {
  constexpr const char* call = "NvmePayload(extent, nbytes, device, phase, cuda)";
  if (!positional(call, 5, nargsf, kwnames) || !is_int(call, "nbytes", args[1]) ||
      !is_int(call, "phase", args[3]))
    return nullptr;
  return make(reinterpret_cast<PyTypeObject*>(type),
              {Py_NewRef(args[0]), Py_NewRef(args[1]), Py_NewRef(args[2]), Py_NewRef(args[3]),
               as_bool(args[4]), Py_NewRef(Py_False), Py_NewRef(Py_None), Py_NewRef(Py_None)},
              &payloads_alive);
}

PyMemberDef payload_members[] = {   // in NvmePayload's order (`make`)
    OBJECT_FIELD(NvmePayload, extent, READONLY, "The core's Extent of the bytes."),
    OBJECT_FIELD(NvmePayload, nbytes, READONLY, nullptr),
    OBJECT_FIELD(NvmePayload, device, READONLY, nullptr),
    OBJECT_FIELD(NvmePayload, phase, READONLY, "Address % alignment of the bytes in memory."),
    OBJECT_FIELD(NvmePayload, cuda, READONLY, "Whether `device` is a CUDA device."),
    OBJECT_FIELD(NvmePayload, released, 0, "Set by the tier when it gives the bytes back."),
    OBJECT_FIELD(NvmePayload, write, 0, "The NvmeWrite in flight, or None (the tier's to set)."),
    OBJECT_FIELD(NvmePayload, read, 0, "The NvmeRead not yet fetched, or None (the tier's)."),
    {nullptr, 0, 0, 0, nullptr},
};

PyTypeObject payload_type = [] {
  PyTypeObject type = plain_type(
      "offload._C.NvmePayload", sizeof(NvmePayload),
      "NvmePayload(extent, nbytes, device, phase, cuda): one storage's bytes in the nvme "
      "tier, and references to its write and read in flight (tiers/nvme.py).",
      nullptr, dealloc<&payloads_alive>);
  type.tp_vectorcall = payload_vectorcall;
  type.tp_members = payload_members;
  type.tp_weaklistoffset = offsetof(NvmePayload, weakrefs);
  return type;
}();

// ------------------------------------------------------------------------------ write

struct NvmeWrite {
  PyObject_HEAD
  PyObject* nbytes;        // int
  PyObject* future;        // IoFuture, or nvme_device.WriteBehind after a D2H; None while
  //                          it waits in the batch (nvme_writes.py NOTE [Write batches])
  PyObject* source;        // memory a direct write reads from (nvme.py NOTE [Deferred free])
  PyObject* address;       // int: where a direct write reads from
  PyObject* direct_bytes;  // int: bytes of `source` counted against the direct-write cap
  PyObject* d2h;           // D2HTicket of the device copy feeding it (CUDA), or None
  PyObject* start_s;       // float: set when it is queued
};

PyObject* write_vectorcall(PyObject* type, PyObject* const* args, size_t nargsf,
                           PyObject* kwnames) {
  constexpr const char* call = "NvmeWrite(nbytes)";
  if (!positional(call, 1, nargsf, kwnames) || !is_int(call, "nbytes", args[0]))
    return nullptr;
  return make(reinterpret_cast<PyTypeObject*>(type),
              {Py_NewRef(args[0]), Py_NewRef(Py_None), Py_NewRef(Py_None), PyLong_FromLong(0),
               PyLong_FromLong(0), Py_NewRef(Py_None), PyFloat_FromDouble(0.0)},
              &writes_alive);
}

PyMemberDef write_members[] = {   // in NvmeWrite's order (`make`)
    OBJECT_FIELD(NvmeWrite, nbytes, READONLY, nullptr),
    OBJECT_FIELD(NvmeWrite, future, 0, nullptr),
    OBJECT_FIELD(NvmeWrite, source, 0, nullptr),
    OBJECT_FIELD(NvmeWrite, address, 0, nullptr),
    OBJECT_FIELD(NvmeWrite, direct_bytes, 0, nullptr),
    OBJECT_FIELD(NvmeWrite, d2h, 0, nullptr),
    OBJECT_FIELD(NvmeWrite, start_s, 0, nullptr),
    {nullptr, 0, 0, 0, nullptr},
};

PyTypeObject write_type = [] {
  PyTypeObject type = plain_type(
      "offload._C.NvmeWrite", sizeof(NvmeWrite),
      "NvmeWrite(nbytes): one payload's write, from the tier's store until its write queue "
      "retires it (tiers/nvme_writes.py).",
      nullptr, dealloc<&writes_alive>);
  type.tp_vectorcall = write_vectorcall;
  type.tp_members = write_members;
  return type;
}();

// ------------------------------------------------------------------------------ read

struct NvmeRead {
  PyObject_HEAD
  PyObject* nbytes;    // int
  PyObject* future;    // IoFuture, or the H2DTicket of a read chained to an H2D
  PyObject* buf;       // host memory the read lands in (None when chained)
  PyObject* gpu;       // bool: chained to an H2D
  PyObject* observed;  // bool: its completion already counted
  PyObject* start_s;   // float: when it was made, on time.perf_counter()'s clock
};

PyObject* read_vectorcall(PyObject* type, PyObject* const* args, size_t nargsf,
                          PyObject* kwnames) {
  constexpr const char* call = "NvmeRead(nbytes, future, buf, gpu)";
  if (!positional(call, 4, nargsf, kwnames) || !is_int(call, "nbytes", args[0]))
    return nullptr;
  return make(reinterpret_cast<PyTypeObject*>(type),
              {Py_NewRef(args[0]), Py_NewRef(args[1]), Py_NewRef(args[2]), as_bool(args[3]),
               Py_NewRef(Py_False), PyFloat_FromDouble(perf_counter_s())},
              &reads_alive);
}

PyMemberDef read_members[] = {   // in NvmeRead's order (`make`)
    OBJECT_FIELD(NvmeRead, nbytes, READONLY, nullptr),
    OBJECT_FIELD(NvmeRead, future, 0, nullptr),
    OBJECT_FIELD(NvmeRead, buf, 0, nullptr),
    OBJECT_FIELD(NvmeRead, gpu, READONLY, nullptr),
    OBJECT_FIELD(NvmeRead, observed, 0, nullptr),
    OBJECT_FIELD(NvmeRead, start_s, 0, nullptr),
    {nullptr, 0, 0, 0, nullptr},
};

PyTypeObject read_type = [] {
  PyTypeObject type = plain_type(
      "offload._C.NvmeRead", sizeof(NvmeRead),
      "NvmeRead(nbytes, future, buf, gpu): one payload's read, from its prefetch or fetch "
      "until its bytes are handed out (tiers/nvme_reads.py); start_s is when it was made.",
      nullptr, dealloc<&reads_alive>);
  type.tp_vectorcall = read_vectorcall;
  type.tp_members = read_members;
  return type;
}();

void add_type(py::module_& m, const char* name, PyTypeObject* type) {
  if (PyType_Ready(type) < 0) throw py::error_already_set();
  Py_INCREF(type);   // the module holds the type for the process
  m.add_object(name, reinterpret_cast<PyObject*>(type));
}

}  // namespace

void bind_nvme_records(py::module_& m) {
  add_type(m, "NvmePayload", &payload_type);
  // A class attribute, as Payload.resident: the bytes left the device's memory.
  if (PyDict_SetItemString(payload_type.tp_dict, "resident", Py_False) < 0)
    throw py::error_already_set();
  PyType_Modified(&payload_type);
  add_type(m, "NvmeWrite", &write_type);
  add_type(m, "NvmeRead", &read_type);
  m.def("_nvme_records_alive",
        [] { return py::make_tuple(payloads_alive, writes_alive, reads_alive); },
        "(payloads, writes, reads) of the nvme tier alive now: the collector does not see "
        "them (tests/test_leaks.py).");
}

}  // namespace offload::bind
