// What every attnexport onnxruntime kernel shares: the C API table, reading inputs, errors.
#pragma once

#include <onnxruntime_c_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "vector_math.h"

namespace attnexport {

// The API version the kernels need (KernelContext_ParallelFor arrived in 1.17).
constexpr uint32_t kApiVersion = 17;

const OrtApi& api();
void set_api(const OrtApi* api);

// An error for onnxruntime to raise; the message names the node's input and what was expected.
OrtStatus* invalid(const std::string& message);

// A borrowed tensor: element type, dims and data pointer of an input or output.
struct Tensor {
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
  std::vector<int64_t> dims;
  void* data = nullptr;

  int64_t numel() const;
  std::string shape() const;  // format_dims(dims)
};

std::string format_dims(const std::vector<int64_t>& dims);  // "[2, 3]"

// Bytes per element of the float types the kernels take (float32, float16, bfloat16), else 0.
size_t element_size(ONNXTensorElementDataType type);
// "float32", "int8", ...: for messages.
const char* type_name(ONNXTensorElementDataType type);

// Reads input `index`; returns an error status (nullptr on success).
OrtStatus* read_input(OrtKernelContext* context, size_t index, Tensor* out);
// Reads input `index` at kernel creation when the graph holds it as a constant (an initializer):
// *constant says whether it does (and *out is empty when not).
OrtStatus* read_constant_input(const OrtKernelInfo* info, size_t index, Tensor* out,
                               bool* constant);
// Reads optional input `index`: *present is false (and *out empty) when the node leaves it out
// (fewer inputs, or the empty name "").
OrtStatus* read_optional_input(OrtKernelContext* context, size_t index, Tensor* out, bool* present);
// The number of outputs the node has (optional trailing ones may be absent).
OrtStatus* output_count(OrtKernelContext* context, size_t* count);
// Allocates (or fetches the pre-bound buffer of) output `index` with the given dims.
OrtStatus* make_output(OrtKernelContext* context, size_t index, const std::vector<int64_t>& dims,
                       Tensor* out);

// The dtypes of the paged caches of a node (ReshapeAndCache, PagedAttention) named `op` in the
// messages, once key_cache is known to be 4-d: key_cache float32, float16, bfloat16 or int8 and value_cache the same; int8 caches
// with both float32 scale caches [num_blocks, block_size, num_kv_heads] (inputs
// `key_scales_input` and the next; nullptr: the node leaves it out), float caches with neither.
OrtStatus* check_cache_dtypes(const char* op, const Tensor& key_cache, const Tensor& value_cache,
                              const Tensor* key_scales, const Tensor* value_scales,
                              int key_scales_input);

OrtStatus* int_attribute(const OrtKernelInfo* info, const char* name, int64_t* out);
OrtStatus* float_attribute(const OrtKernelInfo* info, const char* name, float* out);

// Runs fn(i) for i in [0, total) on onnxruntime's intra-op thread pool.
template <typename Fn>
OrtStatus* parallel_for(OrtKernelContext* context, size_t total, Fn& fn) {
  auto trampoline = [](void* data, size_t i) { (*static_cast<Fn*>(data))(i); };
  return api().KernelContext_ParallelFor(context, trampoline, total, 0, &fn);
}

// Returns fn(T{}) for the storage type T (float, Half, BFloat16 of vector_math.h) of `type`, one of
// the float types element_size accepts: the kernels' dtype dispatch.
template <typename Fn>
OrtStatus* with_float_type(ONNXTensorElementDataType type, Fn fn) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
      return fn(Half{});
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
      return fn(BFloat16{});
    default:
      return fn(float{});
  }
}

// Returns fn(C{}) for the cache element type C of `type`: int8_t, or a float type as
// with_float_type (check_cache_dtypes accepts these).
template <typename Fn>
OrtStatus* with_cache_type(ONNXTensorElementDataType type, Fn fn) {
  if (type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8) return fn(int8_t{});
  return with_float_type(type, fn);
}

// Runs fn(first_row, end_row) over [0, rows) in ranges of 64 rows: on the calling thread when the
// work (rows * row_elements) is small, where waking the pool costs more than it saves; on
// the intra-op thread pool otherwise.
template <typename Fn>
OrtStatus* for_row_ranges(OrtKernelContext* context, int64_t rows, int64_t row_elements, Fn fn) {
  constexpr int64_t kRowsPerItem = 64;
  constexpr int64_t kParallelElements = 1 << 18;
  if (rows * row_elements < kParallelElements) {
    fn(int64_t{0}, rows);
    return nullptr;
  }
  auto item = [&](size_t i) {
    const int64_t first = static_cast<int64_t>(i) * kRowsPerItem;
    fn(first, first + kRowsPerItem < rows ? first + kRowsPerItem : rows);
  };
  return parallel_for(context, static_cast<size_t>((rows + kRowsPerItem - 1) / kRowsPerItem), item);
}

}  // namespace attnexport

#define ATTNEXPORT_RETURN_IF_ERROR(expr)      \
  do {                                        \
    if (OrtStatus* _status = (expr)) return _status; \
  } while (0)
