// The PagedAttention kernel's prefill path: the queries of a sequence with more than one query
// token (a prompt, a prefill chunk) in tiles, flash-attention style.
//
// First every (sequence, KV head) has the keys its queries can see packed once, a chunk of
// kPrefillChunkKeys at a time (in parallel): keys transposed into [D, chunk] panels and values
// as rows of W floats, widened to float32 (int8 rows dequantized). Then a work item is a tile:
// one KV head and a tile of query tokens, whose rows are the tile's tokens times the G query
// heads of the KV head (row r = token j * G + head g). Over its visible keys, a chunk at a time,
// it takes the scores of every row against every key of the chunk as one panel product, masks
// them (causal bottom-right, sliding window), soft-caps, adds ALiBi, updates each row's running
// softmax (maximum, sum, the rescale of its output), and adds the weights times the values to
// the outputs as a second panel product. Each key and value element loaded into a register
// serves kTileRows rows (the decode path's dot products share a key among the G heads of one
// token only). With prefill_bf16 on an AVX512_BF16 CPU (PrefillPlan::pairs) both products take
// bfloat16 pairs: queries, keys, values and softmax weights rounded to bfloat16 (to nearest
// even), their products summed in float32 by vdpbf16ps, 32 products an instruction where
// float32 multiply-adds make 16; the softmax stays float32. Semantics: docs/ops.md.

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
// the tile's scores stay in L2 between the two products.
constexpr int64_t kPrefillChunkKeys = 128;
// Rows per tile: 8 register tiles' worth (48 on AVX2, e.g. 16 tokens of a group of 3).
constexpr int64_t kPrefillTileRows = 8 * kTileRows;

// A row of D elements of C as float32 (int8: float(q) * scale, the contract's order).
template <typename C>
inline void widen(const C* src, int64_t D, const float* scale, float* dst) {
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const f32x16 x = load16_float(src + d);
    store16(dst + d, scale != nullptr ? x * splat16(*scale) : x);
  }
  for (; d < D; ++d) dst[d] = scale != nullptr ? to_float(src[d]) * *scale : to_float(src[d]);
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
    max = horizontal_max(maxes);
  }
  for (; i < e; ++i) max = std::max(max, x[i]);
  return max;
}

// x[i] = exp(x[i] - max) for i in [a, e); returns their sum. (AVX-512: the last partial vector
// too, its lanes past e masked: a causal tile's rows end mid-vector in their last chunk, and
// one value at a time the tail cost about a quarter of the exponentials' time.)
float exponentiate(float* x, int64_t a, int64_t e, float max) {
  lane_vector sums{};
  const lane_vector maxes = splat_lanes(max);
  int64_t i = a;
  for (; i + kLanes <= e; i += kLanes) {
    const lane_vector w = exp_nonpositive<lane_vector, lane_int_vector>(load_lanes(x + i) - maxes);
    store_lanes(x + i, w);
    sums += w;
  }
#if defined(__AVX512F__)
  if (i < e) {
    const __mmask16 lanes = static_cast<__mmask16>((1u << (e - i)) - 1);
    const lane_vector y = reinterpret_cast<lane_vector>(_mm512_maskz_loadu_ps(lanes, x + i));
    const __m512 w = _mm512_maskz_mov_ps(
        lanes, reinterpret_cast<__m512>(exp_nonpositive<lane_vector, lane_int_vector>(y - maxes)));
    _mm512_mask_storeu_ps(x + i, lanes, w);
    sums += reinterpret_cast<lane_vector>(w);
    i = e;
  }
#endif
  float sum = horizontal_sum(sums);
  for (; i < e; ++i) {
    x[i] = exp_nonpositive<float, int32_t>(x[i] - max);
    sum += x[i];
  }
  return sum;
}

