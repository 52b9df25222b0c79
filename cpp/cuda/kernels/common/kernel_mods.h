// A kernel's score_mod and mask_mod (te_jax.flex): the generated structs (te_jax::flex::ScoreMod / MaskMod, rendered
// into the module's translation unit ahead of the kernels) bound to the call's captures, which a kernel built with
// mods takes in WithFlex<its arguments> (kernel_args.h). The kernels hold it as their variant's `mods`
// (cpp/core/variants.h) and call it per element with the element's ModIndex: the logit's Score, and Mask's -inf; the
// backward's DScore and DCaptures (probability_grad.h). With a block mask, a CTA's tiles are narrowed to those between
// its first and last whose blocks are not all hidden (NarrowTiles: the others are never loaded, as with the built-in
// masks), and a tile whose blocks are all visible skips the mask_mod (AllVisible).
#pragma once

#include "cpp/cuda/kernel_args.h"

namespace te_jax::cuda {

// Stand-ins for a mod a call does not have.
struct NoScoreMod {
  static constexpr int kCaptures = 0;
  template <typename Capture>
  __device__ __forceinline__ static NoScoreMod Bind(const Capture*) {
    return {};
  }
};
struct NoMaskMod {
  static constexpr int kCaptures = 0;
  template <typename Capture>
  __device__ __forceinline__ static NoMaskMod Bind(const Capture*) {
    return {};
  }
};

template <typename A, typename B>
struct SameType {
  static constexpr bool value = false;
};
template <typename A>
struct SameType<A, A> {
  static constexpr bool value = true;
};

// A thread's additions to the score_mod's capture gradients, each run of them to one element added up in a register
// and added (atomically) when the next goes elsewhere or at Flush. A relative-position table read at a clipped distance
// gives every far key of a row the same element: one addition a run instead of every thread's, one by one, to the
// same word (H100, b 8 x 2k, d 128: the forward + backward took 65x plain attention's time).
struct GradientRun {
  float* const* grads;
  float* at;
  float sum;

  __device__ __forceinline__ void Flush() {
    if (at != nullptr) atomicAdd(at, sum);
    at = nullptr;
  }
};

// The generated DCaptures' additions (te_jax/flex/cotangents.py), through the kernels' run.
template <typename Index>
__device__ __forceinline__ void AddGradient(GradientRun& run, int capture, Index offset, float value) {
  float* const element = run.grads[capture] + offset;
  if (element != run.at) {
    run.Flush();
    run.at = element;
    run.sum = 0.0f;
  }
  run.sum += value;
}

// An element as the kernels give it to the mods: the mods' batch entry (Batch), the call's query head, query and key;
// the mods see the head, query and key from the call's offsets (a shard's first element's global indices).
struct ModIndex {
  int b, h, q, kv;
};

template <typename ScoreModT, typename MaskModT>
struct KernelMods {
  static constexpr bool kScore = !SameType<ScoreModT, NoScoreMod>::value;
  static constexpr bool kMask = !SameType<MaskModT, NoMaskMod>::value;
  static_assert(ScoreModT::kCaptures + MaskModT::kCaptures <= kMaxKernelCaptures, "the host checks the captures");
  ScoreModT score;
  MaskModT mask;
  float* const* grads;
  BlockMaskArgs block_mask;
  int batch_fold;
  // The global indices of the call's element [0, 0, 0, 0] (FlexArgs::offsets).
  int b_offset, h_offset, q_offset, kv_offset;
  const FlexArgs* flex;  // the arguments (in parameter space), for what only the kernels' prologue and epilogue read
  mutable GradientRun run = {};  // ScoreGrad's additions to grads (a const method: the variant's algebra is const)

  // args: the kernel's arguments, a WithFlex<Args> (the kernel's entry point takes one where its variant has mods).
  template <typename Args>
  __device__ __forceinline__ static KernelMods Of(const Args& args) {
    const FlexArgs& f = static_cast<const WithFlex<Args>&>(args).flex;
    const uint2 bh = __ldg(reinterpret_cast<const uint2*>(f.offsets));
    const uint2 qkv = __ldg(reinterpret_cast<const uint2*>(f.offsets) + 1);
    return {ScoreModT::Bind(f.captures),
            MaskModT::Bind(f.captures + ScoreModT::kCaptures),
            f.grads,
            f.block_mask,
            f.batch_fold,
            static_cast<int>(bh.x),
            static_cast<int>(bh.y),
            static_cast<int>(qkv.x),
            static_cast<int>(qkv.y),
            &f};
  }

  // A CTA's capture gradients in shared memory (`scratch`: gradient_scratch_floats floats after kMaxKernelCaptures
  // pointers), where the call's fit (FlexArgs): Begin zeroes them and points grads at them (`thread` of `threads`,
  // which then meet at a barrier), End adds them to memory after the CTA's last addition (each thread's run flushed
  // by FlushGradientRun before that barrier).
  template <int kThreads>
  __device__ __forceinline__ void BeginScratchGradients(float** scratch, int thread) {
    if (!kScore || flex->gradient_scratch_floats == 0) return;
    float* values = reinterpret_cast<float*>(scratch + kMaxKernelCaptures);
    for (int i = thread; i < flex->gradient_scratch_floats; i += kThreads) values[i] = 0.0f;
    if (thread < kMaxKernelCaptures) {
      scratch[thread] = flex->gradient_scratch[thread] < 0 ? nullptr : values + flex->gradient_scratch[thread];
    }
    grads = scratch;
  }
  template <int kThreads>
  __device__ __forceinline__ void EndScratchGradients(float* const* scratch, int thread) const {
    if (!kScore || flex->gradient_scratch_floats == 0) return;
    for (int c = 0; c < kMaxKernelCaptures; ++c) {
      if (scratch[c] == nullptr) continue;
      for (int i = thread; i < flex->gradient_elements[c]; i += kThreads) {
        const float value = scratch[c][i];
        if (value != 0.0f) atomicAdd(flex->grads[c] + i, value);
      }
    }
  }

