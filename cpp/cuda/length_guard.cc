#include "cpp/cuda/length_guard.h"

#include <string>

#include "cpp/cuda/dynamic_libs.h"
#include "cpp/cuda/kernel_args.h"
#include "cpp/cuda/kernel_registry.h"

namespace te_jax::cuda {
namespace {

Status GuardModule(const DriverApi** driver, const LoadedModule** module) {
  TE_JAX_RETURN_IF_ERROR(GetDriver(driver));
  CUdevice device = 0;
  std::string arch;
  TE_JAX_RETURN_IF_ERROR(CurrentDeviceArch(&device, &arch));
  JitReport report;
  return GetLoadedModule(LengthGuardConfig(arch), device, module, &report);
}

LengthGuardArgs Args(const AttentionParams& p, const int32_t* q_seqlens, const int32_t* kv_seqlens, int32_t* guarded) {
  LengthGuardArgs a{};
  a.q_seqlens = q_seqlens;
  a.kv_seqlens = kv_seqlens;
  a.guarded = guarded;
  a.batch = static_cast<int32_t>(p.batch);
  a.seqlen_q = static_cast<int32_t>(p.seqlen_q);
  a.seqlen_kv = static_cast<int32_t>(p.seqlen_kv);
  return a;
}

Status Launch(const DriverApi* driver, CUkernel kernel, unsigned gx, unsigned gy, unsigned gz, LengthGuardArgs* args,
              CUstream stream) {
  void* params[] = {args};
  const CUresult r = driver->cuLaunchKernel(reinterpret_cast<CUfunction>(kernel), gx, gy, gz, 256, 1, 1, 0, stream,
                                            params, nullptr);
  if (r != CUDA_SUCCESS) return Status::Internal("te_jax length guard launch failed: " + driver->ErrorString(r));
  return Status::Ok();
}

}  // namespace

int64_t LengthGuardBytes(const AttentionParams& p) { return (3 * p.batch * 4 + 255) / 256 * 256; }

Status GuardLengths(const AttentionParams& p, const int32_t* q_seqlens, const int32_t* kv_seqlens, int32_t* guarded,
                    CUstream stream) {
  if (p.batch == 0) return Status::Ok();
  const DriverApi* driver = nullptr;
  const LoadedModule* module = nullptr;
  TE_JAX_RETURN_IF_ERROR(GuardModule(&driver, &module));
  LengthGuardArgs args = Args(p, q_seqlens, kv_seqlens, guarded);
  return Launch(driver, module->kernels[0], static_cast<unsigned>((p.batch + 255) / 256), 1, 1, &args, stream);
}

Status PoisonInvalidBatches(const AttentionParams& p, const int32_t* guarded,
                            std::initializer_list<std::pair<void*, int64_t>> outputs, CUstream stream) {
  if (p.batch == 0) return Status::Ok();
  const DriverApi* driver = nullptr;
  const LoadedModule* module = nullptr;
  TE_JAX_RETURN_IF_ERROR(GuardModule(&driver, &module));
  LengthGuardArgs args = Args(p, nullptr, nullptr, const_cast<int32_t*>(guarded));
  for (const auto& [ptr, bytes] : outputs) {
    if (args.num_outputs == 4) return Status::Internal("te_jax length guard: more than 4 outputs");
    args.outputs[args.num_outputs] = ptr;
    args.output_batch_bytes[args.num_outputs++] = bytes;
  }
  // 8 blocks of 256 threads per (batch entry, output): enough to fill in a poisoned entry quickly, nothing otherwise.
  return Launch(driver, module->kernels[1], 8, static_cast<unsigned>(p.batch), static_cast<unsigned>(args.num_outputs),
                &args, stream);
}

}  // namespace te_jax::cuda
