#include "nvme_store.hpp"

#include <algorithm>
#include <set>
#include <stdexcept>

#include "align.hpp"
#include "cuda_copy.hpp"
#include "error.hpp"

namespace offload {

namespace {

void validate_options(const std::vector<std::string>& dirs, uint64_t capacity_bytes,
                      const StoreOptions& o) {
  if (dirs.empty()) throw InvalidArgument("NvmeStore: dirs must name at least one directory, got []");
  std::set<std::string> seen;
  for (const auto& d : dirs)
    if (!seen.insert(d).second)
      throw InvalidArgument("NvmeStore: dirs lists '" + d +
                            "' twice (give each directory once; list directories on different "
                            "disks to stripe across them)");
  if (capacity_bytes == 0) throw InvalidArgument("NvmeStore: capacity_bytes must be positive, got 0");
  if (o.workers == 0 || o.workers > 1024)
    throw InvalidArgument("NvmeStore: workers must be between 1 and 1024, got " +
                          std::to_string(o.workers));
  if (o.chunk_bytes < 4096 || o.chunk_bytes % 4096 != 0)
    throw InvalidArgument("NvmeStore: chunk_bytes must be a positive multiple of 4096, got " +
                          std::to_string(o.chunk_bytes));
  if (o.max_inflight_bytes < o.chunk_bytes)
    throw InvalidArgument("NvmeStore: max_inflight_bytes (" + std::to_string(o.max_inflight_bytes) +
                          ") must be at least chunk_bytes (" + std::to_string(o.chunk_bytes) + ")");
}

}  // namespace

ExtentRange::~ExtentRange() {
  try {
    allocator_->free(base_, reserved_);
  } catch (...) {
    // Each range frees exactly once by construction; a destructor must not throw.
  }
}

const std::shared_ptr<ExtentRange>& Extent::range() const {
  if (!range_) throw UseAfterClose("Extent was released; allocate a new one");
  return range_;
}

NvmeStore::NvmeStore(const std::vector<std::string>& dirs, uint64_t capacity_bytes,
                     const StoreOptions& options, std::vector<LogNote>* notes)
    : options_(options) {
  validate_options(dirs, capacity_bytes, options);
  // Every SlabFile (which validates its directory) exists before any slab reserves space,
  // so a typo in the second directory does not cost a reservation in the first.
  std::vector<LogNote> slab_notes;
  for (const auto& d : dirs) {
    slabs_.push_back(std::make_unique<SlabFile>(d, options.direct, &slab_notes));
    alignment_ = std::max(alignment_, slabs_.back()->alignment());
  }
  // Stripe unit = chunk size, so every chunk lands in exactly one slab.
  stripe_bytes_ = align_up(options.chunk_bytes, alignment_);
  const uint64_t per_slab = (capacity_bytes + dirs.size() - 1) / dirs.size();
  slab_bytes_ = align_up(per_slab, stripe_bytes_);
  for (auto& slab : slabs_) slab->reserve(slab_bytes_, &slab_notes);

  // One warning for the whole store, however many directories fell back.
  std::string fallback;
  for (auto& n : slab_notes) {
    if (n.level >= 30)
      fallback += (fallback.empty() ? "" : "; ") + n.message;
    else
      notes->push_back(std::move(n));
  }
  if (!fallback.empty())
    notes->push_back({30, fallback + " (buffered I/O goes through the page cache: slower and it "
                                     "uses host RAM; point the NVMe directory at a local disk "
                                     "filesystem such as ext4 or xfs for direct I/O)"});

  allocator_ = std::make_shared<RangeAllocator>(slab_bytes_ * slabs_.size(), alignment_);
  engine_ = std::make_unique<IoEngine>(options.workers, stripe_bytes_, alignment_,
                                       options.max_inflight_bytes, options.throttle_bytes_per_s,
                                       options.coalesce_bytes);
}

NvmeStore::~NvmeStore() {
  // After a fork the engine is leaked here, not earlier: its counters stay readable until
  // then (a child that ends a step it inherited reads them), and destroying it would join
  // threads that do not exist in the child.
  if (forked_.load()) (void)engine_.release();
  close();
}

void NvmeStore::close() {
  std::lock_guard<std::mutex> lock(close_mu_);
  if (closed_.exchange(true)) return;
  engine_->hold_for_test(false);   // a test's hold would keep the requests below waiting
  tracker_->wait_zero();  // every submitted request, including ones staged behind CUDA events
  engine_->stop();
  std::shared_ptr<ThreadPool> write_stager, release_stager;
  {
    // stager() refuses new work from here on (closed_ is set), so these are the last owners.
    std::lock_guard<std::mutex> stager_lock(stager_mu_);
    write_stager = std::move(write_stager_);
    release_stager = std::move(release_stager_);
  }
  // Run what is queued (releases of pinned blocks after H2D copies), then join.
  write_stager.reset();
  release_stager.reset();
  for (auto& slab : slabs_) slab->close();
}

void NvmeStore::abandon_after_fork() noexcept {
  forked_.store(true);
  closed_.store(true);
  for (auto& slab : slabs_) slab->close();
  // Deliberately leaked: destroying them would join threads that do not exist here (the
  // engine is, in the destructor).
  new std::shared_ptr<ThreadPool>(std::move(write_stager_));
  new std::shared_ptr<ThreadPool>(std::move(release_stager_));
}

void NvmeStore::check_open() const {
  if (!closed_.load()) return;
  if (forked_.load()) throw forked_store_error();
  throw UseAfterClose("NvmeStore is closed");
}

bool NvmeStore::direct() const noexcept {
  return std::all_of(slabs_.begin(), slabs_.end(), [](const auto& s) { return s->direct(); });
}

std::vector<std::string> NvmeStore::paths() const {
  std::vector<std::string> out;
  for (const auto& s : slabs_) out.push_back(s->dir());
  return out;
}

NvmeStore::Location NvmeStore::locate(uint64_t logical_offset) const {
  const uint64_t stripe = logical_offset / stripe_bytes_;
  const uint64_t within = logical_offset % stripe_bytes_;
  const uint64_t n = slabs_.size();
  return Location{slabs_[stripe % n].get(), (stripe / n) * stripe_bytes_ + within,
                  stripe_bytes_ - within};
}

std::shared_ptr<ExtentRange> NvmeStore::allocate(uint64_t nbytes, uint64_t phase) {
  check_open();
  if (phase >= alignment_)
    throw InvalidArgument("NvmeStore.allocate: phase must be below the alignment (" +
                          std::to_string(alignment_) + "), got " + std::to_string(phase));
  const uint64_t reserved = nbytes + phase;
  std::optional<uint64_t> base = allocator_->allocate(reserved);
  if (!base) return nullptr;
  size_t slots = 0;
  if (options_.checksum) {
    const uint64_t start = *base + phase;
    for (uint64_t pos = 0; pos < nbytes; ++slots) pos += locate(start + pos).contiguous_bytes;
  }
  try {
    return std::make_shared<ExtentRange>(allocator_, *base, reserved, phase, nbytes, slots);
  } catch (...) {
    allocator_->free(*base, reserved);
    throw;
  }
}

const std::shared_ptr<ExtentRange>& NvmeStore::checked_range(const Extent& extent) const {
  const auto& range = extent.range();
  if (range->allocator() != allocator_.get())
    throw InvalidArgument("Extent belongs to a different NvmeStore");
  return range;
}

std::vector<Chunk> NvmeStore::make_chunks(ExtentRange& range, char* mem, uint64_t nbytes,
                                          uint64_t mem_capacity, bool write,
                                          const std::shared_ptr<IoRequest>& request) {
  std::vector<Chunk> chunks;
  chunks.reserve(nbytes / stripe_bytes_ + 2);
  uint64_t pos = 0;
  for (size_t index = 0; pos < nbytes; ++index) {
    const Location loc = locate(range.offset() + pos);
    const uint64_t len = std::min(nbytes - pos, loc.contiguous_bytes);
    Chunk c;
    c.slab = loc.slab;
    c.file_offset = loc.file_offset;
    c.mem = mem + pos;
    c.nbytes = len;
    c.mem_capacity = mem_capacity - pos;
    c.write = write;
    c.sum = range.sum(index);
    c.request = request;
    chunks.push_back(std::move(c));
    pos += len;
  }
  return chunks;
}

NvmeStore::Prepared NvmeStore::prepare(const Extent& extent, char* mem, uint64_t nbytes,
                                       uint64_t mem_capacity, bool write,
                                       std::shared_ptr<const void> memory_owner) {
  check_open();
  std::shared_ptr<ExtentRange> range = checked_range(extent);
  if (nbytes > range->nbytes())
    throw InvalidArgument(std::string(write ? "write" : "read") + " of " + std::to_string(nbytes) +
                          " bytes does not fit the extent of " + std::to_string(range->nbytes()) +
                          " bytes");
  if (mem == nullptr && nbytes > 0) throw InvalidArgument("ptr is 0 (null) for a non-empty transfer");
  Prepared p;
  p.request = std::make_shared<IoRequest>(nbytes, tracker_);
  p.request->keep_alive(range);
  if (memory_owner) p.request->keep_alive(std::move(memory_owner));
  p.chunks = make_chunks(*range, mem, nbytes, mem_capacity, write, p.request);
  p.request->expect_chunks(p.chunks.size());
  return p;
}

void NvmeStore::dispatch(IoEngine& engine, IoRequest& request, std::vector<Chunk> chunks) {
  if (chunks.empty())
    request.complete(nullptr);
  else
    engine.submit(std::move(chunks));
}

std::shared_ptr<IoRequest> NvmeStore::submit(const Extent& extent, char* mem, uint64_t nbytes,
                                             uint64_t mem_capacity, bool write,
                                             std::shared_ptr<const void> memory_owner) {
  Prepared p = prepare(extent, mem, nbytes, mem_capacity, write, std::move(memory_owner));
  dispatch(*engine_, *p.request, std::move(p.chunks));
  return p.request;
}

std::shared_ptr<IoRequest> NvmeStore::write(const Extent& extent, const HostBlock& block) {
  const auto& region = block.region();
  return submit(extent, region->data(), block.nbytes(), region->capacity_bytes(), true, region);
}

std::shared_ptr<IoRequest> NvmeStore::read(const Extent& extent, const HostBlock& block) {
  const auto& region = block.region();
  return submit(extent, region->data(), block.nbytes(), region->capacity_bytes(), false, region);
}

std::shared_ptr<IoRequest> NvmeStore::write_ptr(const Extent& extent, uintptr_t ptr,
                                                uint64_t nbytes) {
  return submit(extent, reinterpret_cast<char*>(ptr), nbytes, nbytes, true, nullptr);
}

std::vector<std::shared_ptr<IoRequest>> NvmeStore::write_ptr_many(
    const std::vector<const Extent*>& extents, const std::vector<uintptr_t>& ptrs,
    const std::vector<uint64_t>& nbytes) {
  if (extents.size() != ptrs.size() || extents.size() != nbytes.size())
    throw InvalidArgument("write_ptr_many: extents, ptrs and nbytes differ in length (" +
                          std::to_string(extents.size()) + ", " + std::to_string(ptrs.size()) +
                          ", " + std::to_string(nbytes.size()) + ")");
  std::vector<Prepared> prepared;
  prepared.reserve(extents.size());
  size_t total_chunks = 0;
  try {
    for (size_t i = 0; i < extents.size(); ++i) {
      char* mem = reinterpret_cast<char*>(ptrs[i]);
      prepared.push_back(prepare(*extents[i], mem, nbytes[i], nbytes[i], true, nullptr));
      total_chunks += prepared.back().chunks.size();
    }
  } catch (...) {
    // Nothing was submitted: the requests made so far end now, so close() does not wait
    // for them (they are counted as in flight from their construction).
    for (auto& p : prepared) p.request->complete(std::current_exception());
    throw;
  }
  std::vector<std::shared_ptr<IoRequest>> requests;
  requests.reserve(prepared.size());
  std::vector<Chunk> chunks;
  chunks.reserve(total_chunks);
  for (auto& p : prepared) {
    requests.push_back(p.request);
    if (p.chunks.empty())
      p.request->complete(nullptr);
    for (auto& c : p.chunks) chunks.push_back(std::move(c));
  }
  if (!chunks.empty()) engine_->submit(std::move(chunks));
  return requests;
}

std::shared_ptr<IoRequest> NvmeStore::read_ptr(const Extent& extent, uintptr_t ptr,
                                               uint64_t nbytes) {
  return submit(extent, reinterpret_cast<char*>(ptr), nbytes, nbytes, false, nullptr);
}

std::shared_ptr<IoRequest> NvmeStore::read_into(const Extent& extent,
                                                std::shared_ptr<HostRegion> region,
                                                uint64_t skip, uint64_t nbytes) {
  if (!region || skip > region->capacity_bytes() || nbytes > region->capacity_bytes() - skip)
    throw InvalidArgument("read_into: " + std::to_string(nbytes) + " bytes at " +
                          std::to_string(skip) + " do not fit the region");
  char* mem = region->data() + skip;
  return submit(extent, mem, nbytes, nbytes, false, std::move(region));
}

std::shared_ptr<ThreadPool> NvmeStore::stager(Stager which) {
  // A copy taken under the lock: close() may drop the store's reference at any moment
  // (with the GIL released), and the caller's copy keeps the pool alive until it is done.
  std::lock_guard<std::mutex> lock(stager_mu_);
  if (closed_.load()) throw UseAfterClose("NvmeStore is closed");
  std::shared_ptr<ThreadPool>& slot = which == Stager::kWrite ? write_stager_ : release_stager_;
  if (!slot)
    slot = std::make_shared<ThreadPool>(1, which == Stager::kWrite ? "NvmeStore D2H-event waiter"
                                                                   : "NvmeStore H2D-release thread");
  return slot;
}

std::shared_ptr<IoRequest> NvmeStore::write_after_event(const Extent& extent,
                                                        const HostBlock& block, uintptr_t event) {
  if (!cuda::compiled()) cuda::event_synchronize(event);  // throws the "built without CUDA" error
  check_open();
  if (event == 0) throw InvalidArgument("write_after_event: event handle is 0");
  const int device = cuda::current_device();
  const auto& region = block.region();
  std::shared_ptr<ThreadPool> waiter = stager(Stager::kWrite);
  Prepared p = prepare(extent, region->data(), block.nbytes(), region->capacity_bytes(), true, region);
  std::shared_ptr<IoRequest> request = p.request;
  auto chunks = std::make_shared<std::vector<Chunk>>(std::move(p.chunks));
  IoEngine* engine = engine_.get();  // outlives the request: close() waits for it
  // The wait runs on its own thread so that no I/O worker sits idle behind a GPU event,
  // and no write queues behind a prefetch's H2D wait (those have the release thread).
  waiter->submit([engine, request, chunks, event, device] {
    try {
      cuda::enter_engine_thread(device);
      cuda::event_synchronize(event);  // the D2H copy into the block has landed
      dispatch(*engine, *request, std::move(*chunks));
    } catch (...) {
      chunks->clear();
      request->complete(std::current_exception());
    }
  });
  return request;
}

std::shared_ptr<IoRequest> NvmeStore::read_then_h2d(const Extent& extent, const HostBlock& block,
                                                    uintptr_t dst_ptr, uint64_t nbytes,
                                                    uintptr_t stream, uintptr_t event) {
  if (!cuda::compiled()) cuda::event_synchronize(event);  // throws the "built without CUDA" error
  check_open();
  if (nbytes > block.nbytes())
    throw InvalidArgument("read_then_h2d: nbytes=" + std::to_string(nbytes) +
                          " exceeds the block's " + std::to_string(block.nbytes()) + " bytes");
  if (dst_ptr == 0 && nbytes > 0) throw InvalidArgument("read_then_h2d: dst_ptr is 0 (null)");
  // Work queued on a capturing stream is recorded into the graph, not run: the copy would
  // never happen, and the wait for its event would be illegal.
  if (cuda::stream_capturing(stream))
    throw std::runtime_error(
        "read_then_h2d: the stream is capturing a CUDA graph; a copy chained behind an NVMe "
        "read cannot be part of a graph (capture outside offload.activations(), or wrap the "
        "captured region in offload.no_offload())");
  const int device = cuda::stream_device(stream);
  std::shared_ptr<HostRegion> region = block.region();
  std::shared_ptr<ThreadPool> releaser = stager(Stager::kRelease);
  Prepared p = prepare(extent, region->data(), nbytes, region->capacity_bytes(), false, region);
  p.request->on_success([region, dst_ptr, nbytes, stream, event, device, releaser] {
    cuda::enter_engine_thread(device);  // an I/O worker thread
    // A refused copy queues nothing: its error goes to the caller as it is.
    cuda::copy_h2d(dst_ptr, reinterpret_cast<uintptr_t>(region->data()), nbytes, stream, 0);
    // The copy is only queued: keep the pinned block alive until the device has read it,
    // or the arena could hand the memory to the next D2H while the H2D still reads it.
    uintptr_t done = 0;
    try {
      if (event != 0) cuda::record_event(event, stream);
      done = cuda::record_private_event(stream);
      releaser->submit([region, done, device] {
        try {
          cuda::enter_engine_thread(device);
        } catch (...) {
          // Still wait below: letting go of the block before the copy read it is worse.
        }
        try {
          cuda::event_synchronize(done);  // blocking-sync event: this thread sleeps
        } catch (...) {
          // A failed stream surfaces to the caller through its own event; nothing to add.
        }
        cuda::destroy_event(done);
      });  // `region` goes on this thread: the arena's memory may be freed here
    } catch (...) {
      // The copy is queued, nothing marks its end, and the request lets go of the block
      // when this throws: wait for the stream before the arena can hand the memory out.
      if (done != 0) cuda::destroy_event(done);
      cuda::stream_synchronize_noexcept(stream);
      throw;
    }
  });
  dispatch(*engine_, *p.request, std::move(p.chunks));
  return p.request;
}

void NvmeStore::hold_workers_for_test(bool held) {
  std::lock_guard<std::mutex> lock(close_mu_);   // not between close()'s release and its wait
  check_open();
  engine_->hold_for_test(held);
}

void NvmeStore::corrupt_for_test(const Extent& extent, uint64_t offset) {
  check_open();
  const auto& range = checked_range(extent);
  if (offset >= range->nbytes())
    throw InvalidArgument("corrupt_for_test: offset " + std::to_string(offset) +
                          " is outside the extent of " + std::to_string(range->nbytes()) + " bytes");
  const Location loc = locate(range->offset() + offset);
  const uint64_t align = loc.slab->alignment();
  const uint64_t base = loc.file_offset / align * align;
  AlignedBuffer buf(align, align);
  loc.slab->pread_full(buf.data(), align, base);
  buf.data()[loc.file_offset - base] ^= 0xFF;
  loc.slab->pwrite_full(buf.data(), align, base);
}

}  // namespace offload