  __device__ __forceinline__ void FlushGradientRun() const {
    if constexpr (kScore) run.Flush();
  }

  // The mods' batch entry of the call's (folded) batch entry b.
  __device__ __forceinline__ int Batch(int b) const { return (b + b_offset) / batch_fold; }

  // The block mask's states over queries [q0, q1) x keys [k0, k1) (both non-empty) of the mods' batch entry b and
  // head h: whether some block is not all hidden, and whether every block is all visible. Without a block mask every
  // pair may be shown, and none is known visible.
  template <typename F>
  __device__ __forceinline__ bool AllBlocks(int b, int h, int q0, int q1, int k0, int k1, F&& f) const {
    const BlockMaskArgs& m = block_mask;
    h += h_offset, q0 += q_offset, q1 += q_offset, k0 += kv_offset, k1 += kv_offset;
    const int8_t* blocks = m.blocks + b * m.batch_stride + h * m.head_stride;
    const int r1 = min((q1 - 1) / m.block_q, m.rows - 1), c1 = min((k1 - 1) / m.block_kv, m.cols - 1);
    bool all = true;
    for (int r = q0 / m.block_q; r <= r1; ++r)
      for (int c = k0 / m.block_kv; c <= c1; ++c) all = all && f(blocks[static_cast<int64_t>(r) * m.cols + c]);
    return all;
  }
  __device__ __forceinline__ bool AnyShown(int b, int h, int q0, int q1, int k0, int k1) const {
    if (!kMask || block_mask.blocks == nullptr) return true;
    return !AllBlocks(b, h, q0, q1, k0, k1, [](int8_t state) { return state == kBlockHidden; });
  }
  __device__ __forceinline__ bool AllVisible(int b, int h, int q0, int q1, int k0, int k1) const {
    if (!kMask || block_mask.blocks == nullptr) return false;
    return AllBlocks(b, h, q0, q1, k0, k1, [](int8_t state) { return state == kBlockVisible; });
  }

  // Narrows tiles [begin, end) of kTile rows on the side a CTA steps along (keys, or queries where kStepsQueries) to
  // the first and last whose blocks with the CTA's own rows [own0, own1) are not all hidden, for any head of
  // [h0, h1); an empty range where none is. A whole warp calls it (32 tiles a round from each end).
  template <int kTile, bool kStepsQueries>
  __device__ __forceinline__ void NarrowTiles(int b, int h0, int h1, int own0, int own1, int& begin, int& end) const {
    if (!kMask || block_mask.blocks == nullptr || begin >= end) return;
    if (block_mask.head_stride == 0) h1 = h0 + 1;
    const int lane = static_cast<int>(threadIdx.x & 31);
    auto shown = [&](int tile) {
      const int t0 = tile * kTile, t1 = t0 + kTile;
      bool any = false;
      for (int h = h0; h < h1 && !any; ++h) {
        any = kStepsQueries ? AnyShown(b, h, t0, t1, own0, own1) : AnyShown(b, h, own0, own1, t0, t1);
      }
      return any;
    };
    int first = end;
    for (int base = begin; base < end; base += 32) {
      const unsigned ballot = __ballot_sync(0xffffffffu, base + lane < end && shown(base + lane));
      if (ballot != 0) {
        first = base + __ffs(ballot) - 1;
        break;
      }
    }
    int last = first - 1;
    for (int top = end - 1; top >= first; top -= 32) {
      const unsigned ballot = __ballot_sync(0xffffffffu, top - lane >= first && shown(top - lane));
      if (ballot != 0) {
        last = top - (__ffs(ballot) - 1);
        break;
      }
    }
    begin = first;
    end = last + 1;
  }

  __device__ __forceinline__ float Score(float logit, const ModIndex& at) const {
    if constexpr (kScore) {
      return score.Score(logit, at.b, at.h + h_offset, at.q + q_offset, at.kv + kv_offset);
    } else {
      return logit;
    }
  }
  __device__ __forceinline__ bool Mask(const ModIndex& at) const {
    if constexpr (kMask) {
      return mask.Mask(at.b, at.h + h_offset, at.q + q_offset, at.kv + kv_offset);
    } else {
      return true;
    }
  }
  // The gradient of the logit the score_mod was given from ct, the loss's derivative in its Score; the captures'
  // gradients gain ct times theirs (through the thread's run: every CTA adds to the same float32 arrays, or to its
  // scratch) unless grads is null (a kernel that leaves them to another).
  __device__ __forceinline__ float ScoreGrad(float ct, float logit, const ModIndex& at) const {
    if constexpr (kScore) {
      if (ct == 0.0f) return 0.0f;  // a hidden key passes no gradient, even where DScore is not finite
      const int h = at.h + h_offset, q = at.q + q_offset, kv = at.kv + kv_offset;
      if (grads != nullptr) {
        run.grads = grads;
        score.DCaptures(ct, logit, at.b, h, q, kv, run);
      }
      return ct * score.DScore(logit, at.b, h, q, kv);
    } else {
      return ct;
    }
  }
};

}  // namespace te_jax::cuda
