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
  const size_t count = chunks.size();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) throw UseAfterClose("NvmeStore is closed");
    for (auto& c : chunks) queue_.push_back(std::move(c));
  }
  // Wake only as many workers as there is work: on a machine with few cores every spurious
  // wake-up preempts a compute thread (and stalls its OpenMP team at the next barrier).
  if (count == 1)
    cv_.notify_one();
  else
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
    // The in-flight cap may now admit one more chunk for a waiting worker; this worker
    // itself checks the queue again right away.
    cv_.notify_one();
  }
}

// Memory and file offset share their phase: the aligned middle moves in place, and each
// partial sector at an end goes through the bounce buffer as one whole sector. The rest of
// such a sector belongs to the same extent (its phase padding, or the allocator's rounding),
// so it is zero-filled on write rather than read-modify-written.
void IoEngine::run_in_place(const Chunk& c, AlignedBuffer& bounce) {
  const SlabFile& slab = *c.slab;
  const uint64_t align = slab.alignment();
  auto edge = [&](char* mem, uint64_t offset, uint64_t n) {
    const uint64_t base = offset / align * align;
    counters_.bytes_bounced.fetch_add(n, std::memory_order_relaxed);
    if (c.write) {
      std::memset(bounce.data(), 0, align);
      std::memcpy(bounce.data() + (offset - base), mem, n);
      slab.pwrite_full(bounce.data(), align, base);
    } else {
      slab.pread_full(bounce.data(), align, base);
      std::memcpy(mem, bounce.data() + (offset - base), n);
    }
  };
  char* mem = c.mem;
  uint64_t offset = c.file_offset;
  uint64_t left = c.nbytes;
  const uint64_t head = std::min(left, (align - offset % align) % align);
  if (head > 0) {
    edge(mem, offset, head);
    mem += head;
    offset += head;
    left -= head;
  }
  uint64_t body = left / align * align;
  // A partial last sector moves in place too when the memory extends that far.
  if (left > body && static_cast<uint64_t>(mem - c.mem) + align_up(left, align) <= c.mem_capacity)
    body = align_up(left, align);
  if (body > 0) {
    if (c.write)
      slab.pwrite_full(mem, body, offset);
    else
      slab.pread_full(mem, body, offset);
  }
  if (left > body) edge(mem + body, offset + body, left - body);
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
    const uint64_t start = c.file_offset % align;
    // A chunk that straddles one sector boundary with both ends partial (a small tensor,
    // or a transfer's small first chunk) is two partial sectors and nothing else: in place
    // that is two system calls through the bounce buffer, bounced whole it is one.
    const bool two_partial = start != 0 && start + c.nbytes > align &&
                             start + c.nbytes <= 2 * align && 2 * align <= bounce.nbytes();
    if (!two_partial && reinterpret_cast<uintptr_t>(c.mem) % align == start) {
      run_in_place(c, bounce);
    } else {
      // Address and file offset out of phase (or two partial sectors): every byte goes
      // through the bounce buffer (chunks never exceed it: they are cut at stripe boundaries).
      const uint64_t span = align_up(start + c.nbytes, align);
      if (span > bounce.nbytes())
        throw std::logic_error("chunk of " + std::to_string(span) +
                               " bytes exceeds the bounce buffer");
      const uint64_t base = c.file_offset - start;
      counters_.bytes_bounced.fetch_add(c.nbytes, std::memory_order_relaxed);
      if (c.write) {
        std::memset(bounce.data(), 0, span);
        std::memcpy(bounce.data() + start, c.mem, c.nbytes);
        slab.pwrite_full(bounce.data(), span, base);
      } else {
        slab.pread_full(bounce.data(), span, base);
        std::memcpy(c.mem, bounce.data() + start, c.nbytes);
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