#if defined(__AVX512F__)
// dst[i] = x[i] rounded to bfloat16 (to nearest even; NaN stays NaN) for i < n, a multiple of
// 16: vcvtneps2bf16 (written in assembly: its intrinsic needs -mavx512bf16 for the library).
void to_bf16(const float* x, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; i += 16) {
    __m256i half;
    asm("vcvtneps2bf16 %1, %0" : "=v"(half) : "v"(_mm512_loadu_ps(x + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), half);
  }
}
#endif

}  // namespace

bool bf16_pairs_available(int64_t head_size) {
#if defined(__AVX512F__)
  static const bool cpu = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
  }();
  return cpu && head_size % 16 == 0;
#else
  (void)head_size;
  return false;
#endif
}

void PagedAttention::plan_prefill(const Batch& batch, int64_t seq, PrefillPlan* plan) const {
  const int64_t group = num_heads / num_kv_heads, W = padded_width();
  const int64_t length = batch.seq_lens[seq];
  const int64_t queries = batch.query_start[seq + 1] - batch.query_start[seq];
  // The first query (position length - queries) sees the earliest key; every key up to the
  // end of the sequence is seen by some query.
  const int64_t first =
      sliding_window >= 0 ? std::max<int64_t>(0, length - queries - sliding_window + 1) : 0;
  const int64_t count = std::max<int64_t>(0, length - first);
  const int64_t chunks = (count + kPrefillChunkKeys - 1) / kPrefillChunkKeys;
  const int64_t tile_tokens = std::max<int64_t>(1, kPrefillTileRows / group);
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    const int64_t index = static_cast<int64_t>(plan->packed.size());
    const int64_t keys = plan->floats, values = keys + chunks * head_size * kPrefillChunkKeys;
    plan->floats = values + chunks * kPrefillChunkKeys * W;
    plan->packed.push_back({seq, h, first, count, keys, values});
    for (int64_t c = 0; c < chunks; ++c) plan->pack_jobs.emplace_back(index, c);
    for (int64_t q = 0; q < queries; q += tile_tokens)
      plan->tiles.push_back({seq, h, q, std::min(tile_tokens, queries - q), index});
  }
}

// onnxruntime's pool hands the items out in order: the tiles that see the most keys (the last
// of a causal prompt) go first, so that the last item to start is a short one.
void PagedAttention::order_tiles(const Batch& batch, PrefillPlan* plan) const {
  auto work = [&](const PrefillTile& t) {
    const int64_t length = batch.seq_lens[t.seq];
    const int64_t queries = batch.query_start[t.seq + 1] - batch.query_start[t.seq];
    return t.num_queries * (causal ? length - queries + t.first_query + t.num_queries : length);
  };
  std::stable_sort(plan->tiles.begin(), plan->tiles.end(),
                   [&](const PrefillTile& a, const PrefillTile& b) { return work(a) > work(b); });
}

