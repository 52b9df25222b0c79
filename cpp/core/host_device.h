// Lets the small shared headers (masks, variants) compile for the host and, inside NVRTC-built kernels, the device.
#pragma once

// NVRTC ships no C++ standard headers: give the shared headers the fixed-width integer names they use. Every header
// that includes <cstdint> guards it with !defined(__CUDACC_RTC__) and includes this one.
#if defined(__CUDACC_RTC__)
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#endif

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define TE_JAX_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define TE_JAX_HOST_DEVICE inline
#endif
