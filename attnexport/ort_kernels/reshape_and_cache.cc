// attnexport.ReshapeAndCache for onnxruntime's CPU execution provider: float32, float16 or
// bfloat16 keys and values into float32, float16, bfloat16 or int8 caches. A row of the cache's
// own type is copied as bytes; another float type is converted (round to nearest even); an int8
// cache gets the row quantized with a float32 scale per slot and KV head, written to the scale
// caches (inputs 5, 6; outputs 2, 3): the op contract's formula, docs/ops.md.
//
// When the caller binds each cache output to its input's buffer (the runtime's IO binding),
// onnxruntime hands that buffer to the kernel as the output and the write costs O(new tokens).
// Otherwise the output is a new buffer: the cache is copied into it first, so the result is
// the same either way.

#include "reshape_and_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kernel_api.h"

namespace attnexport {

namespace {

constexpr ONNXTensorElementDataType kInt8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;

// Row `n` elements of S (a float type) into the cache type C: rounded to nearest even.
template <typename S, typename C>
void convert_row(const S* src, C* dst, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = from_float<C>(to_float(src[d]));
}

// A float32 row of a multiple of 8 elements into int8 as quantize_row, 8 lanes at a time: the
// same numbers (vdivps is IEEE division, vroundps to nearest even is nearbyint's rounding; a
// NaN quotient, inf / inf, becomes 0 before the clamp). One lane at a time, through libm's
// nearbyint, a batch-32 decode step's 30 int8 cache writes took ~3% of the step.
inline float quantize_row8(const float* src, int8_t* dst, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax8 = _mm256_setzero_ps(), nan8 = _mm256_setzero_ps();
  for (int64_t d = 0; d < n; d += 8) {
    const __m256 x = _mm256_loadu_ps(src + d);
    amax8 = _mm256_max_ps(_mm256_andnot_ps(sign, x), amax8);  // (a NaN lane keeps amax8's)
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  const float amax = horizontal_max(reinterpret_cast<f32x8>(amax8));
  const float scale = _mm256_movemask_ps(nan8) != 0 ? std::numeric_limits<float>::quiet_NaN()
                                                    : amax / 127.0f;
  if (!(scale > 0.0f)) {
    std::memset(dst, 0, static_cast<size_t>(n));
    return scale;
  }
  const __m256 scale8 = _mm256_set1_ps(scale), low = _mm256_set1_ps(-127.0f),
               high = _mm256_set1_ps(127.0f);
  for (int64_t d = 0; d < n; d += 8) {
    __m256 q = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(src + d), scale8),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm256_and_ps(q, _mm256_cmp_ps(q, q, _CMP_ORD_Q));
    const __m256i v = _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(q, low), high));
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + d), _mm_packs_epi16(words, words));
  }
  return scale;
}

// One row x of n elements into int8: amax = max |x|, scale = amax / 127, q = rint(x / scale)
// clamped to [-127, 127] (IEEE division, round half to even; all zeros when scale is 0). A NaN
// in the row makes amax and the scale NaN and the row zeros. Returns the scale. (Other float
// types widened into `row` first; rows of a multiple of 8 elements by quantize_row8.)
template <typename S>
float quantize_row(const S* src, int8_t* dst, int64_t n, std::vector<float>& row) {
  const float* x;
  if constexpr (std::is_same_v<S, float>) {
    x = src;
  } else {
    row.resize(n);
    for (int64_t d = 0; d < n; ++d) row[d] = to_float(src[d]);
    x = row.data();
  }
  if (n % 8 == 0) return quantize_row8(x, dst, n);
  float amax = 0.0f;
  bool nan = false;
  for (int64_t d = 0; d < n; ++d) {
    nan |= std::isnan(x[d]);
    amax = std::max(amax, std::fabs(x[d]));
  }
  const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
  for (int64_t d = 0; d < n; ++d) {
    float q = scale > 0.0f ? std::nearbyint(x[d] / scale) : 0.0f;
    q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
    dst[d] = q == q ? static_cast<int8_t>(q) : 0;  // (inf / inf)
  }
  return scale;
}

template <typename Fn>
void with_float_source(ONNXTensorElementDataType type, Fn fn) {
  with_float_type(type, [&](auto tag) -> OrtStatus* {
    fn(tag);
    return nullptr;
  });
}

}  // namespace

