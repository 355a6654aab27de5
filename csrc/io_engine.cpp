#include "io_engine.hpp"

#include <sched.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#include "align.hpp"
#include "crc32c.hpp"
#include "error.hpp"
#include "thread_pool.hpp"

namespace offload {

namespace {

// Copies a write's source bytes into our buffer. The source may be a saved tensor's own
// memory (a direct write), which its storage may have freed since the write was handed
// over (nvme_transfers.hpp NOTE [A source that moved]): a plain memcpy from it would fault
// and kill the process. process_vm_readv on ourselves copies in the kernel, which reports
// an unmapped page as EFAULT instead: thrown as the IoError the in-place pwrite of the same
// memory would give, which retire() answers by writing the storage's bytes again from
// where they are now. Where the call fails otherwise (a seccomp filter's EPERM, ENOSYS or
// whatever errno it chose): memcpy from then on, as before.
void copy_source(char* to, const char* from, uint64_t nbytes) {
  static std::atomic<bool> refused{false};
  if (nbytes == 0) return;
  if (!refused.load(std::memory_order_relaxed)) {
    iovec local{to, nbytes};
    iovec remote{const_cast<char*>(from), nbytes};
    const ssize_t got = ::process_vm_readv(::getpid(), &local, 1, &remote, 1, 0);
    if (got == static_cast<ssize_t>(nbytes)) return;
    if (got >= 0 || errno == EFAULT)   // a short copy stopped at an unmapped page
      throw_io_error(EFAULT, "reading a write's source memory (freed or moved since the "
                             "write was handed over?)", {}, -1, static_cast<int64_t>(nbytes));
    refused.store(true, std::memory_order_relaxed);
  }
  std::memcpy(to, from, nbytes);
}

// The CRC-32C of a write's source, read the way copy_source reads it, a stack buffer at a
// time: the checksum of a direct write reads the tensor's own memory, which may have been
// freed since (see copy_source). One more copy of each byte written, paid only with
// checksums on.
uint32_t source_crc32c(const char* from, uint64_t nbytes) {
  constexpr uint64_t kPiece = 64 * 1024;
  alignas(64) char piece[kPiece];
  uint32_t crc = 0;
  for (uint64_t done = 0; done < nbytes; done += kPiece) {
    const uint64_t n = std::min(kPiece, nbytes - done);
    copy_source(piece, from + done, n);
    crc = crc32c(piece, n, crc);
  }
  return crc;
}

}  // namespace

bool Throttle::acquire(uint64_t nbytes, const IoRequest* request) {
  if (bytes_per_s_ == 0) return true;
  Clock::time_point start;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Idle time does not accumulate credit: at most one chunk starts "early".
    start = std::max(Clock::now(), next_);
    next_ = start + std::chrono::duration_cast<Clock::duration>(
                        std::chrono::duration<double>(double(nbytes) / double(bytes_per_s_)));
  }
  // In slices, so a chunk cancelled meanwhile goes at once (its slot is not given back).
  constexpr auto kSlice = std::chrono::milliseconds(20);
  for (auto now = Clock::now(); now < start; now = Clock::now()) {
    if (request != nullptr && request->failed()) return false;
    std::this_thread::sleep_until(std::min(start, now + kSlice));
  }
  return request == nullptr || !request->failed();
}

IoEngine::IoEngine(size_t workers, uint64_t bounce_bytes, uint64_t block_bytes,
                   uint64_t max_inflight_bytes, uint64_t throttle_bytes_per_s,
                   uint64_t coalesce_bytes)
    : bounce_bytes_(bounce_bytes),
      max_inflight_bytes_(max_inflight_bytes),
      coalesce_bytes_(std::min(coalesce_bytes, bounce_bytes)),
      block_bytes_(block_bytes),
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
  cv_.notify_one();   // NOTE [Chained wake-ups]
}

void IoEngine::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
    held_ = false;   // the queue drains before the workers stop
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

void IoEngine::hold_for_test(bool held) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    held_ = held;
  }
  if (!held) cv_.notify_one();   // NOTE [Chained wake-ups]
}

bool IoEngine::admissible() const {
  if (queue_.empty() || held_) return false;
  // A chunk larger than the cap still runs when nothing else is in flight.
  return inflight_bytes_ == 0 || inflight_bytes_ + queue_.front().nbytes <= max_inflight_bytes_;
}

