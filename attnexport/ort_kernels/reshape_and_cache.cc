// attnexport.ReshapeAndCache for onnxruntime's CPU execution provider (float32, float16,
// bfloat16: rows are copied as bytes).
//
// When the caller binds each cache output to its input's buffer (the runtime's IO binding),
// onnxruntime hands that buffer to the kernel as the output and the write costs O(new tokens).
// Otherwise the output is a new buffer: the cache is copied into it first, so the result is
// the same either way.

#include "reshape_and_cache.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "kernel_api.h"

namespace attnexport {

OrtStatus* ReshapeAndCache::init(const OrtKernelInfo* info) {
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "block_size", &block_size));
  if (block_size < 1) return invalid("ReshapeAndCache: block_size must be positive");
  return nullptr;
}

OrtStatus* ReshapeAndCache::compute(OrtKernelContext* context) const {
  Tensor key, value, key_cache, value_cache, slots;
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 0, &key));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 1, &value));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 2, &key_cache));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 3, &value_cache));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 4, &slots));

  if (key_cache.dims.size() != 4 || key_cache.dims[1] != block_size)
    return invalid("ReshapeAndCache: key_cache: expected [num_blocks, block_size = " +
                   std::to_string(block_size) + ", num_kv_heads, head_size], got " +
                   key_cache.shape());
  if (value_cache.dims != key_cache.dims)
    return invalid("ReshapeAndCache: value_cache: expected the key_cache's shape " +
                   key_cache.shape() + ", got " + value_cache.shape());
  const int64_t tokens = slots.dims.size() == 1 ? slots.dims[0] : -1;
  const std::vector<int64_t> token_dims{tokens, key_cache.dims[2], key_cache.dims[3]};
  if (tokens < 0 || key.dims != token_dims || value.dims != token_dims)
    return invalid("ReshapeAndCache: expected slot_mapping [num_tokens] and key, value "
                   "[num_tokens, num_kv_heads, head_size] matching the caches; got slot_mapping " +
                   slots.shape() + ", key " + key.shape() + ", value " + value.shape());
  const size_t element = element_size(key_cache.type);
  if (element == 0 || key.type != key_cache.type || value.type != key_cache.type ||
      value_cache.type != key_cache.type)
    return invalid("ReshapeAndCache: key, value, key_cache and value_cache must share one "
                   "float32, float16 or bfloat16 dtype");
  if (slots.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32 &&
      slots.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64)
    return invalid("ReshapeAndCache: slot_mapping: expected int32 or int64");

  const int64_t num_slots = key_cache.dims[0] * block_size;
  std::vector<int64_t> slot(tokens);
  for (int64_t t = 0; t < tokens; ++t) {
    slot[t] = slots.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32
                  ? static_cast<const int32_t*>(slots.data)[t]
                  : static_cast<const int64_t*>(slots.data)[t];
    if (slot[t] >= num_slots)
      return invalid("ReshapeAndCache: slot_mapping[" + std::to_string(t) + "] = " +
                     std::to_string(slot[t]) + " is past the cache's " +
                     std::to_string(num_slots) + " slots");
  }
  // A slot written twice has no defined value (the op contract, docs/ops.md; the torch op
  // refuses it too). Sorting a copy of the T slots (T is the step's new tokens, small) and
  // comparing neighbours costs far less than the rows' copies below.
  std::vector<int64_t> sorted;
  sorted.reserve(tokens);
  for (int64_t s : slot)
    if (s >= 0) sorted.push_back(s);
  std::sort(sorted.begin(), sorted.end());
  const auto twice = std::adjacent_find(sorted.begin(), sorted.end());
  if (twice != sorted.end())
    return invalid("ReshapeAndCache: slot_mapping: slot " + std::to_string(*twice) +
                   " is written by more than one token");

  const size_t row = key_cache.dims[2] * key_cache.dims[3] * element;  // bytes per slot
  const Tensor* sources[2] = {&key, &value};
  const Tensor* caches[2] = {&key_cache, &value_cache};
  for (size_t i = 0; i < 2; ++i) {
    Tensor out;
    ATTNEXPORT_RETURN_IF_ERROR(make_output(context, i, caches[i]->dims, &out));
    auto* dst = static_cast<char*>(out.data);
    if (dst != caches[i]->data) std::memcpy(dst, caches[i]->data, element * caches[i]->numel());
    const auto* src = static_cast<const char*>(sources[i]->data);
    for (int64_t t = 0; t < tokens; ++t)
      if (slot[t] >= 0) std::memcpy(dst + slot[t] * row, src + t * row, row);
  }
  return nullptr;
}

}  // namespace attnexport