template <typename C>
void PagedAttention::pack_chunk(const Batch& batch, const PrefillPlan& plan, int64_t job) const {
  const auto [index, chunk] = plan.pack_jobs[job];
  const PackedKeys& packed = plan.packed[index];
  const int64_t D = head_size, W = padded_width(), h = packed.head;
  const int64_t k0 = packed.first + chunk * kPrefillChunkKeys;
  const int64_t n = std::min(kPrefillChunkKeys, packed.first + packed.count - k0);
  const int32_t* table = batch.block_tables + packed.seq * batch.max_blocks;
  const C* key_cache = static_cast<const C*>(batch.key_cache);
  const C* value_cache = static_cast<const C*>(batch.value_cache);
  float* const keys = plan.storage + packed.keys + chunk * D * kPrefillChunkKeys;
  float* const values = plan.storage + packed.values + chunk * kPrefillChunkKeys * W;
  const int64_t slot_stride = num_kv_heads * D;
  float rows[16 * kMaxHeadSize];  // 16 keys, widened, then written out column by column
  for (int64_t i0 = 0; i0 < kPrefillChunkKeys; i0 += 16) {
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t k = k0 + i0 + i;
      if (i0 + i >= n) {
        std::fill(rows + i * D, rows + (i + 1) * D, 0.0f);  // (value rows past n are never read)
        continue;
      }
      const int64_t slot = table[k / block_size] * block_size + k % block_size;
      const float* key_scale =
          batch.key_scales != nullptr ? batch.key_scales + slot * num_kv_heads + h : nullptr;
      const float* value_scale =
          batch.value_scales != nullptr ? batch.value_scales + slot * num_kv_heads + h : nullptr;
      widen(key_cache + slot * slot_stride + h * D, D, key_scale, rows + i * D);
      float* value_row = values + (i0 + i) * W;
      widen(value_cache + slot * slot_stride + h * D, D, value_scale, value_row);
      std::fill(value_row + D, value_row + W, 0.0f);
    }
#if defined(__AVX512F__)
    if (plan.pairs) {
      // Keys: pair p of dimensions (2p, 2p + 1) of key i at word p * chunk + i. Values: pair
      // of keys (2j, 2j + 1) at dimension d at word j * W + d.
      uint16_t halves[16 * kMaxHeadSize];
      to_bf16(rows, 16 * D, halves);
      auto* key_words = reinterpret_cast<uint32_t*>(keys);
      const auto* key_pairs = reinterpret_cast<const uint32_t*>(halves);
      for (int64_t w = 0; w < D / 2; ++w)
        for (int64_t i = 0; i < 16; ++i)
          key_words[w * kPrefillChunkKeys + i0 + i] = key_pairs[i * D / 2 + w];
      float* value_rows = values + i0 * W;  // (the 16 rows' floats, this chunk's own)
      for (int64_t i = 0; i < 16; ++i)  // (weighing 0: zeros, not the memory's last values)
        if (i0 + i >= n) std::fill(value_rows + i * W, value_rows + (i + 1) * W, 0.0f);
      to_bf16(value_rows, 16 * W, halves);
      auto* value_words = reinterpret_cast<uint32_t*>(values) + i0 / 2 * W;
      for (int64_t j = 0; j < 8; ++j)
        for (int64_t d = 0; d < W; ++d)
          value_words[j * W + d] =
              halves[2 * j * W + d] | static_cast<uint32_t>(halves[(2 * j + 1) * W + d]) << 16;
      continue;
    }
#endif
    for (int64_t d = 0; d < D; ++d)
      for (int64_t i = 0; i < 16; ++i) keys[d * kPrefillChunkKeys + i0 + i] = rows[i * D + d];
  }
}

