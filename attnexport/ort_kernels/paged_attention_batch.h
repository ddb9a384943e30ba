// What the PagedAttention kernel's two paths share (paged_attention.cc: checks, work items,
// decode; paged_prefill.cc: the tiled prefill): the batch's inputs and a work item. Internal to
// the library.
#pragma once

#include <onnxruntime_c_api.h>

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "vector_math.h"

namespace attnexport {

constexpr int64_t kMaxHeadSize = 256;
constexpr ONNXTensorElementDataType kFloat32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr ONNXTensorElementDataType kFloat16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr ONNXTensorElementDataType kBFloat16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
constexpr ONNXTensorElementDataType kInt8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;

// Queries [first_query, first_query + num_queries) of sequence `seq` (indices within its
// queries), heads of KV heads [kv_begin, kv_end), against the keys of blocks
// [block_begin, block_end) of its table. partial < 0: the item writes its output rows; else it
// is one split of a long decode context and leaves its running maximum, sum and unnormalised
// output in Batch::partials slot `partial` (the rows of its heads) for combine_splits.
struct WorkItem {
  int64_t seq;
  int64_t kv_begin, kv_end;
  int64_t first_query;
  int64_t num_queries;
  int64_t block_begin, block_end;
  int64_t partial;
};

// A split of one decode sequence's context: its items' partial slots [first, first + count).
struct Split {
  int64_t seq, first, count;
};

// Pointers into the inputs. The caches hold the cache type the kernel is instantiated for;
// query and output hold `query_type` (float32, float16 or bfloat16).
struct Batch {
  const void* query;
  ONNXTensorElementDataType query_type;
  const void* key_cache;
  const void* value_cache;
  const float* key_scales;    // int8 caches: [num_blocks, block_size, num_kv_heads]; else null
  const float* value_scales;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start;
  std::vector<float> slopes;  // empty: no ALiBi (all slopes zero)
  int64_t max_blocks;
  void* out;
  int64_t multiply_adds;  // an upper bound for the whole batch
  // Per partial slot: num_heads rows of [maximum, sum, W output lanes] (W = padded head size).
  float* partials = nullptr;
  std::vector<float> sinks;  // per head; empty: no attention sinks
};

// 1 / the softmax denominator of head `head`'s row whose keys' weights exp(s - max) sum to
// `sum`: with attention sinks, the sink joins it as a key of logit sinks[head] and zero value.
// A row that sees no key (sum 0) is zeros, sinks or not.
inline float softmax_inverse(const Batch& batch, int64_t head, float sum, float max) {
  if (!(sum > 0.0f)) return 0.0f;
  if (batch.sinks.empty()) return 1.0f / sum;
  return 1.0f / (sum + std::exp(batch.sinks[head] - max));
}

// The prefill path's plan (paged_prefill.cc). Every (sequence, KV head) of a sequence with more
// than one query has the keys its queries can see, [first, first + count), packed once as
// float32 into `storage`, a chunk of kPrefillChunkKeys keys at a time: the chunk's keys as a
// transposed [head_size, kPrefillChunkKeys] panel at keys + chunk * head_size *
// kPrefillChunkKeys, its values as rows of W floats at values + chunk * kPrefillChunkKeys * W.
struct PackedKeys {
  int64_t seq, head, first, count;
  int64_t keys, values;  // offsets into PrefillPlan::storage
};

// Query tokens [first_query, first_query + num_queries) of a sequence (indices within its
// queries), the heads of one KV head, against packed keys `packed`.
struct PrefillTile {
  int64_t seq, head, first_query, num_queries, packed;
};

// With `pairs` (PagedAttention::prefill_bf16 on a CPU with AVX512_BF16), the products take
// bfloat16 pairs (panel_product.h) and the same storage holds, as uint32 words, a chunk's keys
// as a [head_size / 2, kPrefillChunkKeys] panel of pairs of dimensions and its values as
// [kPrefillChunkKeys / 2, W] pairs of keys.
struct PrefillPlan {
  std::vector<PackedKeys> packed;
  std::vector<std::pair<int64_t, int64_t>> pack_jobs;  // (packed index, chunk)
  std::vector<PrefillTile> tiles;
  int64_t floats = 0;  // of storage
  float* storage = nullptr;
  bool pairs = false;
};

// Element i of a float32/float16/bfloat16 tensor (queries, slopes: read once per item).
inline float load_element(const void* data, ONNXTensorElementDataType type, int64_t i) {
  if (type == kFloat16) return to_float(static_cast<const Half*>(data)[i]);
  if (type == kBFloat16) return to_float(static_cast<const BFloat16*>(data)[i]);
  return static_cast<const float*>(data)[i];
}

inline void store_element(void* data, ONNXTensorElementDataType type, int64_t i, float x) {
  if (type == kFloat16) static_cast<Half*>(data)[i] = from_float<Half>(x);
  else if (type == kBFloat16) static_cast<BFloat16*>(data)[i] = from_float<BFloat16>(x);
  else static_cast<float*>(data)[i] = x;
}

}  // namespace attnexport
