// Legacy custom-call targets of the CPU backend. XLA:CPU runs only API_VERSION_STATUS_RETURNING_UNIFIED (3); the
// status argument is unusable (see legacy_failure.h).
#pragma once

#include <cstddef>

struct XlaCustomCallStatus_;
typedef struct XlaCustomCallStatus_ XlaCustomCallStatus;

extern "C" {
void TeJaxLegacyAttentionForwardCpu(void* out, const void** in, const char* opaque, size_t opaque_len,
                                    XlaCustomCallStatus* status);
void TeJaxLegacyAttentionBackwardCpu(void* out, const void** in, const char* opaque, size_t opaque_len,
                                     XlaCustomCallStatus* status);
}
