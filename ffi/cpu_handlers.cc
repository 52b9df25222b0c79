#include "ffi/cpu_handlers.h"

#include <cstdint>
#include <functional>

#include "cpp/cpu/attention_cpu.h"
#include "ffi/attention_handlers.h"
#include "ffi/attention_signature.h"

namespace te_jax::ffi_handlers {
namespace ffi = xla::ffi;
namespace {

// Lends XLA's intra-op thread pool to the core's ParallelFor.
class XlaPoolScheduler final : public cpu::TaskScheduler {
 public:
  explicit XlaPoolScheduler(ffi::ThreadPool pool) : pool_(pool) {}
  int64_t NumThreads() const override { return pool_.num_threads() > 0 ? pool_.num_threads() : 1; }
  void Schedule(std::function<void()> task) override { pool_.Schedule(std::move(task)); }

 private:
  ffi::ThreadPool pool_;
};

// The core's CPU entry points on XLA's thread pool.
Status ForwardOnPool(const AttentionParams& params, const ForwardBuffers& buffers, ffi::ThreadPool pool) {
  XlaPoolScheduler scheduler(pool);
  return cpu::AttentionForward(params, buffers, &scheduler);
}

Status BackwardOnPool(const AttentionParams& params, const BackwardBuffers& buffers, ffi::ThreadPool pool) {
  XlaPoolScheduler scheduler(pool);
  return cpu::AttentionBackward(params, buffers, &scheduler);
}

constexpr auto kForwardCpu = AttentionForward<ffi::ThreadPool, ForwardOnPool>;
constexpr auto kBackwardCpu = AttentionBackward<ffi::ThreadPool, BackwardOnPool>;

}  // namespace
}  // namespace te_jax::ffi_handlers

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxAttentionForwardCpu, te_jax::ffi_handlers::kForwardCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>() TE_JAX_FFI_FORWARD_SIGNATURE);

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxAttentionBackwardCpu, te_jax::ffi_handlers::kBackwardCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>() TE_JAX_FFI_BACKWARD_SIGNATURE);
