// Sub-allocates [0, capacity) in multiples of a granule. Serves both the host arena
// (offsets into one big buffer) and the NVMe store (offsets into the striped slab space).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <utility>

namespace offload {

struct RangeStats {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t peak_bytes = 0;
  uint64_t free_bytes = 0;
  uint64_t largest_free_bytes = 0;
  uint64_t hole_count = 0;  // free ranges below the top (excludes the tail)
};

// Thread-safe: ranges are freed from I/O worker threads when the last user drops them.
//
// Layout: everything at or above `tail_start_` is free ("the tail"); free ranges below
// it are "holes". Fast path (stack-like use: forward allocates in order, backward frees
// in reverse): with no holes, allocation bumps `tail_start_` and freeing the topmost
// range lowers it, both O(1). Otherwise best fit over the holes (smallest hole that
// fits, lowest address on ties), falling back to the tail; frees coalesce with both
// neighbours, and a hole that reaches the tail is absorbed into it.
class RangeAllocator {
 public:
  RangeAllocator(uint64_t capacity_bytes, uint64_t granule_bytes);
  RangeAllocator(const RangeAllocator&) = delete;
  RangeAllocator& operator=(const RangeAllocator&) = delete;

  // Offset of a range of round_up(nbytes) bytes (at least one granule), or nullopt when
  // no contiguous free range is large enough.
  std::optional<uint64_t> allocate(uint64_t nbytes);
  // `nbytes` as passed to allocate(). Throws std::logic_error on a range that is not
  // allocated (double free), which would otherwise corrupt the free lists silently.
  void free(uint64_t offset, uint64_t nbytes);

  RangeStats stats() const;
  void reset_peak();
  uint64_t granule_bytes() const noexcept { return granule_; }
  uint64_t capacity_bytes() const noexcept { return capacity_; }
  uint64_t round_up(uint64_t nbytes) const noexcept;

 private:
  void insert_hole(uint64_t offset, uint64_t size);  // caller holds mu_; no coalescing
  void erase_hole(std::map<uint64_t, uint64_t>::iterator it);

  mutable std::mutex mu_;
  const uint64_t capacity_;
  const uint64_t granule_;
  uint64_t tail_start_ = 0;
  uint64_t used_ = 0;
  uint64_t peak_ = 0;
  std::map<uint64_t, uint64_t> holes_by_offset_;          // offset -> size
  std::set<std::pair<uint64_t, uint64_t>> holes_by_size_;  // (size, offset)
};

}  // namespace offload
