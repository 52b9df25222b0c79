// Lets the small shared headers (masks, variants) compile for the host and, inside NVRTC-built kernels, the device.
#pragma once

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define TE_JAX_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TE_JAX_HOST_DEVICE inline
#endif
