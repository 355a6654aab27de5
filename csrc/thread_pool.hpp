// A small FIFO thread pool for staging work that must not occupy an I/O worker:
// waiting on CUDA events before a write, and holding pinned memory until an H2D copy
// from it has finished on the device.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace offload {

// Starts `count` threads running `body` into `threads`. std::thread throws
// std::system_error when the system refuses a thread (EAGAIN: thread or memory limit);
// escaping a constructor with joinable threads would call std::terminate, so on failure
// `stop_and_join` ends the threads already started and a runtime_error says how many
// threads were asked for and why they could not start.
template <typename Body, typename Stop>
void start_threads(std::vector<std::thread>& threads, size_t count, const char* what, Body body,
                   Stop stop_and_join) {
  threads.reserve(count);
  try {
    for (size_t i = 0; i < count; ++i) threads.emplace_back(body);
  } catch (const std::exception& e) {  // system_error (EAGAIN), or bad_alloc for its state
    const size_t started = threads.size();
    stop_and_join();
    throw std::runtime_error("cannot start " + std::string(what) + " " +
                             std::to_string(started + 1) + " of " + std::to_string(count) + " (" +
                             e.what() + "); lower the number of workers or raise the process's "
                             "thread limit (ulimit -u)");
  }
}

class ThreadPool {
 public:
  // `what` names the pool in the error thrown when the system refuses a thread.
  explicit ThreadPool(size_t threads, const char* what = "staging thread") {
    start_threads(threads_, threads, what, [this] { loop(); }, [this] { shutdown(); });
  }
  // Runs every queued task, then joins.
  ~ThreadPool() { shutdown(); }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Tasks must not throw (they report errors through their own request).
  void submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  void shutdown() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

  void loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace offload
