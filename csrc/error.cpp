#include "error.hpp"

#include <cstring>

namespace offload {

namespace {
std::string describe(int err, const std::string& message, const std::string& path,
                     int64_t offset, int64_t nbytes) {
  std::string text = message;
  if (!path.empty()) text += ": '" + path + "'";
  text += " [errno " + std::to_string(err) + ": " + std::strerror(err) + "]";
  if (offset >= 0) text += " offset=" + std::to_string(offset);
  if (nbytes >= 0) text += " size=" + std::to_string(nbytes);
  return text;
}
}  // namespace

IoError::IoError(int err, const std::string& message, std::string path, int64_t offset,
                 int64_t nbytes)
    : std::runtime_error(describe(err, message, path, offset, nbytes)),
      err_(err),
      message_(message),
      path_(std::move(path)),
      offset_(offset),
      nbytes_(nbytes) {}

void throw_io_error(int err, const std::string& message, const std::string& path, int64_t offset,
                    int64_t nbytes) {
  throw IoError(err, message, path, offset, nbytes);
}

}  // namespace offload
