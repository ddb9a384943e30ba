// The PagedAttention kernel's prefill path: the queries of a sequence with more than one query
// token (a prompt, a prefill chunk) in tiles, flash-attention style. A work item is one KV head
// and a tile of query tokens: its rows are the tile's tokens times the G query heads of the KV
// head (row r = token j * G + head g). Over the visible keys, a chunk at a time, it
//   1. packs the chunk's keys transposed (D rows of keys, widened to float32, int8 rows
//      dequantized) and its values as float32 rows padded to W lanes,
//   2. takes the scores of every row against every key of the chunk as one panel product,
//   3. masks (causal bottom-right, sliding window), soft-caps, adds ALiBi and updates each
//      row's running softmax (maximum, sum, the rescale of its output),
//   4. adds the weights times the values to the outputs as a second panel product,
// so that each key and value element loaded into a register serves kTileRows rows (the decode
// path's dot products share a key among the G heads of one token). Semantics: docs/ops.md.

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_attention.h"
#include "paged_attention_batch.h"
#include "panel_product.h"
#include "vector_math.h"

namespace attnexport {

namespace {

// Keys per chunk: a chunk's packed keys and values (2 * 128 * D floats: 64 KiB at D = 64) and
// the rows' scores stay in L2 between the two products.
constexpr int64_t kPrefillChunkKeys = 128;

// The D x n panel of keys [k0, k0 + n) of KV head `head`, transposed: kt[d * ldk + i] is
// element d of key k0 + i, as float32 (int8: float(q) * scale, the contract's order). Columns
// [n, ldk) are zeros.
template <typename C>
void pack_keys(const C* cache, const float* scales, const int32_t* table, int64_t block_size,
               int64_t num_kv_heads, int64_t head, int64_t D, int64_t k0, int64_t n, float* kt,
               int64_t ldk) {
  const int64_t slot_stride = num_kv_heads * D;
  float widened[16 * 256];  // 16 keys' rows (D <= 256), then written out column by column
  for (int64_t i0 = 0; i0 < ldk; i0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - i0);
    for (int64_t i = 0; i < 16; ++i) {
      float* row = widened + i * D;
      if (i >= count) {
        std::fill(row, row + D, 0.0f);
        continue;
      }
      const int64_t k = k0 + i0 + i;
      const int64_t slot = table[k / block_size] * block_size + k % block_size;
      const C* src = cache + slot * slot_stride + head * D;
      const float scale = scales != nullptr ? scales[slot * num_kv_heads + head] : 1.0f;
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) {
        const f32x16 x = load16_float(src + d);
        store16(row + d, scales != nullptr ? x * splat16(scale) : x);
      }
      for (; d < D; ++d) row[d] = scales != nullptr ? to_float(src[d]) * scale : to_float(src[d]);
    }
    for (int64_t d = 0; d < D; ++d) {
      f32x16 column;
      for (int i = 0; i < 16; ++i) column[i] = widened[i * D + d];
      store16(kt + d * ldk + i0, column);
    }
  }
}

// Values [k0, k0 + n) of KV head `head` as n rows of W floats (zero padded past D).
template <typename C>
void pack_values(const C* cache, const float* scales, const int32_t* table, int64_t block_size,
                 int64_t num_kv_heads, int64_t head, int64_t D, int64_t W, int64_t k0, int64_t n,
                 float* vp) {
  const int64_t slot_stride = num_kv_heads * D;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = k0 + i;
    const int64_t slot = table[k / block_size] * block_size + k % block_size;
    const C* src = cache + slot * slot_stride + head * D;
    float* row = vp + i * W;
    const float scale = scales != nullptr ? scales[slot * num_kv_heads + head] : 1.0f;
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
      const f32x16 x = load16_float(src + d);
      store16(row + d, scales != nullptr ? x * splat16(scale) : x);
    }
    for (; d < D; ++d) row[d] = scales != nullptr ? to_float(src[d]) * scale : to_float(src[d]);
    for (; d < W; ++d) row[d] = 0.0f;
  }
}

