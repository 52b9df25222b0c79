#include "cpp/cuda/attention_cuda.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "cpp/core/bias.h"
#include "cpp/core/philox.h"
#include "cpp/core/validate.h"
#include "cpp/cuda/cudnn/cudnn_attention.h"
#include "cpp/cuda/decode_geometry.h"
#include "cpp/cuda/dynamic_libs.h"
#include "cpp/cuda/kernel_args.h"
#include "cpp/cuda/kernel_registry.h"
#include "cpp/cuda/kernels/common/tile_size.h"
#include "cpp/cuda/kernels/decode/tile_size.h"
#include "cpp/cuda/kernels/sm80/tile_size.h"
#include "cpp/cuda/kernels/sm90/tile_size.h"
#include "cpp/cuda/tensor_maps.h"
#include "cpp/cuda/token_workspace.h"

namespace te_jax::cuda {
namespace {

// With positions the causal mask and the window act on positions (TokenArgs), and the index-based mask is off.
ShapeArgs MakeShape(const AttentionParams& p) {
  ShapeArgs s;
  s.batch = static_cast<int32_t>(p.batch);
  s.seqlen_q = static_cast<int32_t>(p.seqlen_q);
  s.seqlen_kv = static_cast<int32_t>(p.seqlen_kv);
  s.num_heads = static_cast<int32_t>(p.num_heads);
  s.num_kv_heads = static_cast<int32_t>(p.num_kv_heads);
  s.mask_type = static_cast<int32_t>(p.has_positions ? MaskType::kNoMask : p.mask_type);
  s.window_left = static_cast<int32_t>(p.has_positions ? -1 : p.window_left);
  s.window_right = static_cast<int32_t>(p.has_positions ? -1 : p.window_right);
  s.scale = p.scale;
  s.softcap = p.softcap;
  return s;
}

// The loaded module of a call's configuration on the current device, and its kernel family.
struct CallModule {
  const LoadedModule* module = nullptr;
  KernelFamily family = KernelFamily::kSm80;
  Sm90ForwardKernel sm90_forward;  // the sm90 forward module's kernel the call takes
  bool documents = false;          // the call may take the module's document kernels (Sm90ReadsDocuments)
  CUdevice device = 0;
};

Status Module(const AttentionParams& params, Direction direction, CallModule* call) {
  std::string arch;
  TE_JAX_RETURN_IF_ERROR(CurrentDeviceArch(&call->device, &arch));
  KernelConfig config;
  TE_JAX_RETURN_IF_ERROR(ConfigFor(params, direction, arch, &config));
  call->family = config.Family();
  if (call->family == KernelFamily::kSm90) {
    if (direction == Direction::kForward) {
      TE_JAX_RETURN_IF_ERROR(Sm90ForwardKernelFor(config, params, &call->sm90_forward));
    }
    TE_JAX_RETURN_IF_ERROR(Sm90ReadsDocuments(config, &call->documents));
  }
  JitReport report;
  return GetLoadedModule(config, call->device, &call->module, &report);
}

// `dependent`: launched with programmatic stream serialization, so it may start during the previous kernel's tail
// (the kernel waits for that kernel's results: kernels/primitives/dependent_launch.h).
template <typename Args>
Status Launch(const DriverApi* driver, CUkernel kernel, const char* what, unsigned gx, unsigned gy, unsigned gz,
              unsigned threads, unsigned smem, CUstream stream, Args* args, bool dependent = false) {
  if (gx == 0 || gy == 0 || gz == 0) return Status::Ok();
  void* params[] = {args};
  CUresult r;
  if (dependent) {
    CUlaunchAttribute attribute{};
    attribute.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attribute.value.programmaticStreamSerializationAllowed = 1;
    const CUlaunchConfig config{gx, gy, gz, threads, 1, 1, smem, stream, &attribute, 1};
    r = driver->cuLaunchKernelEx(&config, reinterpret_cast<CUfunction>(kernel), params, nullptr);
  } else {
    r = driver->cuLaunchKernel(reinterpret_cast<CUfunction>(kernel), gx, gy, gz, threads, 1, 1, smem, stream, params,
                               nullptr);
  }
  if (r != CUDA_SUCCESS) return Status::Internal(std::string("te_jax ") + what + " launch failed: " + driver->ErrorString(r));
  return Status::Ok();
}

// The captures of a call with mods as the kernels read them (kernel_args.h), strides row-major, and the offsets of its
// indices (`operands.dropout`); `grads` (the backward's, null in the forward): the score_mod's capture gradients,
// flex.num_capture_gradients() of them, added up in the dk/dv kernel's `scratch_bytes` of shared memory first where
// they fit.
FlexArgs MakeFlexArgs(const AttentionParams& p, const AttentionOperands& operands, void* const* grads,
                      int scratch_bytes = 0) {
  FlexArgs f{};
  const FlexSpec& flex = p.flex;
  const void* const* captures = operands.flex_captures;
  f.offsets = operands.dropout + 2;
  for (int64_t i = 0; i < flex.num_captures(); ++i) {
    KernelCapture& c = f.captures[i];
    c.data = captures[i];
    const std::vector<int64_t>& shape = flex.capture_shapes[i];
    int64_t stride = 1;
    for (int64_t axis = static_cast<int64_t>(shape.size()) - 1; axis >= 0; --axis) {
      c.shape[axis] = shape[axis];
      c.strides[axis] = stride;
      stride *= shape[axis];
    }
  }
  const std::vector<int64_t> gradients = flex.gradient_captures();
  for (size_t i = 0; grads != nullptr && i < gradients.size(); ++i) {
    f.grads[gradients[i]] = static_cast<float*>(grads[i]);
  }
  int64_t floats = 0;
  for (int i = 0; i < kMaxKernelCaptures; ++i) {
    f.gradient_scratch[i] = -1;
    if (f.grads[i] == nullptr) continue;
    f.gradient_scratch[i] = static_cast<int32_t>(floats);
    f.gradient_elements[i] = static_cast<int32_t>(flex.capture_elements(i));
    floats += flex.capture_elements(i);
  }
  const bool fits = floats * 4 + 8 * kMaxKernelCaptures <= scratch_bytes;
  f.gradient_scratch_floats = fits ? static_cast<int32_t>(floats) : 0;
  f.batch_fold = static_cast<int32_t>(flex.batch_fold);
  if (flex.has_block_mask()) {
    const std::vector<int64_t>& shape = flex.capture_shapes.back();  // [B' or 1, H or 1, rows, cols]
    const KernelCapture& blocks = f.captures[flex.num_captures() - 1];
    f.block_mask = BlockMaskArgs{static_cast<const int8_t*>(blocks.data),
                                 shape[0] == 1 ? 0 : blocks.strides[0],
                                 shape[1] == 1 ? 0 : blocks.strides[1],
                                 static_cast<int32_t>(flex.block_q),
                                 static_cast<int32_t>(flex.block_kv),
                                 static_cast<int32_t>(shape[2]),
                                 static_cast<int32_t>(shape[3])};
  }
  return f;
}

// An attention kernel's launch: with mods (`flex` not null) its arguments are WithFlex<Args> (kernel_args.h).
template <typename Args>
Status LaunchAttention(const DriverApi* driver, CUkernel kernel, const char* what, unsigned gx, unsigned gy,
                       unsigned gz, unsigned threads, unsigned smem, CUstream stream, Args* args,
                       const FlexArgs* flex) {
  if (flex == nullptr) return Launch(driver, kernel, what, gx, gy, gz, threads, smem, stream, args);
  WithFlex<Args> with;
  static_cast<Args&>(with) = *args;
  with.flex = *flex;
  return Launch(driver, kernel, what, gx, gy, gz, threads, smem, stream, &with);
}

unsigned CeilDiv(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

// The kernels' dropout arguments: the operand, the threshold and 1 / the keep probability.
DropoutArgs MakeDropoutArgs(const AttentionParams& p, const uint32_t* operand) {
  if (p.dropout_threshold == 0) return DropoutArgs{nullptr, 0, 1.0f};
  return DropoutArgs{operand, p.dropout_threshold, static_cast<float>(DropoutKeepScale(p.dropout_threshold))};
}

Status CheckWorkspace(int64_t given, int64_t needed, const char* direction) {
  if (given >= needed) return Status::Ok();
  return Status::InvalidArgument(std::string("the ") + direction + "'s workspace has " + std::to_string(given) +
                                 " bytes; this call needs " + std::to_string(needed));
}

// The bias operand for the kernels (zeros without a bias). The kernels copy it in 16-byte chunks, so its buffer must
// start on a 16-byte boundary, which XLA's buffers always do.
Status MakeBiasArgs(const AttentionParams& p, const void* data, BiasArgs* args) {
  *args = BiasArgs{};
  if (!p.has_bias) return Status::Ok();
  if (reinterpret_cast<uintptr_t>(data) % 16 != 0) {
    return Status::InvalidArgument("the CUDA kernels read the bias in 16-byte chunks: its buffer must be 16-byte "
                                   "aligned");
  }
  const BiasLayout layout = MakeBiasLayout(p);
  args->data = data;
  args->batch_stride = layout.batch_stride;
  args->head_stride = layout.head_stride;
  args->query_stride = static_cast<int32_t>(layout.query_stride);  // Skv or 0: 32 bits (ValidateAttentionParams)
  args->key_stride = static_cast<int32_t>(layout.key_stride);
  args->elements = layout.elements();
  return Status::Ok();
}

// The token tables of a packed-sequence call, built by the module's last two kernels (a warp per 64-token granule of
// either side) before its attention kernels run.
template <typename Args>
Status LaunchTokenTables(const DriverApi* driver, const LoadedModule* module, const AttentionParams& p, CUstream stream,
                         Args* args) {
  if (!UsesTokens(p) || p.batch == 0) return Status::Ok();
  const int64_t granules = (p.seqlen_q + kTokenGranule - 1) / kTokenGranule + (p.seqlen_kv + kTokenGranule - 1) / kTokenGranule;
  const unsigned blocks = CeilDiv(granules, kTokenTableThreads / 32);
  const int first = module->count() - 2;
  TE_JAX_RETURN_IF_ERROR(Launch(driver, module->kernels[first], "token tables", blocks, static_cast<unsigned>(p.batch),
                                1, kTokenTableThreads, 0, stream, args));
  return Launch(driver, module->kernels[first + 1], "token spans", blocks, static_cast<unsigned>(p.batch), 1,
                kTokenTableThreads, 0, stream, args);
}

}  // namespace

Status Prepare(const AttentionParams& params, Direction direction, JitReport* report) {
  TE_JAX_RETURN_IF_ERROR(ValidateAttentionParams(params, Backend::kCuda));
  if (params.engine == Engine::kCudnn) {
    report->name = std::string("cudnn_sdpa_") + (direction == Direction::kForward ? "fwd" : "bwd");
    report->origin = "cudnn";
    return cudnn::Prepare(params, direction);
  }
  CUdevice device = 0;
  std::string arch;
  TE_JAX_RETURN_IF_ERROR(CurrentDeviceArch(&device, &arch));
  KernelConfig config;
  TE_JAX_RETURN_IF_ERROR(ConfigFor(params, direction, arch, &config));
  bool documents = false;
  if (config.Family() == KernelFamily::kSm90) {
    // TE_JAX_SM90_PERSISTENT's and TE_JAX_SM90_DOCUMENTS's values checked at jit time too.
    if (direction == Direction::kForward) {
      Sm90ForwardKernel kernel;
      TE_JAX_RETURN_IF_ERROR(Sm90ForwardKernelFor(config, params, &kernel));
    }
    TE_JAX_RETURN_IF_ERROR(Sm90ReadsDocuments(config, &documents));
  }
  const LoadedModule* module = nullptr;
  TE_JAX_RETURN_IF_ERROR(GetLoadedModule(config, device, &module, report));
  if (documents) {
    report->note = "packed rows read as documents where the ids rise in runs over keys that are the queries' tokens "
                   "(decided on the device each call), else through the token tables";
  }
  return Status::Ok();
}

// The persistent sm90 forward's work counter, in the workspace of every call that may take it (the plain product; the
// kernel is picked at run time).
constexpr int64_t kWorkCounterBytes = 16;

// te_jax's kernels: the decode kernels' partial results (or the work counter), or (never both) the token tables and
// the document table.
int64_t ForwardWorkspaceBytes(const AttentionParams& p) {
  if (p.engine == Engine::kCudnn) return cudnn::ForwardWorkspaceBytes(p);
  if (UsesTokens(p)) return TokenTablesBytes(p) + DocumentTableBytes(p);
  return std::max(DecodeWorkspaceBytes(p), kWorkCounterBytes);
}

namespace {

// The decode kernels (kernels/decode/): one decode CTA per (split, K/V head x row block, batch), then, with more than
// one split, the combine kernel (a warp per query row).
Status LaunchDecode(const DriverApi* driver, const LoadedModule* module, const AttentionParams& p,
                    const ForwardBuffers& b, const ForwardArgs& args, CUdevice device, CUstream stream) {
  int multiprocessors = 0, smem_per_multiprocessor = 0, registers_per_multiprocessor = 0;
  CUresult r = driver->cuDeviceGetAttribute(&multiprocessors, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, device);
  if (r == CUDA_SUCCESS) {
    r = driver->cuDeviceGetAttribute(&smem_per_multiprocessor,
                                     CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, device);
  }
  if (r == CUDA_SUCCESS) {
    r = driver->cuDeviceGetAttribute(&registers_per_multiprocessor,
                                     CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR, device);
  }
  if (r != CUDA_SUCCESS) return Status::Internal("cannot read the GPU's multiprocessors: " + driver->ErrorString(r));
  // The kernels keep a key's row (in the batch's K/V or in the page pool) as a 32-bit index.
  const int64_t rows = p.page_size > 0 ? p.num_pages * p.page_size : p.batch * p.seqlen_kv;
  if (rows > INT32_MAX) {
    return Status::InvalidArgument("the decode kernels address at most 2^31 - 1 key rows, this call's K/V hold " +
                                   std::to_string(rows));
  }
  const DecodeGeometry g = DecodeGeometryOnGpu(p, module->smem_bytes.data(), module->count(), multiprocessors,
                                               smem_per_multiprocessor, module->registers.data(),
                                               registers_per_multiprocessor);
  const int64_t partial_rows = g.splits * p.batch * p.seqlen_q * p.num_heads;
  if (g.splits > 1) {
    TE_JAX_RETURN_IF_ERROR(
        CheckWorkspace(b.workspace_bytes, partial_rows * (p.head_dim_v + 1) * static_cast<int64_t>(sizeof(float)),
                       "forward"));
  }
  float* partial_out = static_cast<float*>(b.workspace);
  DecodeArgs decode{args,
                    g.heads_per_block,
                    g.positions_per_block,
                    g.head_blocks,
                    g.row_blocks,
                    g.splits,
                    g.tiles_per_split,
                    partial_out,
                    partial_out == nullptr ? nullptr : partial_out + partial_rows * p.head_dim_v,
                    b.page_table,
                    p.page_size,
                    p.num_pages,
                    KvDescales{b.kv_descale, p.kv_descale_blocks, p.kv_descale_heads},
                    {},
                    {}};
  // TMA copies the K and V stages where the arch has it and the stages are swizzled tiles (kernels/decode/
  // attention_decode.cuh kTmaStages, the same conditions): a contiguous call's [B, Skv] rows a stage as one 64-row box,
  // a paged call's pool as one sequence of num_pages x page_size rows (32-bit coordinates: `rows` above) in boxes
  // within a page (PagedBoxRows). Without K/V rows (no keys, an empty pool) the kernels read none: no maps. An FP8
  // cache's maps see its rows as the 16-bit byte pairs its stages hold (decode/tile_size.h StageCols).
  const int kv_bytes = KvElementSize(p.dtype, p.kv_format);
  const int k_cols = static_cast<int>(p.head_dim) * kv_bytes / 2;
  const int v_cols = static_cast<int>(p.head_dim_v) * kv_bytes / 2;
  if (module->tma && rows > 0 && decode::SwizzledStage(decode::StageCols(static_cast<int>(p.head_dim), kv_bytes)) &&
      decode::SwizzledStage(decode::StageCols(static_cast<int>(p.head_dim_v), kv_bytes))) {
    const bool paged = p.page_size > 0;
    const int64_t batch = paged ? 1 : p.batch, seqlen = paged ? rows : p.seqlen_kv;
    const int box_rows = paged ? decode::PagedBoxRows(p.page_size) : decode::kBlockN;
    TE_JAX_RETURN_IF_ERROR(EncodeHeadsTensorMap(driver, p.dtype, b.k, batch, seqlen, p.num_kv_heads, k_cols,
                                                box_rows, &decode.k_map));
    TE_JAX_RETURN_IF_ERROR(EncodeHeadsTensorMap(driver, p.dtype, b.v, batch, seqlen, p.num_kv_heads, v_cols,
                                                box_rows, &decode.v_map));
  }
  TE_JAX_RETURN_IF_ERROR(Launch(driver, module->kernels[g.kernel], "attention decode", static_cast<unsigned>(g.splits),
                                static_cast<unsigned>(p.num_kv_heads * g.row_blocks), static_cast<unsigned>(p.batch),
                                decode::kThreads, module->smem_bytes[g.kernel], stream, &decode));
  if (g.splits == 1) return Status::Ok();
  const int rows_per_block = decode::kCombineThreads / 32;
  // Launched as a dependent of the decode kernel where the arch has it: its launch and start overlap the decode
  // kernel's epilogues, which allow it (kernels/primitives/dependent_launch.h).
  return Launch(driver, module->kernels[decode::kCombineKernel], "attention decode combine",
                CeilDiv(p.batch * p.seqlen_q * p.num_heads, rows_per_block), 1, 1, decode::kCombineThreads, 0, stream,
                &decode, module->dependent_launch);
}

}  // namespace

// A counter in the workspace, from 0 each call: the persistent kernels' CTAs take works from it, the table kernel's
// count their chunks.
Status ZeroCounter(const DriverApi* driver, void* counter, const char* what, CUstream stream) {
  const CUresult r = driver->cuMemsetD32Async(reinterpret_cast<CUdeviceptr>(counter), 0u, 1, stream);
  if (r != CUDA_SUCCESS) return Status::Internal(std::string("cannot zero ") + what + ": " + driver->ErrorString(r));
  return Status::Ok();
}

// A packed row read as documents (kernels/common/document_tables.cuh): the table's kernel (a CTA per chunk of a row)
// first, so the token tables' kernels step aside where it holds; then the document kernel, one CTA per multiprocessor,
// before the token kernel, which steps aside where the table holds (else the document kernel does). Entries 1 and 2 of
// the module (sm90_module.cc); the document kernel's tile is the plain product's, whose K/V boxes the token kernel's
// maps share where the two tiles agree.
constexpr int kDocumentKernelEntry = 1;
constexpr int kDocumentTableEntry = 2;
// The backward module's (sm90_module.cc): after the row kernels and the dk/dv kernel.
constexpr int kBackwardDocumentKernelEntry = 3;
constexpr int kBackwardDocumentTableEntry = 4;

template <typename Args>
Status LaunchDocumentTable(const DriverApi* driver, const LoadedModule* module, int entry, Args* args,
                           CUstream stream) {
  // The count of finished chunks, by which the last CTA knows it is (kernel_args.h).
  TE_JAX_RETURN_IF_ERROR(ZeroCounter(driver, args->tokens.documents + 3, "the document table's counter", stream));
  const int64_t chunks = DocumentTableLayout::Chunks(args->shape.batch, args->shape.seqlen_q);
  return Launch(driver, module->kernels[entry], "document table", static_cast<unsigned>(chunks), 1, 1,
                kDocumentTableThreads, 0, stream, args);
}

Status LaunchDocuments(const DriverApi* driver, const LoadedModule* module, const AttentionParams& p,
                       const TmaForwardArgs& token_call, const sm90::ForwardTile& token_tile, int multiprocessors,
                       CUstream stream) {
  const int d = static_cast<int>(p.head_dim), dv = static_cast<int>(p.head_dim_v);
  const sm90::ForwardTile tile = sm90::ForwardTileSize(d, dv);
  if (tile.block_m != token_tile.block_m || tile.block_n != token_tile.block_n) {
    return Status::Internal("the document kernel's tile differs from the token kernel's (sm90/tile_size.h)");
  }
  TmaForwardArgs tma = token_call;
  tma.next_work = reinterpret_cast<unsigned*>(tma.args.tokens.documents + 2);  // zeroed by the table kernel
  return Launch(driver, module->kernels[kDocumentKernelEntry], "attention forward (documents)",
                static_cast<unsigned>(multiprocessors), 1, 1, sm90::ForwardThreads(tile),
                module->smem_bytes[kDocumentKernelEntry], stream, &tma);
}

Status AttentionForward(const AttentionParams& p, const ForwardBuffers& b, CUstream stream) {
  TE_JAX_RETURN_IF_ERROR(ValidateAttentionParams(p, Backend::kCuda));
  if (p.engine == Engine::kCudnn) {
    TE_JAX_RETURN_IF_ERROR(CheckWorkspace(b.workspace_bytes, cudnn::ForwardWorkspaceBytes(p), "forward"));
    return cudnn::Forward(p, b, stream);
  }
  const DriverApi* driver = nullptr;
  TE_JAX_RETURN_IF_ERROR(GetDriver(&driver));
  CallModule call;
  TE_JAX_RETURN_IF_ERROR(Module(p, Direction::kForward, &call));
  TE_JAX_RETURN_IF_ERROR(CheckWorkspace(b.workspace_bytes, ForwardWorkspaceBytes(p), "forward"));
  BiasArgs bias;
  TE_JAX_RETURN_IF_ERROR(MakeBiasArgs(p, b.bias, &bias));
  ForwardArgs args{MakeShape(p), b.q, b.k, b.v, QuerySeqlensRead(p, b.q_seqlens), b.kv_seqlens, b.alibi_slopes,
                   b.out, b.lse, p.has_sinks ? b.sinks : nullptr,
                   MakeTokenArgs(p, b.q_segment_ids, b.kv_segment_ids, b.q_positions, b.kv_positions, b.workspace),
                   MakeDropoutArgs(p, b.dropout),
                   bias};
  const int d = static_cast<int>(p.head_dim), dv = static_cast<int>(p.head_dim_v);
  if (call.family == KernelFamily::kDecode) {
    if (p.batch == 0 || p.num_heads == 0) return Status::Ok();
    return LaunchDecode(driver, call.module, p, b, args, call.device, stream);
  }
  if (call.family == KernelFamily::kSm80) {
    TE_JAX_RETURN_IF_ERROR(LaunchTokenTables(driver, call.module, p, stream, &args));
    const sm80::TileSize tile = sm80::ForwardTileSize(d, dv, p.has_bias);
    return Launch(driver, call.module->kernels[0], "attention forward", CeilDiv(p.seqlen_q, tile.block_m),
                  static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch), 32 * tile.warps,
                  call.module->smem_bytes[0], stream, &args);
  }
  if (p.seqlen_q == 0 || p.batch == 0) return Status::Ok();  // nothing to write, and no tensor map of zero extent
  // A packed row the document kernel may serve: the document table follows the token tables.
  const bool documents = call.documents && DocumentTableBytes(p) > 0;
  if (documents) {
    args.tokens.documents = reinterpret_cast<int32_t*>(static_cast<char*>(b.workspace) + TokenTablesBytes(p));
    TE_JAX_RETURN_IF_ERROR(LaunchDocumentTable(driver, call.module, kDocumentTableEntry, &args, stream));
  }
  TE_JAX_RETURN_IF_ERROR(LaunchTokenTables(driver, call.module, p, stream, &args));
  const Sm90ForwardKernel kernel = call.sm90_forward;
  // FP8 attention: q and k as byte pairs (d / 2 16-bit columns: the FP8 kernel's tiles), v as V^T, the descales operand.
  const bool fp8 = IsFp8(p.q_format);
  const sm90::ForwardTile tile = sm90::ForwardTileSize(d, dv, UsesTokens(p), kernel.consumers,
                                                       p.has_bias ? DTypeSize(p.bias_dtype) : 0, fp8 ? 1 : 2);
  const int qk_cols = fp8 ? d / 2 : d;
  if (fp8) args.fp8_descales = b.kv_descale;
  TmaForwardArgs tma{args, {}, {}, {}, {}, nullptr};
  TE_JAX_RETURN_IF_ERROR(
      EncodeHeadsTensorMap(driver, p.dtype, b.q, p.batch, p.seqlen_q, p.num_heads, qk_cols, tile.block_m, &tma.q));
  if (p.seqlen_kv == 0) {
    // No row sees a key: the kernel loads no k or v, and their maps need only be valid ones (q's stands in).
    tma.k = tma.v = tma.q;
  } else {
    TE_JAX_RETURN_IF_ERROR(EncodeHeadsTensorMap(driver, p.dtype, b.k, p.batch, p.seqlen_kv, p.num_kv_heads, qk_cols,
                                                tile.block_n, &tma.k));
    TE_JAX_RETURN_IF_ERROR(
        fp8 ? EncodeTransposedValuesTensorMap(driver, b.v, p.batch, p.seqlen_kv, p.num_kv_heads, dv, &tma.v)
            : EncodeHeadsTensorMap(driver, p.dtype, b.v, p.batch, p.seqlen_kv, p.num_kv_heads, dv, tile.block_n,
                                   &tma.v));
  }
  // Without a bias the kernel reads no bias map (q's stands in).
  tma.bias = tma.q;
  if (p.has_bias && p.seqlen_kv > 0) {
    TE_JAX_RETURN_IF_ERROR(EncodeBiasTensorMap(driver, p, b.bias, tile.block_m, &tma.bias));
  }
  const unsigned query_blocks = CeilDiv(p.seqlen_q, tile.block_m);
  unsigned grid[3] = {query_blocks, static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch)};
  int multiprocessors = 0;
  if (kernel.persistent || documents) {
    const CUresult r =
        driver->cuDeviceGetAttribute(&multiprocessors, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, call.device);
    if (r != CUDA_SUCCESS) return Status::Internal("cannot read the GPU's multiprocessors: " + driver->ErrorString(r));
  }
  if (documents) {
    TE_JAX_RETURN_IF_ERROR(LaunchDocuments(driver, call.module, p, tma, tile, multiprocessors, stream));
  }
  if (kernel.persistent) {
    // One CTA per multiprocessor (a CTA's registers fill one), each taking query blocks in turn.
    const int64_t works = static_cast<int64_t>(query_blocks) * p.num_heads * p.batch;
    grid[0] = static_cast<unsigned>(std::min<int64_t>(works, multiprocessors));
    grid[1] = grid[2] = 1;
    tma.next_work = static_cast<unsigned*>(b.workspace);
    TE_JAX_RETURN_IF_ERROR(ZeroCounter(driver, tma.next_work, "the forward's work counter", stream));
  }
  const FlexArgs flex = p.flex.active() ? MakeFlexArgs(p, b, nullptr) : FlexArgs{};
  return LaunchAttention(driver, call.module->kernels[kernel.index], "attention forward", grid[0], grid[1], grid[2],
                         sm90::ForwardThreads(tile), call.module->smem_bytes[kernel.index], stream, &tma,
                         p.flex.active() ? &flex : nullptr);
}

