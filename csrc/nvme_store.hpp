// The NVMe tier: one slab file per directory, striped RAID-0 style in units of
// chunk_bytes, carved into extents by a RangeAllocator, read and written asynchronously
// by an IoEngine. CUDA builds can chain a write behind a D2H copy's event, and an H2D
// copy behind a read, without Python in the loop.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "direct_io.hpp"
#include "host_arena.hpp"
#include "io_engine.hpp"
#include "io_request.hpp"
#include "range_allocator.hpp"
#include "thread_pool.hpp"

namespace offload {

struct StoreOptions {
  size_t workers = 4;
  uint64_t chunk_bytes = 1 << 20;
  uint64_t max_inflight_bytes = 64 << 20;
  bool checksum = false;
  uint64_t throttle_bytes_per_s = 0;
  bool direct = true;
  // The largest span one transfer of merged small chunks may cover (io_engine.cpp NOTE
  // [Small chunks travel together]); 0: every chunk is a transfer of its own.
  uint64_t coalesce_bytes = 256 * 1024;
};

// A range of the striped slab space. Returns itself to the allocator when the last
// owner (the Python handle or an in-flight request) drops it.
//
// The data starts `phase` bytes into the reserved (aligned) range. With O_DIRECT, memory
// whose address has the same phase (address % alignment) moves straight between RAM and
// disk: only the partial sectors at the two ends go through a bounce buffer, so a tensor
// is written from, and read back into, its own memory with no staging copy.
class ExtentRange {
 public:
  ExtentRange(std::shared_ptr<RangeAllocator> allocator, uint64_t base, uint64_t reserved,
              uint64_t phase, uint64_t nbytes, size_t checksum_slots)
      : allocator_(std::move(allocator)), base_(base), reserved_(reserved), offset_(base + phase),
        nbytes_(nbytes), sums_(checksum_slots) {}
  ~ExtentRange();
  ExtentRange(const ExtentRange&) = delete;
  ExtentRange& operator=(const ExtentRange&) = delete;

  // Logical offset of the first data byte (base + phase).
  uint64_t offset() const noexcept { return offset_; }
  uint64_t nbytes() const noexcept { return nbytes_; }
  const RangeAllocator* allocator() const noexcept { return allocator_.get(); }
  ChunkSum* sum(size_t index) { return sums_.empty() ? nullptr : &sums_.at(index); }

 private:
  std::shared_ptr<RangeAllocator> allocator_;
  uint64_t base_;      // what the allocator handed out (aligned)
  uint64_t reserved_;  // and its size: phase + nbytes, before the allocator's rounding
  uint64_t offset_;
  uint64_t nbytes_;
  std::vector<ChunkSum> sums_;
};

// Python-facing handle of an extent; release() is idempotent.
class Extent {
 public:
  explicit Extent(std::shared_ptr<ExtentRange> range) : nbytes_(range->nbytes()), range_(std::move(range)) {}
  const std::shared_ptr<ExtentRange>& range() const;  // throws UseAfterClose when released
  uint64_t nbytes() const noexcept { return nbytes_; }
  bool released() const noexcept { return !range_; }
  void release() noexcept { range_.reset(); }

 private:
  uint64_t nbytes_;
  std::shared_ptr<ExtentRange> range_;
};

class NvmeStore {
 public:
  // Opens and reserves the slabs; `notes` receives messages for Python's logging.
  NvmeStore(const std::vector<std::string>& dirs, uint64_t capacity_bytes,
            const StoreOptions& options, std::vector<LogNote>* notes);
  ~NvmeStore();
  NvmeStore(const NvmeStore&) = delete;
  NvmeStore& operator=(const NvmeStore&) = delete;

  // nullptr when no contiguous range is free. `phase` (< alignment()): the data starts
  // that many bytes past an aligned offset; see ExtentRange.
  std::shared_ptr<ExtentRange> allocate(uint64_t nbytes, uint64_t phase = 0);

  std::shared_ptr<IoRequest> write(const Extent& extent, const HostBlock& block);
  std::shared_ptr<IoRequest> read(const Extent& extent, const HostBlock& block);
  std::shared_ptr<IoRequest> write_ptr(const Extent& extent, uintptr_t ptr, uint64_t nbytes);
  // Several write_ptr at once: one hand-off to the engine (one lock, one wake-up) for all.
  // Validates every write before submitting any; returns their requests in order.
  std::vector<std::shared_ptr<IoRequest>> write_ptr_many(
      const std::vector<const Extent*>& extents, const std::vector<uintptr_t>& ptrs,
      const std::vector<uint64_t>& nbytes);
  std::shared_ptr<IoRequest> read_ptr(const Extent& extent, uintptr_t ptr, uint64_t nbytes);
  // read_ptr into `region` from byte `skip` on, the request holding the region until it is
  // done: memory that a caller who lets go of the read early (a released payload's) need
  // not keep alive itself.
  std::shared_ptr<IoRequest> read_into(const Extent& extent, std::shared_ptr<HostRegion> region,
                                       uint64_t skip, uint64_t nbytes);
  std::shared_ptr<IoRequest> write_after_event(const Extent& extent, const HostBlock& block,
                                               uintptr_t event);
  std::shared_ptr<IoRequest> read_then_h2d(const Extent& extent, const HostBlock& block,
                                           uintptr_t dst_ptr, uint64_t nbytes, uintptr_t stream,
                                           uintptr_t event);

