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

LengthGuardArgs Args(const AttentionParams& p, int32_t* guarded) {
  LengthGuardArgs a{};
  a.shape = ShapeArgs{static_cast<int32_t>(p.batch),        static_cast<int32_t>(p.seqlen_q),
                      static_cast<int32_t>(p.seqlen_kv),    static_cast<int32_t>(p.num_heads),
                      static_cast<int32_t>(p.num_kv_heads), static_cast<int32_t>(p.mask_type),
                      static_cast<int32_t>(p.window_left),  static_cast<int32_t>(p.window_right),
                      p.scale,                              p.softcap};
  a.guarded = guarded;
  a.head_dim = static_cast<int32_t>(p.head_dim);
  a.head_dim_v = static_cast<int32_t>(p.head_dim_v);
  return a;
}

Status Launch(int index, const char* what, unsigned gx, unsigned gy, LengthGuardArgs* args, CUstream stream) {
  const DriverApi* driver = nullptr;
  const LoadedModule* module = nullptr;
  TE_JAX_RETURN_IF_ERROR(GuardModule(&driver, &module));
  if (gx == 0 || gy == 0) return Status::Ok();
  void* params[] = {args};
  const CUresult r = driver->cuLaunchKernel(reinterpret_cast<CUfunction>(module->kernels[index]), gx, gy, 1, 256, 1, 1,
                                            0, stream, params, nullptr);
  if (r != CUDA_SUCCESS) return Status::Internal(std::string("te_jax ") + what + " launch failed: " + driver->ErrorString(r));
  return Status::Ok();
}

Status Enforce(const AttentionParams& p, LengthGuardArgs* args, CUstream stream) {
  const int64_t rows = p.seqlen_q > p.seqlen_kv ? p.seqlen_q : p.seqlen_kv;
  return Launch(1, "length contract", static_cast<unsigned>((rows + kLengthGuardRowsPerBlock - 1) / kLengthGuardRowsPerBlock),
                static_cast<unsigned>(p.batch), args, stream);
}

}  // namespace

Status PrepareLengthGuard() {
  const DriverApi* driver = nullptr;
  const LoadedModule* module = nullptr;
  return GuardModule(&driver, &module);
}

int64_t LengthGuardBytes(const AttentionParams& p) { return (3 * p.batch * 4 + 255) / 256 * 256; }

Status GuardLengths(const AttentionParams& p, const int32_t* q_seqlens, const int32_t* kv_seqlens, int32_t* guarded,
                    CUstream stream) {
  LengthGuardArgs args = Args(p, guarded);
  args.q_seqlens = q_seqlens;
  args.kv_seqlens = kv_seqlens;
  return Launch(0, "length guard", static_cast<unsigned>((p.batch + 255) / 256), 1, &args, stream);
}

Status EnforceLengthContract(const AttentionParams& p, const int32_t* guarded, const ForwardBuffers& b,
                             CUstream stream) {
  LengthGuardArgs args = Args(p, const_cast<int32_t*>(guarded));
  args.out = static_cast<uint16_t*>(b.out);
  args.lse = b.lse;
  return Enforce(p, &args, stream);
}

Status EnforceLengthContract(const AttentionParams& p, const int32_t* guarded, const BackwardBuffers& b,
                             CUstream stream) {
  LengthGuardArgs args = Args(p, const_cast<int32_t*>(guarded));
  args.dq = static_cast<uint16_t*>(b.dq);
  args.dk = static_cast<uint16_t*>(b.dk);
  args.dv = static_cast<uint16_t*>(b.dv);
  return Enforce(p, &args, stream);
}

}  // namespace te_jax::cuda
