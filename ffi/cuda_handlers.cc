#include "ffi/cuda_handlers.h"

#include <cuda.h>

#include "cpp/cuda/attention_cuda.h"
#include "ffi/attention_handlers.h"
#include "ffi/attention_signature.h"

namespace te_jax::ffi_handlers {
namespace ffi = xla::ffi;
namespace {

constexpr auto kForwardCuda = AttentionForward<CUstream, cuda::AttentionForward>;
constexpr auto kBackwardCuda = AttentionBackward<CUstream, cuda::AttentionBackward>;

}  // namespace
}  // namespace te_jax::ffi_handlers

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxAttentionForwardCuda, te_jax::ffi_handlers::kForwardCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<CUstream>>() TE_JAX_FFI_FORWARD_SIGNATURE,
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxAttentionBackwardCuda, te_jax::ffi_handlers::kBackwardCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<CUstream>>() TE_JAX_FFI_BACKWARD_SIGNATURE,
                              {xla::ffi::Traits::kCmdBufferCompatible});