OrtStatus* ReshapeAndCache::init(const OrtKernelInfo* info) {
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "block_size", &block_size));
  if (block_size < 1) return invalid("ReshapeAndCache: block_size must be positive");
  return nullptr;
}

OrtStatus* ReshapeAndCache::compute(OrtKernelContext* context) const {
  Tensor key, value, key_cache, value_cache, slots, key_scales, value_scales;
  bool has_key_scales = false, has_value_scales = false;
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 0, &key));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 1, &value));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 2, &key_cache));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 3, &value_cache));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 4, &slots));
  ATTNEXPORT_RETURN_IF_ERROR(read_optional_input(context, 5, &key_scales, &has_key_scales));
  ATTNEXPORT_RETURN_IF_ERROR(read_optional_input(context, 6, &value_scales, &has_value_scales));
  size_t outputs = 0;
  ATTNEXPORT_RETURN_IF_ERROR(output_count(context, &outputs));

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
  if (element_size(key.type) == 0 || element_size(value.type) == 0)
    return invalid(std::string("ReshapeAndCache: key and value: expected float32, float16 or "
                               "bfloat16, got ") +
                   type_name(key.type) + " and " + type_name(value.type));
  const ONNXTensorElementDataType cache_type = key_cache.type;
  ATTNEXPORT_RETURN_IF_ERROR(check_cache_dtypes("ReshapeAndCache", key_cache, value_cache,
                                                has_key_scales ? &key_scales : nullptr,
                                                has_value_scales ? &value_scales : nullptr, 5));
  const bool int8 = cache_type == kInt8;
  if (int8 && outputs < 4)
    return invalid("ReshapeAndCache: int8 caches need the outputs key_scale_cache_out (2) "
                   "and value_scale_cache_out (3)");
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

  const int64_t heads = key_cache.dims[2], head_size = key_cache.dims[3];
  const int64_t row = heads * head_size;  // elements per slot
  const size_t cache_element = int8 ? 1 : element_size(cache_type);
  const Tensor* sources[2] = {&key, &value};
  const Tensor* caches[2] = {&key_cache, &value_cache};
  const Tensor* scale_inputs[2] = {&key_scales, &value_scales};
  for (size_t i = 0; i < 2; ++i) {
    Tensor out, scale_out;
    ATTNEXPORT_RETURN_IF_ERROR(make_output(context, i, caches[i]->dims, &out));
    auto* dst = static_cast<char*>(out.data);
    if (dst != caches[i]->data) std::memcpy(dst, caches[i]->data, cache_element * caches[i]->numel());
    const Tensor& source = *sources[i];
    if (int8) {
      ATTNEXPORT_RETURN_IF_ERROR(make_output(context, 2 + i, scale_inputs[i]->dims, &scale_out));
      auto* scale_dst = static_cast<float*>(scale_out.data);
      if (scale_out.data != scale_inputs[i]->data)
        std::memcpy(scale_dst, scale_inputs[i]->data, sizeof(float) * scale_inputs[i]->numel());
      auto* cache = reinterpret_cast<int8_t*>(dst);
      with_float_source(source.type, [&](auto tag) {
        using S = decltype(tag);
        const S* src = static_cast<const S*>(source.data);
        std::vector<float> scratch;
        for (int64_t t = 0; t < tokens; ++t) {
          if (slot[t] < 0) continue;
          for (int64_t h = 0; h < heads; ++h)
            scale_dst[slot[t] * heads + h] = quantize_row(
                src + t * row + h * head_size, cache + slot[t] * row + h * head_size, head_size,
                scratch);
        }
      });
    } else if (source.type == cache_type) {
      const size_t bytes = row * cache_element;
      const auto* src = static_cast<const char*>(source.data);
      for (int64_t t = 0; t < tokens; ++t)
        if (slot[t] >= 0) std::memcpy(dst + slot[t] * bytes, src + t * bytes, bytes);
    } else {
      with_float_source(source.type, [&](auto source_tag) {
        using S = decltype(source_tag);
        with_float_source(cache_type, [&](auto cache_tag) {
          using C = decltype(cache_tag);
          const S* src = static_cast<const S*>(source.data);
          C* cache = reinterpret_cast<C*>(dst);
          for (int64_t t = 0; t < tokens; ++t)
            if (slot[t] >= 0) convert_row(src + t * row, cache + slot[t] * row, row);
        });
      });
    }
  }
  return nullptr;
}

}  // namespace attnexport
