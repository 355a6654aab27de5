// Completion state of one asynchronous request (what Python sees as IoFuture), and the
// counter a store uses to wait for all of its requests on close().
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <utility>
#include <vector>

#include "error.hpp"
#include "forks.hpp"

namespace offload {

// Counts requests that have not finished. Shared (not owned by the store) so a request
// finishing on a worker thread never touches a destroyed store.
class InflightTracker {
 public:
  void add() {
    std::lock_guard<std::mutex> lock(mu_);
    ++count_;
  }
  void remove() {
    std::lock_guard<std::mutex> lock(mu_);
    if (--count_ == 0) cv_.notify_all();
  }
  void wait_zero() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return count_ == 0; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t count_ = 0;
};

// A request is split into chunks that run on several workers; the last chunk to finish
// completes the request. The first error wins and later chunks of a failed request are
// skipped. Keep-alives (host memory, the extent) are dropped *before* the request reports
// done, so after wait() returns the I/O holds no memory any more.
//
// NOTE [Requests across a fork] In a forked child a request made before the fork waits on
// threads that exist only in the parent: a child backwarding the parent's nvme graph
// waited for ever on a write in flight at the fork. There, `done` / `wait` answer at once:
// done if it had finished before the fork, else the forked store's UseAfterClose. Its
// mutex is only tried: a parent worker may have held it at the fork.
class IoRequest {
 public:
  IoRequest(uint64_t nbytes, std::shared_ptr<InflightTracker> tracker)
      : nbytes_(nbytes), tracker_(std::move(tracker)), generation_(fork_generation) {
    tracker_->add();
  }
  IoRequest(const IoRequest&) = delete;
  IoRequest& operator=(const IoRequest&) = delete;
  ~IoRequest() {
    if (done_) return;
    // Never started (its submission failed): release the tracker count, run nothing.
    on_success_ = nullptr;
    finish(std::make_exception_ptr(std::runtime_error("I/O request abandoned before it ran")));
  }

  void keep_alive(std::shared_ptr<const void> owner) { keepalive_.push_back(std::move(owner)); }
  // Runs on the completing thread after every chunk succeeded; an exception it throws
  // becomes the request's error.
  void on_success(std::function<void()> fn) { on_success_ = std::move(fn); }
  void expect_chunks(size_t count) { pending_.store(count); }

  bool failed() const noexcept { return failed_.load(std::memory_order_relaxed); }
  // Fails the request now: the engine skips its chunks not yet started (a chunk already
  // running ends first, and the request is done after it). For transfers whose bytes nobody
  // will read or keep: a step freed early (the block raised, or `close()`).
  void cancel() {
    record_error(std::make_exception_ptr(UseAfterClose(
        "offload: transfer cancelled: its step was freed before it ran (the block raised, "
        "or ActivationOffload.close())")));
  }

  void chunk_done(std::exception_ptr err) {
    if (err) record_error(err);
    if (pending_.fetch_sub(1) == 1) finish(take_error());
  }
  // Completes a request that will run no chunk (zero bytes, or its staging failed).
  void complete(std::exception_ptr err) { finish(err); }

  bool done() const {
    if (generation_ != fork_generation) return done_before_fork();
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  // True when done; false when `timeout_s` passed first (nullopt waits forever).
  bool wait(std::optional<double> timeout_s) const {
    if (generation_ != fork_generation) return done_before_fork();
    std::unique_lock<std::mutex> lock(mu_);
    // (A timeout of decades, or inf, is none: converted to the clock's ticks it overflows.)
    if (!timeout_s || *timeout_s >= 1e9) {
      cv_.wait(lock, [&] { return done_; });
      return true;
    }
    return cv_.wait_for(lock, std::chrono::duration<double>(*timeout_s), [&] { return done_; });
  }
  // Bytes moved; rethrows the request's error. Only valid once done().
  uint64_t result() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_) std::rethrow_exception(error_);
    return nbytes_;
  }
  uint64_t nbytes() const noexcept { return nbytes_; }
  // When the request finished, in seconds of the monotonic clock (what Python's
  // time.perf_counter reads on Linux); nullopt while it runs.
  std::optional<double> end_s() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (!done_) return std::nullopt;
    return std::chrono::duration<double>(end_.time_since_epoch()).count();
  }

 private:
  bool done_before_fork() const {   // NOTE [Requests across a fork]
    std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
    if (lock.owns_lock() && done_) return true;
    throw forked_store_error();
  }

  void record_error(std::exception_ptr err) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_) error_ = err;
    failed_ = true;
  }
  std::exception_ptr take_error() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }
  void finish(std::exception_ptr err) {
    if (!err && on_success_) {
      try {
        on_success_();
      } catch (...) {
        err = std::current_exception();
      }
    }
    on_success_ = nullptr;
    keepalive_.clear();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (err && !error_) error_ = err;
      end_ = std::chrono::steady_clock::now();
      done_ = true;
      cv_.notify_all();
    }
    tracker_->remove();
  }

  const uint64_t nbytes_;
  std::shared_ptr<InflightTracker> tracker_;
  const long long generation_;   // fork_generation (forks.hpp) when it was made
  std::vector<std::shared_ptr<const void>> keepalive_;
  std::function<void()> on_success_;
  std::atomic<size_t> pending_{0};
  std::atomic<bool> failed_{false};
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::exception_ptr error_;
  std::chrono::steady_clock::time_point end_;
  bool done_ = false;
};

}  // namespace offload
