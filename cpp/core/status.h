// The one error type of the core. Both entry paths (FFI handlers, legacy custom calls) map a non-OK Status to their
// own reporting mechanism, so an error message is written once, here in the core, and reads the same on either path.
#pragma once

#include <string>
#include <utility>

namespace te_jax {

enum class StatusCode { kOk = 0, kInvalidArgument = 1, kInternal = 2, kUnavailable = 3 };

class [[nodiscard]] Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string message) { return Status(StatusCode::kInvalidArgument, std::move(message)); }
  static Status Internal(std::string message) { return Status(StatusCode::kInternal, std::move(message)); }
  static Status Unavailable(std::string message) { return Status(StatusCode::kUnavailable, std::move(message)); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

#define TE_JAX_RETURN_IF_ERROR(expr)      \
  do {                                    \
    ::te_jax::Status status_ = (expr);    \
    if (!status_.ok()) return status_;    \
  } while (0)

}  // namespace te_jax