namespace {

// The default backward sums dq into a float accumulator where that pays (sm80/tile_size.h), in either family (the sm90
// family serves it where its accumulators fit whole in a warpgroup, sm90/tile_size.h); the deterministic kernels run
// otherwise.
bool AccumulatesDq(const AttentionParams& p) {
  return !p.deterministic &&
         BackwardAccumulatesDq(static_cast<int>(p.head_dim), static_cast<int>(p.head_dim_v));
}

// The sm90 backward's four tensor maps (64-row boxes, kernels/sm90/attention_bwd.cuh). A side with no rows has no
// tensor map of its own; the kernels load nothing of it, and the other side's stands in.
Status EncodeBackwardTensorMaps(const DriverApi* driver, const AttentionParams& p, const BackwardBuffers& b,
                                TmaBackwardArgs* tma) {
  const int rows = sm90::kBackwardBoxRows;
  const int64_t d = p.head_dim, dv = p.head_dim_v;
  if (p.seqlen_q > 0) {
    TE_JAX_RETURN_IF_ERROR(EncodeHeadsTensorMap(driver, p.dtype, b.q, p.batch, p.seqlen_q, p.num_heads, d, rows, &tma->q));
    TE_JAX_RETURN_IF_ERROR(
        EncodeHeadsTensorMap(driver, p.dtype, b.dout, p.batch, p.seqlen_q, p.num_heads, dv, rows, &tma->dout));
  }
  if (p.seqlen_kv > 0) {
    TE_JAX_RETURN_IF_ERROR(
        EncodeHeadsTensorMap(driver, p.dtype, b.k, p.batch, p.seqlen_kv, p.num_kv_heads, d, rows, &tma->k));
    TE_JAX_RETURN_IF_ERROR(
        EncodeHeadsTensorMap(driver, p.dtype, b.v, p.batch, p.seqlen_kv, p.num_kv_heads, dv, rows, &tma->v));
  }
  if (p.seqlen_q == 0) tma->q = tma->dout = tma->k;
  if (p.seqlen_kv == 0) tma->k = tma->v = tma->q;
  // Without a bias the kernels read no bias map (q's stands in).
  tma->bias = tma->q;
  if (p.has_bias && p.seqlen_q > 0 && p.seqlen_kv > 0) {
    TE_JAX_RETURN_IF_ERROR(EncodeBiasTensorMap(driver, p, b.bias, rows, &tma->bias));
  }
  return Status::Ok();
}

// The dbias accumulator to dbias (the module's entry after the attention kernels), where the call has one.
Status LaunchBiasGradConversion(const DriverApi* driver, const LoadedModule* module, BackwardArgs& args, bool needed,
                                CUstream stream) {
  if (!needed) return Status::Ok();
  // A grid-stride loop: enough blocks to fill the GPU, not one per 256 elements of a large bias.
  const unsigned blocks = CeilDiv(std::min<int64_t>(args.bias.elements, int64_t{1} << 22), kRowKernelThreads);
  return Launch(driver, module->kernels[3], "attention backward dbias conversion", blocks, 1, 1,
                kRowKernelThreads, 0, stream, &args);
}

// The float dq accumulator's bytes (0 when the call does not accumulate dq).
int64_t DqAccumBytes(const AttentionParams& p) {
  if (!AccumulatesDq(p)) return 0;
  const DqAccumLayout l =
      BackwardDqAccumLayout(static_cast<int>(p.head_dim), static_cast<int>(p.head_dim_v));
  const int64_t rows = (p.seqlen_q + l.row_block - 1) / l.row_block * l.row_block;
  return p.batch * p.num_heads * l.slices * rows * l.cols * static_cast<int64_t>(sizeof(float));
}

// The float dbias accumulator's bytes: a copy of the bias's shape where dbias sums over some dim (0 otherwise: the
// dk/dv kernel writes each element of dbias once).
int64_t DbiasAccumBytes(const AttentionParams& p) {
  return p.has_bias && BiasGradientSums(p) ? MakeBiasLayout(p).elements() * static_cast<int64_t>(sizeof(float)) : 0;
}

// te_jax's backward scratch, in order: the dq accumulator, the dbias accumulator, the token tables, each from a
// 256-byte boundary; a part the call does not use takes no bytes.
struct BackwardWorkspace {
  int64_t dbias_accum_offset;
  int64_t token_tables_offset;
  int64_t document_table_offset;  // after the token tables (DocumentTableBytes: 0 where no row can be read so)
  int64_t bytes;
};

BackwardWorkspace BackwardWorkspaceLayout(const AttentionParams& p) {
  BackwardWorkspace w;
  const int64_t dq = DqAccumBytes(p), dbias = DbiasAccumBytes(p);
  w.dbias_accum_offset = (dq + 255) / 256 * 256;
  w.token_tables_offset = TokenTablesOffset(w.dbias_accum_offset + dbias);
  w.document_table_offset = w.token_tables_offset + TokenTablesBytes(p);
  w.bytes = UsesTokens(p) ? w.document_table_offset + DocumentTableBytes(p)
                          : dbias > 0 ? w.dbias_accum_offset + dbias : dq;
  return w;
}

}  // namespace

