// Errors that cross thread boundaries (through IoRequest) and the Python boundary
// (bindings translate IoError into offload.errors.StorageError, keeping errno).
#pragma once

#include <cerrno>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace offload {

// An I/O failure: errno plus the file and the byte range it concerned, so a user
// can tell *which* disk and *where* without a debugger. -1 means "not applicable".
class IoError : public std::runtime_error {
 public:
  IoError(int err, const std::string& message, std::string path = {}, int64_t offset = -1,
          int64_t nbytes = -1);

  int err() const noexcept { return err_; }
  const std::string& message() const noexcept { return message_; }
  const std::string& path() const noexcept { return path_; }
  int64_t offset() const noexcept { return offset_; }
  int64_t nbytes() const noexcept { return nbytes_; }

 private:
  int err_;
  std::string message_;
  std::string path_;
  int64_t offset_;
  int64_t nbytes_;
};

[[noreturn]] void throw_io_error(int err, const std::string& message, const std::string& path = {},
                                 int64_t offset = -1, int64_t nbytes = -1);

// Invalid arguments from the caller (become ValueError in Python).
class InvalidArgument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The object was used after close()/release() (becomes ValueError in Python, like
// operations on a closed Python file).
class UseAfterClose : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

// What a forked child gets for the parent's nvme store or a request of its engine.
inline UseAfterClose forked_store_error() {
  return UseAfterClose("NvmeStore is closed: this process was forked from the one that saved "
                       "these tensors, and a child cannot read the parent's nvme store (run "
                       "backward in the parent, or use the host tier for graphs a child "
                       "backwards)");
}

}  // namespace offload