// NOTE [Workers do not preempt]
// A worker wakes for every batch of chunks. Under the default policy a waking thread may
// preempt the thread running on its CPU, and that is usually the training thread issuing
// the next op: its step then pays for the worker's context switch and cache misses.
// SCHED_BATCH marks a worker as throughput work: the scheduler runs it on an idle CPU (or
// at the running thread's next tick) but never preempts on its wake-up. A worker somebody
// waits on still runs at once, since the waiter sleeps and frees its CPU. Best effort: an
// unsupported policy leaves the worker as it was.
static void run_as_batch_work() {
#ifdef SCHED_BATCH
  sched_param param{};
  param.sched_priority = 0;
  (void)sched_setscheduler(0, SCHED_BATCH, &param);   // 0: the calling thread on Linux
#endif
}

// NOTE [Chained wake-ups]
// A submission wakes one worker, and a worker that takes work and leaves more that it may
// start wakes one more: as many workers run as there is work for, however many chunks one
// submission queues (a batch of small chunks may all go to one worker as one transfer).
// On a machine with few cores every spurious wake-up preempts a compute thread (and stalls
// its OpenMP team at the next barrier). A worker that finishes needs no wake-up: it looks
// at the queue again itself.
//
// NOTE [Small chunks travel together]
// Every pread/pwrite costs a system call and, on a virtual machine, a doorbell to the
// virtual disk, more than the copy of a few KiB: a backward that reads 4 KiB tensors one at
// a time is bound by those calls, not by the disk. A worker therefore takes, behind the
// chunk at the queue's front, the queued chunks whose blocks extend the run's on the same
// slab in the same direction (a write batch, or the read-ahead's reads, which walk down),
// each spanning at most kSmallChunkBytes, the run spanning at most `coalesce_bytes`, and
// moves them as one transfer through its bounce buffer. An idle worker takes a chunk
// queued alone at once: runs form only while work waits anyway. Each chunk keeps its own checksum,
// byte count and outcome. A chunk spans whole blocks of the store's alignment (the
// allocator's unit, which may exceed a slab's sector): those belong to its extent alone (its
// phase padding or the allocator's rounding, as in run_in_place), so the gaps are zero-filled.
// Only neighbours in the queue merge: the FIFO order of everything else is kept.
constexpr uint64_t kSmallChunkBytes = 64 * 1024;

uint64_t IoEngine::span_start(const Chunk& c) const {
  return c.file_offset / block_bytes_ * block_bytes_;
}
uint64_t IoEngine::span_end(const Chunk& c) const {
  return align_up(c.file_offset + c.nbytes, block_bytes_);
}

bool IoEngine::mergeable(const Chunk& c) const {
  if (coalesce_bytes_ == 0 || !c.slab->direct() || c.request->failed()) return false;
  const uint64_t span = span_end(c) - span_start(c);
  return span <= kSmallChunkBytes && span <= coalesce_bytes_;
}

void IoEngine::take_run(Run& run) {
  auto take = [&] {
    inflight_bytes_ += queue_.front().nbytes;
    run.nbytes += queue_.front().nbytes;
    run.chunks.push_back(std::move(queue_.front()));
    queue_.pop_front();
  };
  run.lo = span_start(queue_.front());
  run.hi = span_end(queue_.front());
  run.nbytes = 0;
  take();
  if (!mergeable(run.chunks.front())) return;
  // Copied out: the pushes below may move the run's chunks.
  const SlabFile* slab = run.chunks.front().slab;
  const bool write = run.chunks.front().write;
  while (!queue_.empty()) {
    const Chunk& next = queue_.front();
    if (next.slab != slab || next.write != write || !mergeable(next)) break;
    uint64_t lo = run.lo, hi = run.hi;
    if (span_start(next) == hi)
      hi = span_end(next);
    else if (span_end(next) == lo)
      lo = span_start(next);
    else
      break;
    if (hi - lo > coalesce_bytes_ || inflight_bytes_ + next.nbytes > max_inflight_bytes_) break;
    run.lo = lo;
    run.hi = hi;
    take();
  }
}

void IoEngine::worker_loop() {
  run_as_batch_work();
  AlignedBuffer bounce;  // allocated on first unaligned chunk, reused after
  Run run;
  std::vector<std::exception_ptr> errors;
  for (;;) {
    bool more = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return admissible() || (stopping_ && queue_.empty()); });
      if (queue_.empty()) return;
      take_run(run);
      more = admissible();
    }
    if (more) cv_.notify_one();   // NOTE [Chained wake-ups]
    std::vector<Chunk>& chunks = run.chunks;
    errors.assign(chunks.size(), nullptr);
    // A failed request's remaining chunks are skipped (a run holds none: see mergeable).
    if (chunks.size() > 1 || !chunks.front().request->failed()) {
      try {
        if (bounce.data() == nullptr && chunks.front().slab->direct())
          bounce = AlignedBuffer(bounce_bytes_, block_bytes_);
        // (A single chunk cancelled while it waits for its slot is skipped too; a merged run
        // of several requests runs in its slot.)
        const bool go = throttle_.acquire(
            run.nbytes, chunks.size() == 1 ? chunks.front().request.get() : nullptr);
        if (chunks.size() > 1)
          run_merged(run, bounce, errors);
        else if (go)
          run_chunk(chunks.front(), bounce);
      } catch (...) {
        for (auto& e : errors)
          if (!e) e = std::current_exception();
      }
    }
    for (size_t i = 0; i < chunks.size(); ++i) chunks[i].request->chunk_done(errors[i]);
    chunks.clear();   // drops the requests, and what they keep alive
    std::lock_guard<std::mutex> lock(mu_);
    inflight_bytes_ -= run.nbytes;
  }
}

