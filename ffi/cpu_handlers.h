// XLA FFI handlers of the CPU backend (api_version 4), registered under the names in te_jax/_registration.py.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(TeJaxAttentionForwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(TeJaxAttentionBackwardCpu);