// The maximum of x[a, e) (native-width vectors, as in panel_product.h).
float row_maximum(const float* x, int64_t a, int64_t e) {
  float max = -std::numeric_limits<float>::infinity();
  int64_t i = a;
  if (e - a >= kLanes) {
    lane_vector maxes = load_lanes(x + a);
    for (i = a + kLanes; i + kLanes <= e; i += kLanes) {
      const lane_vector y = load_lanes(x + i);
      maxes = y > maxes ? y : maxes;
    }
    for (int l = 0; l < kLanes; ++l) max = std::max(max, maxes[l]);
  }
  for (; i < e; ++i) max = std::max(max, x[i]);
  return max;
}

// x[i] = exp(x[i] - max) for i in [a, e); returns their sum.
float exponentiate(float* x, int64_t a, int64_t e, float max) {
  lane_vector sums{};
  const lane_vector maxes = splat_lanes(max);
  int64_t i = a;
  for (; i + kLanes <= e; i += kLanes) {
    const lane_vector w = exp_nonpositive<lane_vector, lane_int_vector>(load_lanes(x + i) - maxes);
    store_lanes(x + i, w);
    sums += w;
  }
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += sums[l];
  for (; i < e; ++i) {
    x[i] = exp_nonpositive<float, int32_t>(x[i] - max);
    sum += x[i];
  }
  return sum;
}

}  // namespace

// Whole register tiles of rows where the group allows: 8 * kTileRows rows (48 on AVX2, e.g. 16
// tokens of a group of 3), the packing of a chunk's keys and values shared by all of them.
int64_t PagedAttention::prefill_tile_tokens() const {
  return std::max<int64_t>(1, 8 * kTileRows / (num_heads / num_kv_heads));
}

