// Maps the core's Status onto an XLA FFI error; XLA then raises it in Python as JaxRuntimeError with the same text.
#pragma once

#include "cpp/core/status.h"
#include "xla/ffi/api/ffi.h"

namespace te_jax::ffi_handlers {

inline xla::ffi::Error ToFfiError(const Status& status) {
  switch (status.code()) {
    case StatusCode::kOk: return xla::ffi::Error::Success();
    case StatusCode::kInvalidArgument: return xla::ffi::Error::InvalidArgument(status.message());
    case StatusCode::kUnavailable: return xla::ffi::Error(xla::ffi::ErrorCode::kUnavailable, status.message());
    case StatusCode::kInternal: break;
  }
  return xla::ffi::Error::Internal(status.message());
}

}  // namespace te_jax::ffi_handlers
