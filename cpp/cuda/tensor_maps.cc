#include "cpp/cuda/tensor_maps.h"

#include <string>

#include "cpp/core/bias.h"

namespace te_jax::cuda {

static_assert(sizeof(TensorMap) == sizeof(CUtensorMap) && alignof(TensorMap) == alignof(CUtensorMap),
              "kernel_args.h's TensorMap must be a CUtensorMap");

Status EncodeHeadsTensorMap(const DriverApi* driver, DType dtype, const void* base, int64_t batch, int64_t seqlen,
                            int64_t heads, int64_t head_dim, int rows, TensorMap* map) {
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(seqlen), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(head_dim * 2), static_cast<cuuint64_t>(heads * head_dim * 2),
                                 static_cast<cuuint64_t>(seqlen * heads * head_dim * 2)};  // bytes, dims 1..3
  const cuuint32_t box[4] = {64, 1, static_cast<cuuint32_t>(rows), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult r = driver->cuTensorMapEncodeTiled(
      reinterpret_cast<CUtensorMap*>(map),
      dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
      const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Status::Internal("cannot describe a [" + std::to_string(batch) + ", " + std::to_string(seqlen) + ", " +
                            std::to_string(heads) + ", " + std::to_string(head_dim) +
                            "] operand for the TMA unit: " + driver->ErrorString(r));
  }
  return Status::Ok();
}

Status EncodeTransposedValuesTensorMap(const DriverApi* driver, const void* base, int64_t batch, int64_t seqlen_kv,
                                       int64_t kv_heads, int64_t head_dim_v, TensorMap* map) {
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(seqlen_kv / 2), static_cast<cuuint64_t>(head_dim_v),
                              static_cast<cuuint64_t>(kv_heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(seqlen_kv), static_cast<cuuint64_t>(head_dim_v * seqlen_kv),
                                 static_cast<cuuint64_t>(kv_heads * head_dim_v * seqlen_kv)};  // bytes, dims 1..3
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(head_dim_v), 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult r = driver->cuTensorMapEncodeTiled(
      reinterpret_cast<CUtensorMap*>(map), CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(base), dims, strides,
      box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Status::Internal("cannot describe the FP8 V^T operand [" + std::to_string(batch) + ", " +
                            std::to_string(kv_heads) + ", " + std::to_string(head_dim_v) + ", " +
                            std::to_string(seqlen_kv) + "] for the TMA unit: " + driver->ErrorString(r));
  }
  return Status::Ok();
}

Status EncodeBiasTensorMap(const DriverApi* driver, const AttentionParams& p, const void* base, int rows,
                           TensorMap* map) {
  const BiasLayout l = MakeBiasLayout(p);
  const int64_t size = DTypeSize(p.bias_dtype);
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(l.dims[3]), static_cast<cuuint64_t>(l.dims[2]),
                              static_cast<cuuint64_t>(l.dims[0] * l.dims[1])};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(l.dims[3] * size),
                                 static_cast<cuuint64_t>(l.dims[2] * l.dims[3] * size)};  // bytes, dims 1..2
  const cuuint32_t box[3] = {static_cast<cuuint32_t>(128 / size), static_cast<cuuint32_t>(l.dims[2] == 1 ? 1 : rows),
                             1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUtensorMapDataType type = p.bias_dtype == DType::kFloat32    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                   : p.bias_dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                      : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  const CUresult r = driver->cuTensorMapEncodeTiled(
      reinterpret_cast<CUtensorMap*>(map), type, 3, const_cast<void*>(base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return Status::Internal("cannot describe the [" + std::to_string(l.dims[0]) + ", " + std::to_string(l.dims[1]) +
                            ", " + std::to_string(l.dims[2]) + ", " + std::to_string(l.dims[3]) +
                            "] bias for the TMA unit: " + driver->ErrorString(r));
  }
  return Status::Ok();
}

}  // namespace te_jax::cuda
