// Programmatic dependent launch (sm_90 and newer): a kernel launched with programmatic stream serialization
// (attention_cuda.cc) may start while the kernel before it in the stream still runs, so its launch and its CTAs'
// start overlap that kernel's tail; it must wait for that kernel's results before reading them. The kernel before it
// lets it start once every one of its CTAs has allowed it (or exited). Before sm_90 both are no-ops, and the host
// launches without the attribute (kernel_config.h DependentLaunch).
#pragma once

namespace te_jax::cuda {

// Blocks until the previous kernel in the stream has finished and its writes are visible.
__device__ __forceinline__ void WaitForPreviousGrid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// This CTA no longer holds back the launch of the next kernel (which still waits for this grid's results).
__device__ __forceinline__ void AllowNextGrid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

}  // namespace te_jax::cuda