  // Waits for every request, stops the workers, closes the slabs. Idempotent.
  void close();
  // In a forked child: closes the inherited slab descriptors (so the parent closing a slab
  // frees its disk space while the child lives) and marks the store closed. The I/O threads
  // were not forked: their objects are leaked, never joined, and no lock is taken (one held
  // by a parent thread at fork time stays locked here).
  void abandon_after_fork() noexcept;
  bool closed() const noexcept { return closed_.load(); }

  // Test hook: flips one byte of the extent's data on disk, behind the store's back.
  void corrupt_for_test(const Extent& extent, uint64_t offset);
  // Test hook: IoEngine::hold_for_test.
  void hold_workers_for_test(bool held);

  bool direct() const noexcept;
  uint64_t alignment() const noexcept { return alignment_; }
  std::vector<std::string> paths() const;
  uint64_t capacity_bytes() const noexcept { return allocator_->capacity_bytes(); }
  RangeStats stats() const { return allocator_->stats(); }
  uint64_t bytes_written() const noexcept { return engine_->counters().bytes_written.load(); }
  uint64_t bytes_read() const noexcept { return engine_->counters().bytes_read.load(); }
  uint64_t bytes_bounced() const noexcept { return engine_->counters().bytes_bounced.load(); }
  uint64_t transfers() const noexcept { return engine_->counters().transfers.load(); }
  const StoreOptions& options() const noexcept { return options_; }
  uint64_t stripe_bytes() const noexcept { return stripe_bytes_; }

 private:
  struct Location {
    const SlabFile* slab;
    uint64_t file_offset;
    uint64_t contiguous_bytes;  // until the next stripe boundary
  };
  Location locate(uint64_t logical_offset) const;
  const std::shared_ptr<ExtentRange>& checked_range(const Extent& extent) const;
  void check_open() const;
  // Splits a transfer into chunks at stripe boundaries.
  std::vector<Chunk> make_chunks(ExtentRange& range, char* mem, uint64_t nbytes,
                                 uint64_t mem_capacity, bool write,
                                 const std::shared_ptr<IoRequest>& request);
  // A request with its chunks, checked (open store, extent of this store, size, pointer)
  // and holding the extent and `memory_owner`, not yet queued.
  struct Prepared {
    std::shared_ptr<IoRequest> request;
    std::vector<Chunk> chunks;
  };
  Prepared prepare(const Extent& extent, char* mem, uint64_t nbytes, uint64_t mem_capacity,
                   bool write, std::shared_ptr<const void> memory_owner);
  // Queues the chunks, or completes a request that has none (zero bytes).
  static void dispatch(IoEngine& engine, IoRequest& request, std::vector<Chunk> chunks);
  std::shared_ptr<IoRequest> submit(const Extent& extent, char* mem, uint64_t nbytes,
                                    uint64_t mem_capacity, bool write,
                                    std::shared_ptr<const void> memory_owner);
  // Two single-thread pools, so that a write waiting for its D2H event never queues
  // behind a prefetch holding its pinned block until the H2D copy is done (or back).
  enum class Stager { kWrite, kRelease };
  // The pool, started on first use; a copy taken under stager_mu_ (close() may drop the
  // store's reference concurrently). Throws UseAfterClose once the store is closed.
  std::shared_ptr<ThreadPool> stager(Stager which);

  StoreOptions options_;
  std::vector<std::unique_ptr<SlabFile>> slabs_;
  uint64_t alignment_ = 4096;
  uint64_t stripe_bytes_ = 0;
  uint64_t slab_bytes_ = 0;
  std::shared_ptr<RangeAllocator> allocator_;
  std::shared_ptr<InflightTracker> tracker_ = std::make_shared<InflightTracker>();
  std::unique_ptr<IoEngine> engine_;
  std::mutex stager_mu_;
  std::shared_ptr<ThreadPool> write_stager_;    // waits for D2H events, then queues writes
  std::shared_ptr<ThreadPool> release_stager_;  // holds pinned blocks until H2D copies end
  std::atomic<bool> closed_{false};
  std::atomic<bool> forked_{false};   // closed by abandon_after_fork: said in its error
  std::mutex close_mu_;
};

}  // namespace offload
