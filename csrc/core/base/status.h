// Error reporting for the torch-free core: a Status is an error message, empty when ok.
// The core reports every argument error as a Status and throws nothing else but std::bad_alloc
// when scratch memory cannot be had; the torch adapter turns a failed Status into a TORCH_CHECK
// error (and torch turns bad_alloc into a Python exception).
#pragma once

#include <string>
#include <utility>

namespace tokamax {

class Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status Error(std::string message) { return Status(std::move(message)); }

  bool ok() const { return message_.empty(); }
  const std::string& message() const { return message_; }

 private:
  explicit Status(std::string message) : message_(std::move(message)) {}
  std::string message_;
};

}  // namespace tokamax
