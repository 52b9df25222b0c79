// The cuDNN engine of a build without the cuDNN headers: every entry point reports how to get one.
#include "cpp/cuda/cudnn/cudnn_attention.h"

namespace te_jax::cuda::cudnn {
namespace {

Status NotBuilt() {
  return Status::Unavailable("te_jax was built without the cuDNN headers: install nvidia-cudnn-cu13 and "
                             "nvidia-cudnn-frontend and reinstall te_jax with --no-build-isolation");
}

}  // namespace

Status Available() { return NotBuilt(); }
std::string Version() { return ""; }
Status Supports(const AttentionParams&, Direction) { return NotBuilt(); }
int64_t ForwardWorkspaceBytes(const AttentionParams&) { return 0; }
int64_t BackwardWorkspaceBytes(const AttentionParams&) { return 0; }
Status Prepare(const AttentionParams&, Direction) { return NotBuilt(); }
Status Forward(const AttentionParams&, const ForwardBuffers&, CUstream) { return NotBuilt(); }
Status Backward(const AttentionParams&, const BackwardBuffers&, CUstream) { return NotBuilt(); }
void SetLibrarySearchPaths(std::vector<std::string>, std::vector<std::string>) {}

}  // namespace te_jax::cuda::cudnn