int64_t BackwardWorkspaceBytes(const AttentionParams& p) {
  if (p.engine == Engine::kCudnn) return cudnn::BackwardWorkspaceBytes(p);
  return BackwardWorkspaceLayout(p).bytes;
}

Status AttentionBackward(const AttentionParams& p, const BackwardBuffers& b, CUstream stream) {
  TE_JAX_RETURN_IF_ERROR(ValidateAttentionParams(p, Backend::kCuda));
  TE_JAX_RETURN_IF_ERROR(ValidateBackwardParams(p, Backend::kCuda));
  TE_JAX_RETURN_IF_ERROR(CheckWorkspace(b.workspace_bytes, BackwardWorkspaceBytes(p), "backward"));
  if (p.engine == Engine::kCudnn) return cudnn::Backward(p, b, stream);
  const DriverApi* driver = nullptr;
  TE_JAX_RETURN_IF_ERROR(GetDriver(&driver));
  CallModule call;
  TE_JAX_RETURN_IF_ERROR(Module(p, Direction::kBackward, &call));
  const LoadedModule* module = call.module;
  const bool accumulate_dq = AccumulatesDq(p);
  float* dq_accum = accumulate_dq ? static_cast<float*>(b.workspace) : nullptr;
  const BackwardWorkspace workspace = BackwardWorkspaceLayout(p);
  void* token_tables = static_cast<char*>(b.workspace) + workspace.token_tables_offset;
  BiasArgs bias;
  TE_JAX_RETURN_IF_ERROR(MakeBiasArgs(p, b.bias, &bias));
  const bool dbias_accum = DbiasAccumBytes(p) > 0;
  BackwardArgs args{MakeShape(p),
                    b.q,
                    b.k,
                    b.v,
                    b.out,
                    b.lse,
                    b.dout,
                    b.dlse,
                    QuerySeqlensRead(p, b.q_seqlens),
                    b.kv_seqlens,
                    b.alibi_slopes,
                    b.dq,
                    b.dk,
                    b.dv,
                    static_cast<float*>(b.dq),
                    dq_accum,
                    MakeTokenArgs(p, b.q_segment_ids, b.kv_segment_ids, b.q_positions, b.kv_positions, token_tables),
                    MakeDropoutArgs(p, b.dropout),
                    bias,
                    b.dbias,
                    dbias_accum ? reinterpret_cast<float*>(static_cast<char*>(b.workspace) + workspace.dbias_accum_offset)
                                : nullptr};
  // Without a single (b, h, i, j) pair no kernel adds to dbias, whose elements (of size-1 dims) are then all 0.
  const bool no_pairs = p.batch == 0 || p.seqlen_q == 0 || p.seqlen_kv == 0;
  // The score_mod's capture gradients: the dk/dv kernel adds to them.
  const std::vector<int64_t> gradients = p.flex.gradient_captures();
  for (size_t i = 0; i < gradients.size(); ++i) {
    const int64_t elements = p.flex.capture_elements(gradients[i]);
    if (elements == 0) continue;
    const CUresult r = driver->cuMemsetD32Async(reinterpret_cast<CUdeviceptr>(b.flex_capture_grads[i]), 0,
                                                static_cast<size_t>(elements), stream);
    if (r != CUDA_SUCCESS) {
      return Status::Internal("te_jax: zeroing the capture gradients failed: " + driver->ErrorString(r));
    }
  }
  const int scratch = call.family == KernelFamily::kSm90 && p.flex.has_score_mod()
                          ? sm90::BackwardCaptureScratchBytes(
                                static_cast<int>(p.head_dim), static_cast<int>(p.head_dim_v),
                                accumulate_dq ? sm90::BackwardKernelKind::kDkDvAccumulatingDq
                                              : sm90::BackwardKernelKind::kDkDv,
                                UsesTokens(p), p.dropout_threshold > 0, p.has_bias ? DTypeSize(p.bias_dtype) : 0)
                          : 0;
  const FlexArgs flex =
      p.flex.active() ? MakeFlexArgs(p, b, b.flex_capture_grads, scratch) : FlexArgs{};
  const FlexArgs* mods = p.flex.active() ? &flex : nullptr;
  if (p.has_bias && no_pairs) {
    const CUresult r = driver->cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(b.dbias), 0,
                                               static_cast<size_t>(args.bias.elements * DTypeSize(p.bias_dtype)), stream);
    if (r != CUDA_SUCCESS) return Status::Internal("te_jax: zeroing dbias failed: " + driver->ErrorString(r));
  }
  const int d = static_cast<int>(p.head_dim), dv = static_cast<int>(p.head_dim_v);
  // A packed row the document kernel may serve: its table first, so the token tables' kernels step aside where it
  // holds.
  const bool documents = call.documents && DocumentTableBytes(p) > 0 && p.batch > 0;
  if (documents) {
    args.tokens.documents =
        reinterpret_cast<int32_t*>(static_cast<char*>(b.workspace) + workspace.document_table_offset);
    TE_JAX_RETURN_IF_ERROR(LaunchDocumentTable(driver, module, kBackwardDocumentTableEntry, &args, stream));
  }
  TE_JAX_RETURN_IF_ERROR(LaunchTokenTables(driver, module, p, stream, &args));
  const unsigned row_blocks = CeilDiv(p.batch * p.seqlen_q * p.num_heads, kRowKernelThreads / 32);
  TE_JAX_RETURN_IF_ERROR(Launch(driver, module->kernels[0], "attention backward preprocess", row_blocks, 1, 1,
                                kRowKernelThreads, module->smem_bytes[0], stream, &args));
  if (call.family == KernelFamily::kSm90) {
    if (p.batch == 0) return Status::Ok();
    TmaBackwardArgs tma{args, {}, {}, {}, {}, {}};
    TE_JAX_RETURN_IF_ERROR(EncodeBackwardTensorMaps(driver, p, b, &tma));
    const unsigned owned = sm90::BackwardOwnedRows(d, dv);
    // With seqlen_q == 0 the dk/dv kernel still runs: it writes zeros (or NaN) to every dk and dv element. Its grid is
    // (key blocks, kv heads, batch), with a bias (batch, key blocks, kv heads) (kernels/sm90/attention_bwd.cuh).
    const unsigned key_blocks = CeilDiv(p.seqlen_kv, owned), heads = static_cast<unsigned>(p.num_kv_heads),
                   batch = static_cast<unsigned>(p.batch);
    if (documents) {
      // A CTA per (work, kv head) the grid has room for; the token kernel after it steps aside where the table holds.
      const auto works = static_cast<unsigned>(DocumentWorksOfGrid(p.batch, p.seqlen_kv, owned));
      TE_JAX_RETURN_IF_ERROR(Launch(driver, module->kernels[kBackwardDocumentKernelEntry],
                                    "attention backward dk/dv (documents)", works, heads, 1,
                                    sm90::kBackwardThreads, module->smem_bytes[kBackwardDocumentKernelEntry], stream,
                                    &tma));
    }
    TE_JAX_RETURN_IF_ERROR(LaunchAttention(driver, module->kernels[1], "attention backward dk/dv",
                                           p.has_bias ? batch : key_blocks, p.has_bias ? key_blocks : heads,
                                           p.has_bias ? heads : batch, sm90::kBackwardThreads, module->smem_bytes[1],
                                           stream, &tma, mods));
    if (accumulate_dq) {
      TE_JAX_RETURN_IF_ERROR(Launch(driver, module->kernels[2], "attention backward dq conversion", row_blocks, 1, 1,
                                    kRowKernelThreads, module->smem_bytes[2], stream, &args));
    } else {
      TE_JAX_RETURN_IF_ERROR(LaunchAttention(driver, module->kernels[2], "attention backward dq",
                                             CeilDiv(p.seqlen_q, owned), static_cast<unsigned>(p.num_heads),
                                             static_cast<unsigned>(p.batch), sm90::kBackwardThreads,
                                             module->smem_bytes[2], stream, &tma, mods));
    }
    return LaunchBiasGradConversion(driver, module, args, dbias_accum && !no_pairs, stream);
  }
  const sm80::TileSize dkdv = sm80::BackwardDkDvTileSize(d, dv, accumulate_dq, p.has_bias);
  // With seqlen_q == 0 the dk/dv kernel still runs: it writes zeros (or NaN) to every dk and dv element.
  TE_JAX_RETURN_IF_ERROR(Launch(driver, module->kernels[1], "attention backward dk/dv", CeilDiv(p.seqlen_kv, dkdv.block_m),
                                static_cast<unsigned>(p.num_kv_heads), static_cast<unsigned>(p.batch * dkdv.slices),
                                32 * dkdv.warps, module->smem_bytes[1], stream, &args));
  if (accumulate_dq) {
    TE_JAX_RETURN_IF_ERROR(Launch(driver, module->kernels[2], "attention backward dq conversion", row_blocks, 1, 1,
                                  kRowKernelThreads, module->smem_bytes[2], stream, &args));
  } else {
    const sm80::TileSize dq = sm80::BackwardDqTileSize(d, dv, p.has_bias);
    TE_JAX_RETURN_IF_ERROR(Launch(driver, module->kernels[2], "attention backward dq", CeilDiv(p.seqlen_q, dq.block_m),
                                  static_cast<unsigned>(p.num_heads), static_cast<unsigned>(p.batch), 32 * dq.warps,
                                  module->smem_bytes[2], stream, &args));
  }
  return LaunchBiasGradConversion(driver, module, args, dbias_accum && !no_pairs, stream);
}

}  // namespace te_jax::cuda
