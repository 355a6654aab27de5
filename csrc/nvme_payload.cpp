// The nvme tier's payload as a Python object (NvmePayload), and the buffer a host read's
// bytes are handed out through (ReadBuffer). Made only by the tier's NvmeTransfers
// (nvme_transfers.cpp); Python reads what a payload stands for and whether a transfer is
// in flight, and changes nothing.
//
// Why C: the tier makes a payload for every storage it stores. A Python object there is
// one the garbage collector tracks per saved tensor: it drives its young collections, and
// each tenth of those promotes what the step holds towards a full collection, which walks
// every object of the process (docs/benchmarks.md *Hook cost*). These types are not
// tracked (no Py_TPFLAGS_HAVE_GC). That is safe because nothing a payload refers to can
// refer back to it: a torch device, ints and bools, an extent (the core's, or a simulated
// store's), and its write and read, which hold a storage or a tensor (a write's source), a
// D2H ticket or a WriteBehind of a CUDA chain (events, blocks and tensors), an H2D ticket,
// and host memory. A ReadBuffer holds only host memory. No cycle can run through them.
#include <Python.h>
#include <structmember.h>

#include <pybind11/pybind11.h>

#include "bindings.hpp"
#include "nvme_payload.hpp"
#include "py_type.hpp"

namespace py = pybind11;

