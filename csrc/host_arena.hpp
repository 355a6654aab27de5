// One large host allocation (page-locked when a GPU is usable), sub-allocated into
// 4096-aligned blocks. Blocks share ownership of the arena, so memory stays valid while
// any block (or an in-flight I/O holding one) is alive, even after the arena's Python
// object is gone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>

#include "range_allocator.hpp"

namespace offload {

constexpr uint64_t kDefaultAlignment = 4096;

// RAII owner of the arena's backing memory.
class HostMemory {
 public:
  HostMemory(uint64_t nbytes, bool pinned);
  ~HostMemory();
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;
  char* data() const noexcept { return data_; }
  uint64_t nbytes() const noexcept { return nbytes_; }
  bool pinned() const noexcept { return pinned_; }

 private:
  char* data_ = nullptr;
  uint64_t nbytes_ = 0;
  bool pinned_ = false;
  int device_ = 0;  // pinned: the device whose context allocated it (freed there)
};

class HostArena;

// One sub-allocation. Returns its range to the arena when the last owner drops it
// (possibly on an I/O worker thread).
class HostRegion {
 public:
  HostRegion(std::shared_ptr<HostArena> arena, uint64_t offset, uint64_t nbytes);
  ~HostRegion();
  HostRegion(const HostRegion&) = delete;
  HostRegion& operator=(const HostRegion&) = delete;

  char* data() const noexcept;
  uint64_t nbytes() const noexcept { return nbytes_; }        // as requested
  uint64_t capacity_bytes() const noexcept { return capacity_; }  // rounded up; usable padding

 private:
  std::shared_ptr<HostArena> arena_;
  uint64_t offset_;
  uint64_t nbytes_;
  uint64_t capacity_;
};

class HostArena : public std::enable_shared_from_this<HostArena> {
 public:
  // pinned: nullopt pins iff CUDA is usable; true without a usable GPU throws.
  static std::shared_ptr<HostArena> create(uint64_t capacity_bytes, std::optional<bool> pinned);

  // nullptr when no contiguous range of round_up(nbytes) is free.
  std::shared_ptr<HostRegion> allocate(uint64_t nbytes);

  RangeStats stats() const { return allocator_.stats(); }
  void reset_peak() { allocator_.reset_peak(); }
  bool pinned() const noexcept { return memory_.pinned(); }
  char* base() const noexcept { return memory_.data(); }

 private:
  friend class HostRegion;
  HostArena(uint64_t capacity_bytes, bool pinned);

  HostMemory memory_;
  RangeAllocator allocator_;
};

// The Python-facing handle of a region. `release()` drops this handle's claim; the
// memory itself returns to the arena when every claim is gone (in-flight I/O holds its
// own). Once the buffer was exported to Python, release() is deferred to garbage
// collection of the handle: torch.frombuffer keeps a reference to the handle, not a
// buffer export, so freeing earlier could hand live tensor memory to another block.
class HostBlock {
 public:
  HostBlock(std::shared_ptr<HostRegion> region, uint64_t nbytes)
      : region_(std::move(region)), nbytes_(nbytes) {}

  // Throws UseAfterClose when released.
  const std::shared_ptr<HostRegion>& region() const;
  uint64_t nbytes() const noexcept { return nbytes_; }
  uintptr_t ptr() const { return reinterpret_cast<uintptr_t>(region()->data()); }
  bool released() const noexcept { return released_; }
  void mark_exported() noexcept { exported_ = true; }
  void release() noexcept;

 private:
  std::shared_ptr<HostRegion> region_;
  uint64_t nbytes_;
  bool exported_ = false;
  bool released_ = false;
};

}  // namespace offload