void PagedAttention::attend_tile(const Batch& batch, const PrefillPlan& plan,
                                 const PrefillTile& tile) const {
  const int64_t group = num_heads / num_kv_heads, D = head_size, W = padded_width();
  const PackedKeys& packed = plan.packed[tile.packed];
  const int64_t h = tile.head;
  const int64_t length = batch.seq_lens[tile.seq];
  const int64_t seq_start = batch.query_start[tile.seq];
  const int64_t num_queries = batch.query_start[tile.seq + 1] - seq_start;
  const int64_t tokens = tile.num_queries, rows = tokens * group;

  // Visible keys of token j of the tile: [lo[j], hi[j]), its position p = length - q + j.
  thread_local std::vector<int64_t> bounds;
  bounds.resize(3 * tokens);
  int64_t* const lo = bounds.data();
  int64_t* const hi = lo + tokens;
  int64_t* const position = hi + tokens;
  const auto [first_key, end_key] =
      visible_keys(length, num_queries, tile.first_query, tokens, lo, hi, position);

  constexpr int64_t ldk = kPrefillChunkKeys;  // scores per row
  thread_local std::vector<float> scratch;
  scratch.resize(rows * D + rows * W + 2 * rows + rows * ldk + (plan.pairs ? rows * ldk / 2 : 0));
  float* const queries = scratch.data();     // [rows, D], scaled
  float* const outputs = queries + rows * D;  // [rows, W], unnormalised
  float* const maxes = outputs + rows * W;
  float* const sums = maxes + rows;
  float* const scores = sums + rows;  // [rows, ldk]: scores, then softmax weights

  for (int64_t j = 0; j < tokens; ++j) {
    const int64_t src = ((seq_start + tile.first_query + j) * num_heads + h * group) * D;
    for (int64_t i = 0; i < group * D; ++i)
      queries[j * group * D + i] = scale * load_element(batch.query, batch.query_type, src + i);
  }
#if defined(__AVX512F__)
  // With pairs: the queries as [rows, D / 2] pairs (over the queries' floats, a row at a time:
  // row r's pairs end before row r + 1's floats begin), the weights as [rows, ldk / 2] pairs.
  auto* const query_pairs = reinterpret_cast<uint32_t*>(queries);
  auto* const weight_pairs = reinterpret_cast<uint32_t*>(scores + rows * ldk);
  if (plan.pairs)
    for (int64_t r = 0; r < rows; ++r)
      to_bf16(queries + r * D, D, reinterpret_cast<uint16_t*>(query_pairs + r * D / 2));
#endif
  std::fill(outputs, outputs + rows * W, 0.0f);
  std::fill(maxes, maxes + rows, -std::numeric_limits<float>::infinity());
  std::fill(sums, sums + rows, 0.0f);

  const int64_t first_chunk =
      first_key < end_key ? (first_key - packed.first) / kPrefillChunkKeys : 0;
  for (int64_t chunk = first_chunk;; ++chunk) {
    const int64_t k0 = packed.first + chunk * kPrefillChunkKeys;
    if (k0 >= end_key) break;
    const int64_t n = std::min(kPrefillChunkKeys, end_key - k0);  // keys of the chunk it reads
    const float* keys = plan.storage + packed.keys + chunk * D * kPrefillChunkKeys;
    const float* values = plan.storage + packed.values + chunk * kPrefillChunkKeys * W;
    const int64_t columns = (n + 15) / 16 * 16;
#if defined(__AVX512F__)
    if (plan.pairs)
      panel_product<false>(rows, columns, D / 2, query_pairs, D / 2,
                           reinterpret_cast<const uint32_t*>(keys), kPrefillChunkKeys, scores, ldk);
    else
#endif
      panel_product<false>(rows, columns, D, queries, D, keys, kPrefillChunkKeys, scores, ldk);
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
#if defined(__AVX512F__)
    if (plan.pairs) {
      // An odd n's last pair has key n for second: a key of the chunk past this tile's (its
      // score left unmasked) or a zero row past the packed keys. It weighs exactly 0.
      for (int64_t r = 0; r < rows; ++r) {
        if (n % 2 != 0) scores[r * ldk + n] = 0.0f;
        to_bf16(scores + r * ldk, columns, reinterpret_cast<uint16_t*>(weight_pairs + r * ldk / 2));
      }
      panel_product<true>(rows, W, (n + 1) / 2, weight_pairs, ldk / 2,
                          reinterpret_cast<const uint32_t*>(values), W, outputs, W);
      continue;
    }
#endif
    panel_product<true>(rows, W, n, scores, ldk, values, W, outputs, W);
  }

  // A row that sees no key (sum 0) is zeros.
  for (int64_t j = 0; j < tokens; ++j) {
    const int64_t dst = ((seq_start + tile.first_query + j) * num_heads + h * group) * D;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t r = j * group + g;
      const float inverse = softmax_inverse(batch, h * group + g, sums[r], maxes[r]);
      for (int64_t d = 0; d < D; ++d)
        store_element(batch.out, batch.query_type, dst + g * D + d, outputs[r * W + d] * inverse);
    }
  }
}

template void PagedAttention::pack_chunk<float>(const Batch&, const PrefillPlan&, int64_t) const;
template void PagedAttention::pack_chunk<Half>(const Batch&, const PrefillPlan&, int64_t) const;
template void PagedAttention::pack_chunk<BFloat16>(const Batch&, const PrefillPlan&, int64_t) const;
template void PagedAttention::pack_chunk<int8_t>(const Batch&, const PrefillPlan&, int64_t) const;

}  // namespace attnexport
