#include "range_allocator.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "align.hpp"
#include "error.hpp"

namespace offload {

RangeAllocator::RangeAllocator(uint64_t capacity_bytes, uint64_t granule_bytes)
    : capacity_(capacity_bytes), granule_(granule_bytes) {
  if (granule_bytes == 0 || (granule_bytes & (granule_bytes - 1)) != 0)
    throw InvalidArgument("granule_bytes must be a power of two, got " +
                          std::to_string(granule_bytes));
  if (capacity_bytes == 0 || capacity_bytes % granule_bytes != 0)
    throw InvalidArgument("capacity_bytes must be a positive multiple of " +
                          std::to_string(granule_bytes) + ", got " +
                          std::to_string(capacity_bytes));
}

uint64_t RangeAllocator::round_up(uint64_t nbytes) const noexcept {
  return nbytes == 0 ? granule_ : align_up(nbytes, granule_);
}

void RangeAllocator::insert_hole(uint64_t offset, uint64_t size) {
  holes_by_offset_.emplace(offset, size);
  holes_by_size_.emplace(size, offset);
}

void RangeAllocator::erase_hole(std::map<uint64_t, uint64_t>::iterator it) {
  holes_by_size_.erase({it->second, it->first});
  holes_by_offset_.erase(it);
}

std::optional<uint64_t> RangeAllocator::allocate(uint64_t nbytes) {
  if (nbytes > capacity_) return std::nullopt;
  const uint64_t size = round_up(nbytes);
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<uint64_t> offset;
  if (!holes_by_size_.empty()) {
    auto best = holes_by_size_.lower_bound({size, 0});
    if (best != holes_by_size_.end()) {
      const uint64_t hole_size = best->first;
      const uint64_t hole_offset = best->second;
      erase_hole(holes_by_offset_.find(hole_offset));
      if (hole_size > size) insert_hole(hole_offset + size, hole_size - size);
      offset = hole_offset;
    }
  }
  if (!offset && capacity_ - tail_start_ >= size) {
    offset = tail_start_;
    tail_start_ += size;
  }
  if (!offset) return std::nullopt;
  used_ += size;
  peak_ = std::max(peak_, used_);
  return offset;
}

void RangeAllocator::free(uint64_t offset, uint64_t nbytes) {
  const uint64_t size = round_up(nbytes);
  std::lock_guard<std::mutex> lock(mu_);
  if (offset % granule_ != 0 || offset + size > tail_start_ || size > used_)
    throw std::logic_error("RangeAllocator::free: range [" + std::to_string(offset) + ", +" +
                           std::to_string(size) + ") was not allocated");
  used_ -= size;
  uint64_t start = offset;
  uint64_t end = offset + size;
  auto next = holes_by_offset_.lower_bound(start);
  if (next != holes_by_offset_.end() && next->first < end)
    throw std::logic_error("RangeAllocator::free: range at offset " + std::to_string(offset) +
                           " overlaps a free range (double free?)");
  if (next != holes_by_offset_.end() && next->first == end) {
    end += next->second;
    auto victim = next++;
    erase_hole(victim);
  }
  if (next != holes_by_offset_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second > start)
      throw std::logic_error("RangeAllocator::free: range at offset " + std::to_string(offset) +
                             " overlaps a free range (double free?)");
    if (prev->first + prev->second == start) {
      start = prev->first;
      erase_hole(prev);
    }
  }
  if (end == tail_start_) {
    tail_start_ = start;  // stack-like free: the tail grows down, no hole recorded
  } else {
    insert_hole(start, end - start);
  }
}

RangeStats RangeAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  RangeStats s;
  s.capacity_bytes = capacity_;
  s.used_bytes = used_;
  s.peak_bytes = peak_;
  s.free_bytes = capacity_ - used_;
  s.largest_free_bytes = capacity_ - tail_start_;
  if (!holes_by_size_.empty())
    s.largest_free_bytes = std::max(s.largest_free_bytes, holes_by_size_.rbegin()->first);
  s.hole_count = holes_by_offset_.size();
  return s;
}

void RangeAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = used_;
}

}  // namespace offload
