#include "cpp/cpu/flex_tiles.h"

#include <dlfcn.h>

#include <map>
#include <mutex>
#include <string>

namespace te_jax::cpu {
namespace {

// The libraries are never closed: a call's tile functions must stay valid for every later call, and they are small.
Status OpenLibrary(const std::string& path, void** handle) {
  static std::mutex mutex;
  static std::map<std::string, void*> opened;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = opened.find(path); it != opened.end()) {
    *handle = it->second;
    return Status::Ok();
  }
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* error = dlerror();
    return Status::InvalidArgument("cannot load the score_mod/mask_mod library " + path + " (" +
                                   (error != nullptr ? error : "unknown error") +
                                   "); te_jax compiles it when it lowers the call: if the cache directory was "
                                   "cleared, lower the call again (a fresh jax.jit) in this process");
  }
  opened.emplace(path, library);
  *handle = library;
  return Status::Ok();
}

template <typename Function>
Status FindTile(const std::string& path, const char* symbol, Function* function) {
  void* library = nullptr;
  TE_JAX_RETURN_IF_ERROR(OpenLibrary(path, &library));
  *function = reinterpret_cast<Function>(dlsym(library, symbol));
  if (*function == nullptr) {
    return Status::InvalidArgument("the score_mod/mask_mod library " + path + " exports no " + symbol);
  }
  return Status::Ok();
}

FlexCapture CaptureOf(const void* data, const std::vector<int64_t>& shape) {
  FlexCapture capture{data, static_cast<int64_t>(shape.size()), {}, {}};
  int64_t stride = 1;
  for (int64_t axis = capture.rank - 1; axis >= 0; --axis) {
    capture.shape[axis] = shape[axis];
    capture.strides[axis] = stride;
    stride *= shape[axis];
  }
  return capture;
}

}  // namespace

Status LoadFlexTiles(const FlexSpec& spec, const void* const* captures, const uint32_t* offsets, FlexTiles* tiles) {
  if (!spec.active()) return Status::Ok();
  tiles->b0_ = offsets[2];
  tiles->h0_ = offsets[3];
  tiles->q0_ = offsets[4];
  tiles->kv0_ = offsets[5];
  if (spec.has_score_mod()) {
    TE_JAX_RETURN_IF_ERROR(FindTile(spec.score_library, kFlexScoreTileSymbol, &tiles->score_));
    TE_JAX_RETURN_IF_ERROR(FindTile(spec.score_library, kFlexDScoreTileSymbol, &tiles->dscore_));
    if (spec.capture_gradients != 0) {
      TE_JAX_RETURN_IF_ERROR(FindTile(spec.score_library, kFlexDCapturesTileSymbol, &tiles->dcaptures_));
    }
  }
  if (spec.has_mask_mod()) TE_JAX_RETURN_IF_ERROR(FindTile(spec.mask_library, kFlexMaskTileSymbol, &tiles->mask_));
  for (int64_t i = 0; i < spec.num_captures(); ++i) {
    tiles->captures_.push_back(CaptureOf(captures[i], spec.capture_shapes[i]));
  }
  tiles->score_captures_ = spec.score_captures;
  tiles->batch_fold_ = spec.batch_fold;
  if (spec.has_block_mask()) {
    tiles->blocks_ = &tiles->captures_.back();
    tiles->block_q_ = spec.block_q;
    tiles->block_kv_ = spec.block_kv;
  }
  return Status::Ok();
}

int8_t FlexTiles::TileState(int64_t b, int64_t h, int64_t first_row, int64_t rows, int64_t key0, int64_t keys) const {
  if (blocks_ == nullptr || rows <= 0 || keys <= 0) return kBlockPartial;
  const int8_t* blocks = static_cast<const int8_t*>(blocks_->data);
  const int64_t* shape = blocks_->shape;
  const int64_t* strides = blocks_->strides;
  const int64_t base = (shape[0] == 1 ? 0 : Batch(b)) * strides[0] + (shape[1] == 1 ? 0 : h + h0_) * strides[1];
  first_row += q0_;
  key0 += kv0_;
  bool all_hidden = true, all_visible = true;
  for (int64_t row = first_row / block_q_; row <= (first_row + rows - 1) / block_q_; ++row) {
    for (int64_t col = key0 / block_kv_; col <= (key0 + keys - 1) / block_kv_; ++col) {
      const int8_t state = blocks[base + row * strides[2] + col * strides[3]];
      all_hidden &= state == kBlockHidden;
      all_visible &= state == kBlockVisible;
    }
  }
  return all_hidden ? kBlockHidden : all_visible ? kBlockVisible : kBlockPartial;
}

}  // namespace te_jax::cpu
