// The cuDNN engine of a build without the cuDNN headers: every entry point reports how to get one.
#include "cpp/cuda/cudnn/cudnn_attention.h"

namespace te_jax::cuda::cudnn {
namespace {

Status NotBuilt() {
  return Status::Unavailable("te_jax was built without the cuDNN headers: its build found no nvidia/cudnn/include "
                             "(nvidia-cudnn-cu13, which jax[cuda13] installs) in the environment it was installed "
                             "into; install that, then reinstall te_jax");
}

}  // namespace

bool Built() { return false; }
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
