// XLA FFI handlers of the CUDA backend (api_version 4): they run on XLA's stream and are CUDA-graph compatible.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(TeJaxAttentionForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TeJaxAttentionBackwardCuda);
