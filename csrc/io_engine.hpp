// The worker pool that moves chunks between memory and slab files. Workers issue
// blocking pread/pwrite, so `workers` is the queue depth the device sees (workers = 16
// matches fio's iodepth=16). A cap on bytes in flight bounds it further, and an optional
// pacing limit caps throughput for shared disks.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "direct_io.hpp"
#include "io_request.hpp"

namespace offload {

// CRC of one chunk as written, so a read of the same chunk can be verified.
struct ChunkSum {
  uint32_t crc = 0;
  uint64_t nbytes = 0;
  bool valid = false;
};

struct Chunk {
  const SlabFile* slab = nullptr;
  uint64_t file_offset = 0;  // aligned to slab->alignment()
  char* mem = nullptr;
  uint64_t nbytes = 0;
  // Bytes addressable at `mem` (>= nbytes). Arena blocks are padded to 4096, so direct
  // I/O may run past `nbytes` into the padding instead of going through a bounce buffer.
  uint64_t mem_capacity = 0;
  bool write = false;
  ChunkSum* sum = nullptr;  // nullptr: no checksums
  std::shared_ptr<IoRequest> request;
};

// Spaces out chunk starts so the long-run rate stays at or below `bytes_per_s`.
class Throttle {
 public:
  explicit Throttle(uint64_t bytes_per_s) : bytes_per_s_(bytes_per_s) {}
  // Waits for the slot of a chunk of `nbytes`; false when `request` (if any) failed
  // meanwhile (a cancel: the chunk is skipped).
  bool acquire(uint64_t nbytes, const IoRequest* request);

 private:
  using Clock = std::chrono::steady_clock;
  const uint64_t bytes_per_s_;
  std::mutex mu_;
  Clock::time_point next_ = Clock::now();
};

struct EngineCounters {
  std::atomic<uint64_t> bytes_written{0};
  std::atomic<uint64_t> bytes_read{0};
  // Payload bytes copied through a bounce buffer (memory out of phase with the file, or a
  // partial sector at an end): CPU work that in-place transfers avoid.
  std::atomic<uint64_t> bytes_bounced{0};
  // Reads and writes issued to the slab files (one per pread/pwrite the engine asks for):
  // how many the merging of small chunks saves.
  std::atomic<uint64_t> transfers{0};
};

class IoEngine {
 public:
  // `block_bytes`: the store's alignment, which its bounce buffers have, and its
  // allocator's unit (no two extents share such a block). `coalesce_bytes`: the largest span
  // one transfer of merged small chunks may cover (NOTE [Small chunks travel together] in
  // io_engine.cpp); 0: no merging.
  IoEngine(size_t workers, uint64_t bounce_bytes, uint64_t block_bytes,
           uint64_t max_inflight_bytes, uint64_t throttle_bytes_per_s, uint64_t coalesce_bytes);
  ~IoEngine();  // stop()
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // Throws UseAfterClose after stop().
  void submit(std::vector<Chunk> chunks);
  // Finishes queued chunks, then joins the workers. Idempotent.
  void stop();
  // Test hook: while held, workers take nothing from the queue (what they run goes on), so
  // a test queues chunks one by one as a busy worker would find them, with no race against
  // a worker that wakes in between. stop() releases the hold (so does NvmeStore::close).
  void hold_for_test(bool held);

  const EngineCounters& counters() const noexcept { return counters_; }

 private:
  void worker_loop();
  void run_chunk(const Chunk& chunk, AlignedBuffer& bounce);
  void run_in_place(const Chunk& chunk, AlignedBuffer& bounce);
  // What a worker takes at once: the queue's front chunk, and the small neighbours merged
  // behind it (NOTE [Small chunks travel together] in io_engine.cpp).
  struct Run {
    std::vector<Chunk> chunks;
    uint64_t lo = 0, hi = 0;   // the whole blocks the chunks touch in their slab file
    uint64_t nbytes = 0;       // their payload bytes (the in-flight count they hold)
  };
  // Moves a run of small adjacent chunks through the bounce buffer as one transfer; the
  // error each chunk ends with goes into `errors` (same order).
  void run_merged(const Run& run, AlignedBuffer& bounce, std::vector<std::exception_ptr>& errors);
  void write_slab(const SlabFile& slab, const void* buf, uint64_t nbytes, uint64_t offset);
  void read_slab(const SlabFile& slab, void* buf, uint64_t nbytes, uint64_t offset);
  // The checksum and byte count of a chunk moved: a write records its sum, a read checks it.
  void finish_write(const Chunk& c, uint32_t crc);
  void finish_read(const Chunk& c);
  bool admissible() const;  // caller holds mu_
  // Pops the queue's front chunk into `run` (its chunks empty), and behind it the queued
  // chunks that extend the run's span (caller holds mu_).
  void take_run(Run& run);
  bool mergeable(const Chunk& c) const;
  // The whole blocks (block_bytes_) a chunk's bytes touch in its slab file.
  uint64_t span_start(const Chunk& c) const;
  uint64_t span_end(const Chunk& c) const;

  const uint64_t bounce_bytes_;
  const uint64_t max_inflight_bytes_;
  const uint64_t coalesce_bytes_;   // <= bounce_bytes_
  const uint64_t block_bytes_;      // the bounce buffers' alignment, the allocator's unit
  Throttle throttle_;
  EngineCounters counters_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Chunk> queue_;
  uint64_t inflight_bytes_ = 0;
  bool stopping_ = false;
  bool held_ = false;   // hold_for_test
  std::vector<std::thread> threads_;
};

}  // namespace offload
