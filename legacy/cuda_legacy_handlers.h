// Legacy custom-call targets of the CUDA backend, API_VERSION_STATUS_RETURNING (2): (stream, buffers = inputs then
// outputs, opaque descriptor). The status argument is unusable (legacy/legacy_failure.h): a failure fills every output
// but the backward's workspace with 0xFF bytes (NaN) on the stream and records the message for
// te_jax.raise_legacy_failures().
#pragma once

#include <cuda.h>

#include <cstddef>

struct XlaCustomCallStatus_;
typedef struct XlaCustomCallStatus_ XlaCustomCallStatus;

extern "C" {
void TeJaxLegacyAttentionForwardCuda(CUstream stream, void** buffers, const char* opaque, size_t opaque_len,
                                     XlaCustomCallStatus* status);
void TeJaxLegacyAttentionBackwardCuda(CUstream stream, void** buffers, const char* opaque, size_t opaque_len,
                                      XlaCustomCallStatus* status);
}