namespace offload::bind {

Py_ssize_t nvme_writes_alive = 0;
Py_ssize_t nvme_reads_alive = 0;

namespace {

Py_ssize_t payloads_alive = 0;

// ------------------------------------------------------------------------------ payload

void payload_dealloc(PyObject* obj) {
  auto* self = reinterpret_cast<NvmePayload*>(obj);
  if (self->weakrefs != nullptr) PyObject_ClearWeakRefs(obj);
  Py_CLEAR(self->nbytes_obj);
  Py_CLEAR(self->device);
  Py_CLEAR(self->phase_obj);
  Py_CLEAR(self->cuda_obj);
  Py_CLEAR(self->foreign_extent);
  self->extent.~shared_ptr();
  self->write.~shared_ptr();
  self->read.~shared_ptr();
  self->write_error.~exception_ptr();
  Py_TYPE(obj)->tp_free(obj);
  --payloads_alive;
}

PyObject* as_bool(bool value) { return Py_NewRef(value ? Py_True : Py_False); }

PyObject* payload_released(PyObject* obj, void*) {
  return as_bool(reinterpret_cast<NvmePayload*>(obj)->released);
}

PyObject* payload_writing(PyObject* obj, void*) {
  return as_bool(reinterpret_cast<NvmePayload*>(obj)->write != nullptr);
}

PyObject* payload_write_failed(PyObject* obj, void*) {
  return as_bool(reinterpret_cast<NvmePayload*>(obj)->write_error != nullptr);
}

PyObject* payload_reading(PyObject* obj, void*) {
  return as_bool(reinterpret_cast<NvmePayload*>(obj)->read != nullptr);
}

PyObject* payload_reading_on_device(PyObject* obj, void*) {
  const auto& read = reinterpret_cast<NvmePayload*>(obj)->read;
  return as_bool(read != nullptr && read->chained);
}

PyObject* payload_extent(PyObject* obj, void*) {
  auto* self = reinterpret_cast<NvmePayload*>(obj);
  if (self->foreign_extent != nullptr) return Py_NewRef(self->foreign_extent);
  if (!self->extent) Py_RETURN_NONE;
  try {
    return py::cast(self->extent).release().ptr();   // a new Python handle of the same extent
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  }
}

PyGetSetDef payload_getset[] = {
    {const_cast<char*>("released"), payload_released, nullptr,
     const_cast<char*>("Whether the tier gave the bytes back."), nullptr},
    {const_cast<char*>("writing"), payload_writing, nullptr,
     const_cast<char*>("Whether its write is in flight (not yet retired by the tier)."),
     nullptr},
    {const_cast<char*>("write_failed"), payload_write_failed, nullptr,
     const_cast<char*>("Whether its write failed: its reads raise why (nvme_writes.cpp NOTE "
                       "[A failed write stays failed])."),
     nullptr},
    {const_cast<char*>("reading"), payload_reading, nullptr,
     const_cast<char*>("Whether a read is in flight or landed and not yet fetched."), nullptr},
    {const_cast<char*>("reading_on_device"), payload_reading_on_device, nullptr,
     const_cast<char*>("Whether that read is chained to its H2D in the engine (CUDA)."),
     nullptr},
    {const_cast<char*>("extent"), payload_extent, nullptr,
     const_cast<char*>("Where the bytes are in the store (the core's Extent)."), nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

#define PAYLOAD_MEMBER(field, name, doc) \
  {const_cast<char*>(name), T_OBJECT_EX, offsetof(NvmePayload, field), READONLY, \
   const_cast<char*>(doc)}

PyMemberDef payload_members[] = {
    PAYLOAD_MEMBER(nbytes_obj, "nbytes", "Bytes of the storage."),
    PAYLOAD_MEMBER(device, "device", "Where the bytes came from and go back to."),
    PAYLOAD_MEMBER(phase_obj, "phase", "Address % alignment of the bytes in memory."),
    PAYLOAD_MEMBER(cuda_obj, "cuda", "Whether `device` is a CUDA device."),
    {nullptr, 0, 0, 0, nullptr},
};

#undef PAYLOAD_MEMBER

// ------------------------------------------------------------------------------ buffer

struct ReadBuffer {
  PyObject_HEAD
  std::shared_ptr<HostRegion> memory;
  uint64_t skip;
  uint64_t nbytes;
};

void read_buffer_dealloc(PyObject* obj) {
  reinterpret_cast<ReadBuffer*>(obj)->memory.~shared_ptr();
  Py_TYPE(obj)->tp_free(obj);
}

// A writable 1-D byte view of the bytes; the view holds this object, which holds the memory.
int read_buffer_getbuffer(PyObject* obj, Py_buffer* view, int flags) {
  auto* self = reinterpret_cast<ReadBuffer*>(obj);
  return PyBuffer_FillInfo(view, obj, self->memory->data() + self->skip,
                           static_cast<Py_ssize_t>(self->nbytes), /*readonly=*/0, flags);
}

PyBufferProcs read_buffer_procs = {read_buffer_getbuffer, nullptr};

Py_ssize_t read_buffer_len(PyObject* obj) {
  return static_cast<Py_ssize_t>(reinterpret_cast<ReadBuffer*>(obj)->nbytes);
}

PySequenceMethods read_buffer_sequence = length_only(read_buffer_len);

PyTypeObject read_buffer_type = [] {
  PyTypeObject type = plain_type(
      "offload._C.ReadBuffer", sizeof(ReadBuffer),
      "A host read's bytes (the buffer protocol), holding their memory while it lives.",
      nullptr, read_buffer_dealloc);
  type.tp_as_buffer = &read_buffer_procs;
  type.tp_as_sequence = &read_buffer_sequence;
  return type;
}();

}  // namespace

PyTypeObject nvme_payload_type = [] {
  PyTypeObject type = plain_type(
      "offload._C.NvmePayload", sizeof(NvmePayload),
      "One storage's bytes in the nvme tier (made by its NvmeTransfers; tiers/nvme.py).",
      nullptr, payload_dealloc);
  type.tp_members = payload_members;
  type.tp_getset = payload_getset;
  type.tp_weaklistoffset = offsetof(NvmePayload, weakrefs);
  return type;
}();

PyObject* new_payload(uint64_t nbytes, PyObject* device, uint64_t phase, bool cuda,
                      std::shared_ptr<Extent> extent, PyObject* foreign_extent) {
  PyObject* nbytes_obj = PyLong_FromUnsignedLongLong(nbytes);
  PyObject* phase_obj = nbytes_obj != nullptr ? PyLong_FromUnsignedLongLong(phase) : nullptr;
  PyObject* obj = phase_obj != nullptr ? nvme_payload_type.tp_alloc(&nvme_payload_type, 0)
                                       : nullptr;   // zero-filled
  if (obj == nullptr) {
    Py_XDECREF(nbytes_obj);
    Py_XDECREF(phase_obj);
    return nullptr;
  }
  auto* self = reinterpret_cast<NvmePayload*>(obj);
  self->nbytes_obj = nbytes_obj;
  self->device = Py_NewRef(device);
  self->phase_obj = phase_obj;
  self->cuda_obj = as_bool(cuda);
  self->nbytes = nbytes;
  self->phase = phase;
  self->cuda = cuda;
  self->released = false;
  new (&self->extent) std::shared_ptr<Extent>(std::move(extent));
  self->foreign_extent = Py_XNewRef(foreign_extent);
  new (&self->write) std::shared_ptr<NvmeWrite>();
  new (&self->read) std::shared_ptr<NvmeRead>();
  new (&self->write_error) std::exception_ptr();
  ++payloads_alive;
  return obj;
}

PyObject* new_read_buffer(std::shared_ptr<HostRegion> memory, uint64_t skip, uint64_t nbytes) {
  PyObject* obj = read_buffer_type.tp_alloc(&read_buffer_type, 0);
  if (obj == nullptr) return nullptr;
  auto* self = reinterpret_cast<ReadBuffer*>(obj);
  new (&self->memory) std::shared_ptr<HostRegion>(std::move(memory));
  self->skip = skip;
  self->nbytes = nbytes;
  return obj;
}

void bind_nvme_payload(py::module_& m) {
  add_type(m, "NvmePayload", nvme_payload_type);
  add_type(m, "ReadBuffer", read_buffer_type);
  // A class attribute, as Payload.resident: the bytes left the device's memory.
  if (PyDict_SetItemString(nvme_payload_type.tp_dict, "resident", Py_False) < 0)
    throw py::error_already_set();
  PyType_Modified(&nvme_payload_type);
  m.def("_nvme_records_alive",
        [] { return py::make_tuple(payloads_alive, nvme_writes_alive, nvme_reads_alive); },
        "(payloads, writes, reads) of the nvme tier alive now: the collector does not see "
        "them (tests/test_leaks.py).");
}

}  // namespace offload::bind
