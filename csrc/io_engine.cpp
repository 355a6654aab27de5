#include "io_engine.hpp"

#include <cstring>
#include <string>

#include "align.hpp"
#include "crc32c.hpp"
#include "error.hpp"
#include "thread_pool.hpp"

namespace offload {

void Throttle::acquire(uint64_t nbytes) {
  if (bytes_per_s_ == 0) return;
  Clock::time_point start;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Idle time does not accumulate credit: at most one chunk starts "early".
    start = std::max(Clock::now(), next_);
    next_ = start + std::chrono::duration_cast<Clock::duration>(
                        std::chrono::duration<double>(double(nbytes) / double(bytes_per_s_)));
  }
  std::this_thread::sleep_until(start);
}

IoEngine::IoEngine(size_t workers, uint64_t bounce_bytes, uint64_t bounce_alignment,
                   uint64_t max_inflight_bytes, uint64_t throttle_bytes_per_s)
    : bounce_bytes_(bounce_bytes),
      bounce_alignment_(bounce_alignment),
      max_inflight_bytes_(max_inflight_bytes),
      throttle_(throttle_bytes_per_s) {
  start_threads(threads_, workers, "NvmeStore I/O worker", [this] { worker_loop(); },
                [this] { stop(); });
}

IoEngine::~IoEngine() { stop(); }

void IoEngine::submit(std::vector<Chunk> chunks) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) throw UseAfterClose("NvmeStore is closed");
    for (auto& c : chunks) queue_.push_back(std::move(c));
  }
  cv_.notify_all();
}

void IoEngine::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

bool IoEngine::admissible() const {
  if (queue_.empty()) return false;
  // A chunk larger than the cap still runs when nothing else is in flight.
  return inflight_bytes_ == 0 || inflight_bytes_ + queue_.front().nbytes <= max_inflight_bytes_;
}

void IoEngine::worker_loop() {
  AlignedBuffer bounce;  // allocated on first unaligned chunk, reused after
  for (;;) {
    Chunk chunk;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return admissible() || (stopping_ && queue_.empty()); });
      if (queue_.empty()) return;
      chunk = std::move(queue_.front());
      queue_.pop_front();
      inflight_bytes_ += chunk.nbytes;
    }
    std::exception_ptr err;
    if (!chunk.request->failed()) {  // a failed request's remaining chunks are skipped
      try {
        if (bounce.data() == nullptr && chunk.slab->direct())
          bounce = AlignedBuffer(bounce_bytes_, bounce_alignment_);
        throttle_.acquire(chunk.nbytes);
        run_chunk(chunk, bounce);
      } catch (...) {
        err = std::current_exception();
      }
    }
    const uint64_t nbytes = chunk.nbytes;
    chunk.request->chunk_done(err);
    chunk.request.reset();
    {
      std::lock_guard<std::mutex> lock(mu_);
      inflight_bytes_ -= nbytes;
    }
    cv_.notify_all();
  }
}

void IoEngine::run_chunk(const Chunk& c, AlignedBuffer& bounce) {
  const SlabFile& slab = *c.slab;
  uint32_t crc = 0;
  if (c.write && c.sum) crc = crc32c(c.mem, c.nbytes);

  if (!slab.direct()) {
    if (c.write)
      slab.pwrite_full(c.mem, c.nbytes, c.file_offset);
    else
      slab.pread_full(c.mem, c.nbytes, c.file_offset);
  } else {
    const uint64_t align = slab.alignment();
    const uint64_t padded = align_up(c.nbytes, align);
    const bool aligned_mem = reinterpret_cast<uintptr_t>(c.mem) % align == 0;
    if (aligned_mem && padded <= c.mem_capacity) {
      if (c.write)
        slab.pwrite_full(c.mem, padded, c.file_offset);
      else
        slab.pread_full(c.mem, padded, c.file_offset);
    } else {
      // Unaligned address or a tail shorter than the alignment: go through the bounce
      // buffer (chunks never exceed it: they are cut at stripe boundaries).
      if (padded > bounce.nbytes())
        throw std::logic_error("chunk of " + std::to_string(padded) +
                               " bytes exceeds the bounce buffer");
      if (c.write) {
        std::memcpy(bounce.data(), c.mem, c.nbytes);
        std::memset(bounce.data() + c.nbytes, 0, padded - c.nbytes);
        slab.pwrite_full(bounce.data(), padded, c.file_offset);
      } else {
        slab.pread_full(bounce.data(), padded, c.file_offset);
        std::memcpy(c.mem, bounce.data(), c.nbytes);
      }
    }
  }

  if (c.write) {
    if (c.sum) *c.sum = ChunkSum{crc, c.nbytes, true};
    counters_.bytes_written.fetch_add(c.nbytes, std::memory_order_relaxed);
    return;
  }
  if (c.sum && c.sum->valid && c.sum->nbytes == c.nbytes) {
    const uint32_t got = crc32c(c.mem, c.nbytes);
    if (got != c.sum->crc)
      throw_io_error(EBADMSG,
                     "checksum mismatch: data read back from the NVMe slab differs from what "
                     "was written (the slab file was modified or the disk returned corrupt "
                     "data; stored crc32c " + std::to_string(c.sum->crc) + ", read " +
                         std::to_string(got) + ")",
                     slab.label(), static_cast<int64_t>(c.file_offset),
                     static_cast<int64_t>(c.nbytes));
  }
  counters_.bytes_read.fetch_add(c.nbytes, std::memory_order_relaxed);
}

}  // namespace offload