// NOTE [Small chunks travel together]
void IoEngine::run_merged(const Run& run, AlignedBuffer& bounce,
                          std::vector<std::exception_ptr>& errors) {
  const SlabFile& slab = *run.chunks.front().slab;
  const uint64_t lo = run.lo, hi = run.hi;
  if (hi - lo > bounce.nbytes())
    throw std::logic_error("merged run of " + std::to_string(hi - lo) +
                           " bytes exceeds the bounce buffer");
  char* buf = bounce.data();
  counters_.bytes_bounced.fetch_add(run.nbytes, std::memory_order_relaxed);
  if (run.chunks.front().write) {
    std::memset(buf, 0, hi - lo);
    for (size_t i = 0; i < run.chunks.size(); ++i) {
      const Chunk& c = run.chunks[i];
      try {
        copy_source(buf + (c.file_offset - lo), c.mem, c.nbytes);
      } catch (...) {
        errors[i] = std::current_exception();   // this chunk's source is gone: the others stand
      }
    }
    write_slab(slab, buf, hi - lo, lo);
    for (size_t i = 0; i < run.chunks.size(); ++i) {
      const Chunk& c = run.chunks[i];
      if (!errors[i]) finish_write(c, c.sum ? crc32c(buf + (c.file_offset - lo), c.nbytes) : 0);
    }
    return;
  }
  read_slab(slab, buf, hi - lo, lo);
  for (size_t i = 0; i < run.chunks.size(); ++i) {
    const Chunk& c = run.chunks[i];
    std::memcpy(c.mem, buf + (c.file_offset - lo), c.nbytes);
    try {
      finish_read(c);
    } catch (...) {
      errors[i] = std::current_exception();   // this chunk's checksum: the others stand
    }
  }
}

void IoEngine::write_slab(const SlabFile& slab, const void* buf, uint64_t nbytes,
                          uint64_t offset) {
  counters_.transfers.fetch_add(1, std::memory_order_relaxed);
  slab.pwrite_full(buf, nbytes, offset);
}

void IoEngine::read_slab(const SlabFile& slab, void* buf, uint64_t nbytes, uint64_t offset) {
  counters_.transfers.fetch_add(1, std::memory_order_relaxed);
  slab.pread_full(buf, nbytes, offset);
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
      copy_source(bounce.data() + (offset - base), mem, n);
      write_slab(slab, bounce.data(), align, base);
    } else {
      read_slab(slab, bounce.data(), align, base);
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
      write_slab(slab, mem, body, offset);
    else
      read_slab(slab, mem, body, offset);
  }
  if (left > body) edge(mem + body, offset + body, left - body);
}

void IoEngine::run_chunk(const Chunk& c, AlignedBuffer& bounce) {
  const SlabFile& slab = *c.slab;
  uint32_t crc = 0;
  if (c.write && c.sum) crc = source_crc32c(c.mem, c.nbytes);

  if (!slab.direct()) {
    if (c.write)
      write_slab(slab, c.mem, c.nbytes, c.file_offset);
    else
      read_slab(slab, c.mem, c.nbytes, c.file_offset);
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
        copy_source(bounce.data() + start, c.mem, c.nbytes);
        write_slab(slab, bounce.data(), span, base);
      } else {
        read_slab(slab, bounce.data(), span, base);
        std::memcpy(c.mem, bounce.data() + start, c.nbytes);
      }
    }
  }

  if (c.write)
    finish_write(c, crc);
  else
    finish_read(c);
}

void IoEngine::finish_write(const Chunk& c, uint32_t crc) {
  if (c.sum) *c.sum = ChunkSum{crc, c.nbytes, true};
  counters_.bytes_written.fetch_add(c.nbytes, std::memory_order_relaxed);
}

void IoEngine::finish_read(const Chunk& c) {
  const SlabFile& slab = *c.slab;
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