template <typename C>
void PagedAttention::attend_tiled(const Batch& batch, const WorkItem& item) const {
  const int64_t group = num_heads / num_kv_heads, D = head_size, W = padded_width();
  const int64_t h = item.kv_begin;
  const int64_t length = batch.seq_lens[item.seq];
  const int64_t seq_start = batch.query_start[item.seq];
  const int64_t num_queries = batch.query_start[item.seq + 1] - seq_start;
  const int64_t tokens = item.num_queries, rows = tokens * group;
  const int32_t* table = batch.block_tables + item.seq * batch.max_blocks;

  // Visible keys of token j of the tile: [lo[j], hi[j]), its position p = length - q + j.
  thread_local std::vector<int64_t> bounds;
  bounds.resize(3 * tokens);
  int64_t* const lo = bounds.data();
  int64_t* const hi = lo + tokens;
  int64_t* const position = hi + tokens;
  int64_t first_key = length, end_key = 0;
  for (int64_t j = 0; j < tokens; ++j) {
    const int64_t p = length - num_queries + item.first_query + j;
    position[j] = p;
    lo[j] = sliding_window >= 0 ? std::max<int64_t>(0, p - sliding_window + 1) : 0;
    hi[j] = causal ? std::min(length, p + 1) : length;
    if (lo[j] < hi[j]) {
      first_key = std::min(first_key, lo[j]);
      end_key = std::max(end_key, hi[j]);
    }
  }

  const int64_t ldk = (kPrefillChunkKeys + 15) / 16 * 16;  // scores and packed keys per row
  thread_local std::vector<float> scratch;
  scratch.resize(rows * D + rows * W + 2 * rows + rows * ldk + D * ldk + kPrefillChunkKeys * W);
  float* const queries = scratch.data();     // [rows, D], scaled
  float* const outputs = queries + rows * D;  // [rows, W], unnormalised
  float* const maxes = outputs + rows * W;
  float* const sums = maxes + rows;
  float* const scores = sums + rows;       // [rows, ldk]: scores, then softmax weights
  float* const keys = scores + rows * ldk;  // [D, ldk]
  float* const values = keys + D * ldk;     // [kPrefillChunkKeys, W]

  for (int64_t j = 0; j < tokens; ++j) {
    const int64_t src = ((seq_start + item.first_query + j) * num_heads + h * group) * D;
    for (int64_t i = 0; i < group * D; ++i)
      queries[j * group * D + i] = scale * load_element(batch.query, batch.query_type, src + i);
  }
  std::fill(outputs, outputs + rows * W, 0.0f);
  std::fill(maxes, maxes + rows, -std::numeric_limits<float>::infinity());
  std::fill(sums, sums + rows, 0.0f);

  const C* key_cache = static_cast<const C*>(batch.key_cache);
  const C* value_cache = static_cast<const C*>(batch.value_cache);
  for (int64_t k0 = first_key; k0 < end_key; k0 += kPrefillChunkKeys) {
    const int64_t n = std::min(kPrefillChunkKeys, end_key - k0);
    const int64_t columns = (n + 15) / 16 * 16;
    pack_keys(key_cache, batch.key_scales, table, block_size, num_kv_heads, h, D, k0, n, keys,
              ldk);
    pack_values(value_cache, batch.value_scales, table, block_size, num_kv_heads, h, D, W, k0, n,
                values);
    panel_product<false>(rows, columns, D, queries, D, keys, ldk, scores, ldk);

    for (int64_t j = 0; j < tokens; ++j) {
      // Visible keys of the chunk for token j: columns [a, e).
      const int64_t a = std::clamp(lo[j] - k0, int64_t{0}, n);
      const int64_t e = std::clamp(hi[j] - k0, a, n);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = j * group + g;
        float* s = scores + r * ldk;
        std::fill(s, s + a, 0.0f);  // masked keys weigh exactly 0
        std::fill(s + e, s + n, 0.0f);
        if (a == e) continue;
        if (soft_cap > 0.0f)
          for (int64_t i = a; i < e; ++i) s[i] = soft_cap * std::tanh(s[i] / soft_cap);
        if (!batch.slopes.empty()) {
          const float slope = batch.slopes[h * group + g];
          for (int64_t i = a; i < e; ++i)
            s[i] += slope * static_cast<float>(k0 + i - position[j]);
        }
        const float previous = maxes[r];
        const float max = std::max(previous, row_maximum(s, a, e));
        // exp(previous - max) in [0, 1]; a row's first visible chunk rescales zeros.
        const float rescale = previous == max ? 1.0f : exp_nonpositive<float, int32_t>(previous - max);
        maxes[r] = max;
        sums[r] = sums[r] * rescale + exponentiate(s, a, e, max);
        if (rescale != 1.0f) {
          const lane_vector factor = splat_lanes(rescale);
          float* o = outputs + r * W;
          for (int64_t d = 0; d < W; d += kLanes) store_lanes(o + d, load_lanes(o + d) * factor);
        }
      }
    }
    panel_product<true>(rows, W, n, scores, ldk, values, W, outputs, W);
  }

  // A row that sees no key (sum 0) is zeros.
  for (int64_t j = 0; j < tokens; ++j) {
    const int64_t dst = ((seq_start + item.first_query + j) * num_heads + h * group) * D;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = j * group + g;
      const float inverse = sums[r] > 0.0f ? 1.0f / sums[r] : 0.0f;
      for (int64_t d = 0; d < D; ++d)
        store_element(batch.out, batch.query_type, dst + g * D + d, outputs[r * W + d] * inverse);
    }
  }
}

template void PagedAttention::attend_tiled<float>(const Batch&, const WorkItem&) const;
template void PagedAttention::attend_tiled<Half>(const Batch&, const WorkItem&) const;
template void PagedAttention::attend_tiled<BFloat16>(const Batch&, const WorkItem&) const;
template void PagedAttention::attend_tiled<int8_t>(const Batch&, const WorkItem&) const;

}  // namespace attnexport
