// attnexport.PagedAttention for onnxruntime's CPU execution provider: float32, float16 and
// bfloat16 queries over float32, float16, bfloat16 or int8 caches (int8 with a float32 scale
// per slot and KV head: key_scale_cache, value_scale_cache), math in float32.
//
// The standard-op body gathers every visible key and value row into a padded batch before two
// matmuls; that copy is most of its time. This kernel reads the rows where they lie in the
// paged cache: one work item per (sequence, KV head, tile of queries or split of a decode
// context), the G query heads of the KV head's group sharing every key and value row they
// load. Semantics: docs/ops.md.

#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernel_api.h"
#include "paged_attention_batch.h"
#include "vector_math.h"

namespace attnexport {

constexpr int64_t kQueryTile = 16;
// Below this many multiply-adds (a few microseconds on one core) waking the thread pool costs
// more than it saves. A decode step of one sequence over 190 keys (12/4/64 heads, ~290K
// multiply-adds) is worth splitting: in a model its keys and values come from memory, not the
// caches (the weights stream through them every step); docs/benchmarks.md has the measurement.
constexpr int64_t kParallelWork = 1 << 16;
// A decode context is split into parts of at least kMinSplitBlocks blocks each (at most
// kSplitTarget), so that a small batch still keeps every thread busy. The split depends on the
// context's length alone, never on the rest of the batch: a split changes the order of the
// softmax sums (a partial softmax per part, combined afterwards), and a sequence's numbers
// must not depend on what it is batched with (a greedy token of a quantized model, whose
// activations are rounded to int8 steps, can follow a last-bit difference).
constexpr int64_t kSplitTarget = 8;
constexpr int64_t kMinSplitBlocks = 16;
// Keys per step of the online softmax (whole blocks, at least one): the rescale of the
// running output, the maximum and the exponentials are paid per chunk, not per 16-key block
// (per block they cost the 12/4/64 float32 decode 0.6-0.75x of the two-pass kernel), while a
// chunk's key and value rows of one head still sit in L2 between its scores and its values.
constexpr int64_t kChunkKeys = 128;
constexpr int64_t kChunkBytes = 256 << 10;
// A decode batch whose cache rows take more than this many bytes comes from memory: its items
// then take every KV head of a sequence (the rows of a slot are adjacent, so a chunk is read
// as whole blocks, where one head's rows lie one per slot, each on its own page for large
// heads); a smaller one, read from the caches, is parallel over KV heads.
constexpr int64_t kStreamBytes = 8 << 20;
// Packed prefill keys up to this many floats (64 MiB: a 4096-token prompt of 8 KV heads of 128)
// stay allocated for the calling thread's next call.
constexpr size_t kKeptPackedFloats = size_t{16} << 20;

enum Input : size_t {
  kQuery,
  kKeyCache,
  kValueCache,
  kBlockTables,
  kSeqLens,
  kQueryStart,
  kSlopes,
  kKeyScales,
  kValueScales,
  kSinks,
};

namespace {

OrtStatus* expect_shape(const Tensor& t, const char* name, const std::vector<int64_t>& dims,
                        const char* layout) {
  if (t.dims == dims) return nullptr;
  return invalid(std::string("PagedAttention: ") + name + ": expected " + layout + " = " +
                 format_dims(dims) + ", got " + t.shape());
}

bool is_float_type(ONNXTensorElementDataType type) {
  return type == kFloat32 || type == kFloat16 || type == kBFloat16;
}


}  // namespace

OrtStatus* PagedAttention::init(const OrtKernelInfo* info) {
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "num_heads", &num_heads));
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "num_kv_heads", &num_kv_heads));
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "head_size", &head_size));
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "block_size", &block_size));
  ATTNEXPORT_RETURN_IF_ERROR(float_attribute(info, "scale", &scale));
  // Optional attributes keep the schema's defaults when absent.
  if (OrtStatus* s = int_attribute(info, "causal", &causal)) api().ReleaseStatus(s);
  if (OrtStatus* s = int_attribute(info, "sliding_window", &sliding_window)) api().ReleaseStatus(s);
  if (OrtStatus* s = float_attribute(info, "logits_soft_cap", &soft_cap)) api().ReleaseStatus(s);
  if (OrtStatus* s = int_attribute(info, "prefill_bf16", &prefill_bf16)) api().ReleaseStatus(s);
  if (num_heads < 1 || num_kv_heads < 1 || num_heads % num_kv_heads != 0)
    return invalid("PagedAttention: num_heads (" + std::to_string(num_heads) +
                   ") must be a positive multiple of num_kv_heads (" +
                   std::to_string(num_kv_heads) + ")");
  if (head_size < 1 || block_size < 1)
    return invalid("PagedAttention: head_size and block_size must be positive");
  if (head_size > kMaxHeadSize)
    return invalid("PagedAttention: head_size " + std::to_string(head_size) +
                   " is past the native kernel's " + std::to_string(kMaxHeadSize) +
                   "; run the model with OrtExecutor(..., kernels='bodies')");
  return nullptr;
}

OrtStatus* PagedAttention::compute(OrtKernelContext* context) const {
  Tensor query, key_cache, value_cache, tables, seq_lens, query_start, slopes, key_scales,
      value_scales, sinks;
  bool has_key_scales = false, has_value_scales = false, has_sinks = false;
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, kQuery, &query));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, kKeyCache, &key_cache));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, kValueCache, &value_cache));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, kBlockTables, &tables));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, kSeqLens, &seq_lens));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, kQueryStart, &query_start));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, kSlopes, &slopes));
  ATTNEXPORT_RETURN_IF_ERROR(read_optional_input(context, kKeyScales, &key_scales, &has_key_scales));
  ATTNEXPORT_RETURN_IF_ERROR(
      read_optional_input(context, kValueScales, &value_scales, &has_value_scales));
  ATTNEXPORT_RETURN_IF_ERROR(read_optional_input(context, kSinks, &sinks, &has_sinks));

  // Every check runs before any memory is read through an index.
  const int64_t tokens = query.dims.empty() ? 0 : query.dims[0];
  ATTNEXPORT_RETURN_IF_ERROR(
      expect_shape(query, "query", {tokens, num_heads, head_size}, "[num_tokens, num_heads, head_size]"));
  const int64_t num_blocks = key_cache.dims.empty() ? 0 : key_cache.dims[0];
  const std::vector<int64_t> cache_dims{num_blocks, block_size, num_kv_heads, head_size};
  const char* cache_layout = "[num_blocks, block_size, num_kv_heads, head_size]";
  ATTNEXPORT_RETURN_IF_ERROR(expect_shape(key_cache, "key_cache", cache_dims, cache_layout));
  ATTNEXPORT_RETURN_IF_ERROR(expect_shape(value_cache, "value_cache", cache_dims, cache_layout));
  if (tables.dims.size() != 2)
    return invalid("PagedAttention: block_tables: expected [num_seqs, max_blocks], got " + tables.shape());
  const int64_t num_seqs = tables.dims[0], max_blocks = tables.dims[1];
  ATTNEXPORT_RETURN_IF_ERROR(expect_shape(seq_lens, "seq_lens", {num_seqs}, "[num_seqs]"));
  ATTNEXPORT_RETURN_IF_ERROR(
      expect_shape(query_start, "query_start_loc", {num_seqs + 1}, "[num_seqs + 1]"));
  ATTNEXPORT_RETURN_IF_ERROR(expect_shape(slopes, "alibi_slopes", {num_heads}, "[num_heads]"));

  const ONNXTensorElementDataType type = query.type;
  if (!is_float_type(type))
    return invalid(std::string("PagedAttention: query: expected float32, float16 or bfloat16, got ") +
                   type_name(type));
  const ONNXTensorElementDataType cache_type = key_cache.type;
  ATTNEXPORT_RETURN_IF_ERROR(check_cache_dtypes("PagedAttention", key_cache, value_cache,
                                                has_key_scales ? &key_scales : nullptr,
                                                has_value_scales ? &value_scales : nullptr,
                                                kKeyScales));
  std::vector<float> slope_values(num_heads);
  if (!is_float_type(slopes.type))
    return invalid("PagedAttention: alibi_slopes: expected float32, float16 or bfloat16");
  for (int64_t h = 0; h < num_heads; ++h) slope_values[h] = load_element(slopes.data, slopes.type, h);
  std::vector<float> sink_values;
  if (has_sinks) {
    ATTNEXPORT_RETURN_IF_ERROR(expect_shape(sinks, "sinks", {num_heads}, "[num_heads]"));
    if (!is_float_type(sinks.type))
      return invalid("PagedAttention: sinks: expected float32, float16 or bfloat16");
    sink_values.resize(num_heads);
    for (int64_t h = 0; h < num_heads; ++h) sink_values[h] = load_element(sinks.data, sinks.type, h);
  }

  Batch batch{query.data,
              type,
              key_cache.data,
              value_cache.data,
              cache_type == kInt8 ? static_cast<const float*>(key_scales.data) : nullptr,
              cache_type == kInt8 ? static_cast<const float*>(value_scales.data) : nullptr,
              static_cast<const int32_t*>(tables.data),
              static_cast<const int32_t*>(seq_lens.data),
              static_cast<const int32_t*>(query_start.data),
              {},
              max_blocks,
              nullptr,
              0,
              nullptr,
              std::move(sink_values)};
  if (std::any_of(slope_values.begin(), slope_values.end(), [](float s) { return s != 0.0f; }))
    batch.slopes = std::move(slope_values);

  PrefillPlan prefill;
  prefill.pairs = prefill_bf16 != 0 && bf16_pairs_available(head_size);
  std::vector<WorkItem> items;  // decode
  std::vector<Split> splits_;
  std::vector<int64_t> decode_seqs;
  int64_t partial_slots = 0;
  int64_t previous_end = batch.query_start[0];
  if (previous_end < 0 || previous_end > tokens)
    return invalid("PagedAttention: query_start_loc[0] = " + std::to_string(previous_end) +
                   " is outside [0, num_tokens = " + std::to_string(tokens) + "]");
  if (previous_end != 0)
    return invalid("PagedAttention: query_start_loc[0] = " + std::to_string(previous_end) +
                   " must be 0");
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t begin = batch.query_start[s], end = batch.query_start[s + 1];
    const int64_t length = batch.seq_lens[s];
    if (end < begin || end > tokens)
      return invalid("PagedAttention: query_start_loc must be non-decreasing and <= num_tokens (" +
                     std::to_string(tokens) + "); entry " + std::to_string(s + 1) + " is " +
                     std::to_string(end));
    if (length < 0 || length > max_blocks * block_size)
      return invalid("PagedAttention: seq_lens[" + std::to_string(s) + "] = " +
                     std::to_string(length) + " is outside [0, max_blocks * block_size = " +
                     std::to_string(max_blocks * block_size) + "]");
    if (causal && length < end - begin)
      return invalid("PagedAttention: seq_lens[" + std::to_string(s) + "] = " +
                     std::to_string(length) + " is smaller than its " +
                     std::to_string(end - begin) +
                     " query tokens (with causal=1 seq_lens counts the context and the queries)");
    const int32_t* row = batch.block_tables + s * max_blocks;
    for (int64_t b = 0; b < (length + block_size - 1) / block_size; ++b)
      if (row[b] < 0 || row[b] >= num_blocks)
        return invalid("PagedAttention: block_tables[" + std::to_string(s) + ", " +
                       std::to_string(b) + "] = " + std::to_string(row[b]) +
                       " is not a block id in [0, " + std::to_string(num_blocks) + ")");
    batch.multiply_adds += 2 * (end - begin) * length * num_heads * head_size;
    if (end - begin == 1) {
      decode_seqs.push_back(s);
    } else {
      plan_prefill(batch, s, &prefill);
    }
    previous_end = end;
  }
  order_tiles(batch, &prefill);

  // Decode queries: one item per KV head (or per sequence, see kStreamBytes), and a long
  // context of a small batch split across the thread pool (a partial softmax per split,
  // combined afterwards).
  int64_t decode_keys = 0;
  for (int64_t s : decode_seqs) decode_keys += batch.seq_lens[s];
  const int64_t row_bytes = num_kv_heads * head_size *
                            static_cast<int64_t>(cache_type == kInt8 ? 1 : element_size(cache_type));
  const bool streams = 2 * decode_keys * row_bytes > kStreamBytes;
  const int64_t head_items = streams ? 1 : num_kv_heads;  // items per sequence (and split)
  const int64_t per_item = num_kv_heads / head_items;
  for (int64_t s : decode_seqs) {
    const int64_t blocks = (batch.seq_lens[s] + block_size - 1) / block_size;
    const int64_t splits = std::clamp<int64_t>(blocks / kMinSplitBlocks, 1, kSplitTarget);
    if (splits > 1) splits_.push_back({s, partial_slots, splits});
    for (int64_t i = 0; i < splits; ++i) {
      for (int64_t h = 0; h < num_kv_heads; h += per_item)
        items.push_back({s, h, h + per_item, 0, 1, blocks * i / splits, blocks * (i + 1) / splits,
                         splits > 1 ? partial_slots : -1});
      if (splits > 1) ++partial_slots;
    }
  }

  if (previous_end != tokens)
    return invalid("PagedAttention: query_start_loc[" + std::to_string(num_seqs) + "] = " +
                   std::to_string(previous_end) + " must be num_tokens = " +
                   std::to_string(tokens));

  // Every output row is a query of one sequence: the offsets cover [0, num_tokens).
  Tensor output;
  ATTNEXPORT_RETURN_IF_ERROR(make_output(context, 0, {tokens, num_heads, head_size}, &output));
  batch.out = output.data;

  const int64_t W = padded_width();
  std::vector<float> partials(partial_slots * num_heads * (W + 2));
  batch.partials = partials.data();
  // The packed keys of prefills: memory kept by the calling thread for its next call (no page
  // faults on a fresh allocation per layer), unless it is past kKeptPackedFloats.
  thread_local std::vector<float> packed_keys;
  packed_keys.resize(prefill.floats);
  prefill.storage = packed_keys.data();
  OrtStatus* status = with_cache_type(cache_type, [&](auto tag) -> OrtStatus* {
    ATTNEXPORT_RETURN_IF_ERROR(run_all<decltype(tag)>(context, batch, prefill, items));
    for (const Split& split : splits_) combine_splits(batch, split);
    return nullptr;
  });
  if (packed_keys.size() > kKeptPackedFloats) std::vector<float>().swap(packed_keys);
  return status;
}

std::pair<int64_t, int64_t> PagedAttention::visible_keys(int64_t length, int64_t num_queries,
                                                         int64_t first_query, int64_t count,
                                                         int64_t* lo, int64_t* hi,
                                                         int64_t* position) const {
  int64_t first_key = length, end_key = 0;
  for (int64_t j = 0; j < count; ++j) {
    const int64_t p = length - num_queries + first_query + j;
    position[j] = p;
    lo[j] = sliding_window >= 0 ? std::max<int64_t>(0, p - sliding_window + 1) : 0;
    hi[j] = causal ? std::min(length, p + 1) : length;
    if (lo[j] < hi[j]) {
      first_key = std::min(first_key, lo[j]);
      end_key = std::max(end_key, hi[j]);
    }
  }
  return {first_key, end_key};
}

// Rows are held as NV vectors of 16 floats, zero padded: the smallest compiled NV that fits.
int64_t PagedAttention::padded_width() const {
  const int64_t needed = (head_size + 15) / 16;
  return 16 * (needed <= 8 ? needed : needed <= 12 ? 12 : 16);
}

// out = sum_i exp(m_i - M) o_i / sum_i exp(m_i - M) l_i over the splits' partial rows.
void PagedAttention::combine_splits(const Batch& batch, const Split& split) const {
  const int64_t W = padded_width(), D = head_size, stride = W + 2;
  const int64_t first_row = batch.query_start[split.seq] * num_heads * D;
  std::vector<float> total(W);
  for (int64_t h = 0; h < num_heads; ++h) {
    float max = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < split.count; ++i) {
      const float* part = batch.partials + ((split.first + i) * num_heads + h) * stride;
      if (part[1] > 0.0f) max = std::max(max, part[0]);
    }
    std::fill(total.begin(), total.end(), 0.0f);
    float sum = 0.0f;
    for (int64_t i = 0; i < split.count; ++i) {
      const float* part = batch.partials + ((split.first + i) * num_heads + h) * stride;
      if (part[1] <= 0.0f) continue;  // the split saw no key of this row
      const float weight = exp_nonpositive<float, int32_t>(part[0] - max);
      sum += weight * part[1];
      for (int64_t d = 0; d < W; ++d) total[d] += weight * part[2 + d];
    }
    const float inverse = softmax_inverse(batch, h, sum, max);
    for (int64_t d = 0; d < D; ++d)
      store_element(batch.out, batch.query_type, first_row + h * D + d, total[d] * inverse);
  }
}

template <typename C>
OrtStatus* PagedAttention::run_all(OrtKernelContext* context, const Batch& batch,
                                   const PrefillPlan& prefill,
                                   const std::vector<WorkItem>& items) const {
  const bool parallel = batch.multiply_adds >= kParallelWork;
  auto pack = [&](size_t i) { pack_chunk<C>(batch, prefill, static_cast<int64_t>(i)); };
  if (!parallel)
    for (size_t i = 0; i < prefill.pack_jobs.size(); ++i) pack(i);
  else if (!prefill.pack_jobs.empty())
    ATTNEXPORT_RETURN_IF_ERROR(parallel_for(context, prefill.pack_jobs.size(), pack));
  const std::vector<PrefillTile>& tiles = prefill.tiles;
  const size_t total = tiles.size() + items.size();
  switch (padded_width() / 16) {
#define ATTNEXPORT_CASE(NV)                                                  \
  case NV: {                                                                \
    auto run = [&](size_t i) {                                              \
      if (i < tiles.size()) attend_tile(batch, prefill, tiles[i]);          \
      else attend<C, NV>(batch, items[i - tiles.size()]);                   \
    };                                                                      \
    if (!parallel) {                                                        \
      for (size_t i = 0; i < total; ++i) run(i);                            \
      return nullptr;                                                       \
    }                                                                       \
    return parallel_for(context, total, run);                               \
  }
    ATTNEXPORT_CASE(1)
    ATTNEXPORT_CASE(2)
    ATTNEXPORT_CASE(3)
    ATTNEXPORT_CASE(4)
    ATTNEXPORT_CASE(5)
    ATTNEXPORT_CASE(6)
    ATTNEXPORT_CASE(7)
    ATTNEXPORT_CASE(8)
    ATTNEXPORT_CASE(12)
    ATTNEXPORT_CASE(16)
#undef ATTNEXPORT_CASE
    default:  // init() refused head sizes past kMaxHeadSize
      return invalid("PagedAttention: unsupported head_size");
  }
}

namespace {

// One cache row (D elements of C) as W float lanes, zero padded; an int8 row is dequantized
// (float(q) * scale, the op contract's order, docs/ops.md). For head sizes that are not a
// whole number of 16-lane vectors (vector loads would run past the row).
template <typename C>
inline void widen_row(const C* src, float* dst, int64_t D, int64_t W, float scale) {
  const int64_t whole = D / 16 * 16;
  int64_t d = 0;
  if constexpr (std::is_same_v<C, int8_t>) {
    const f32x16 scales = splat16(scale);
    for (; d < whole; d += 16) store16(dst + d, load16_float(src + d) * scales);
    for (; d < D; ++d) dst[d] = to_float(src[d]) * scale;
  } else {
    for (; d < whole; d += 16) store16(dst + d, load16_float(src + d));
    for (; d < D; ++d) dst[d] = to_float(src[d]);
  }
  for (; d < W; ++d) dst[d] = 0.0f;
}

// Asks for the rows of KV head `head` of slots [k0, k1) of a sequence (into every cache
// level). A decode step's rows come from memory (the weights evicted them), one row per slot of
// num_kv_heads rows, each slot on its own page for large heads, where the hardware prefetcher
// does not follow: asking for the next chunk ahead keeps its rows in flight (the AVX-512 build;
// the AVX2 one asks a few keys ahead instead, see kPrefetchKeys).
// Rows of KV heads [head, head + heads): adjacent in a slot.
template <typename C>
inline void prefetch_rows(const C* cache, const int32_t* table, int64_t k0, int64_t k1,
                          int64_t block_size, int64_t num_kv_heads, int64_t head, int64_t heads,
                          int64_t D) {
  const int64_t row_bytes = heads * D * static_cast<int64_t>(sizeof(C));
  const int64_t slot_bytes = num_kv_heads * D * static_cast<int64_t>(sizeof(C));
  for (int64_t k = k0; k < k1;) {
    const int64_t offset = k % block_size, end = std::min(k1, k - offset + block_size);
    const char* row = reinterpret_cast<const char*>(
        cache + ((table[k / block_size] * block_size + offset) * num_kv_heads + head) * D);
    for (; k < end; ++k, row += slot_bytes)
      for (int64_t at = 0; at < row_bytes; at += 64) __builtin_prefetch(row + at, 0, 3);
  }
}

// HG query rows (heads of one KV head's group, one query token) against keys [a, e) of one
// chunk: their scores, the online softmax update and the weighted values.
struct RowStep {
  const float* queries;  // HG rows of W lanes, scaled and zero padded
  float* outputs;        // HG rows of W lanes: the unnormalised running output
  float* maxes;          // HG running maxima
  float* sums;           // HG running sums
  float* scores;         // HG rows of `score_stride` floats (scratch)
  int64_t score_stride;
  int64_t a, e, k0;            // keys [a, e) of the chunk starting at key k0
  const void* const* keys;     // keys[k - k0]: the row of key k (R elements, see step_rows)
  const void* const* values;
  const float* key_scales;     // int8 rows: key_scales[k - k0], else null
  const float* value_scales;
  float soft_cap;
  const float* slopes;  // HG ALiBi slopes, or null
  int64_t position;     // of the query token
  };

// Query rows of a group that share each loaded (and widened) key and value vector, so that
// a group's keys and values are read (and widened) once, not once per query head.
//
// AVX-512 (step_rows_wide): HG * NV query vectors stay in registers up to 16 (4 rows at NV = 4,
// 2 at NV = 8: 4 rows there, their queries read from memory, measured 0.8x of 2 rows), 16 keys'
// products held for one transposing sum.
//
// AVX2 (step_rows_narrow), where a 16-float vector takes two of only 16 registers: the same
// blocking spilled most of the loop to the stack, and one row at a time re-read (and re-widened)
// the keys and values once per query head, 3x for a 9-over-3-heads model. There the rows work
// on 8-lane vectors: 3 rows x 4 keys of 8-lane products in 12 registers, each query vector read
// from memory as the multiply-add's operand, each key vector loaded once for the 3 rows.
#ifdef __AVX512F__
constexpr bool kWideRegisters = true;
#else
constexpr bool kWideRegisters = false;
#endif
constexpr int rows_per_step(int NV) {
  return !kWideRegisters ? 3 : NV <= 4 ? 4 : NV <= 8 ? 2 : 1;
}
// Vectors of a value row accumulated per pass over the keys (VB, a divisor of the row's
// vectors): HG * VB accumulators stay in registers, at most 16 of AVX-512's 32 registers, or
// 12 of AVX2's 16 (8-lane vectors: 3 rows' weights and a value vector take the rest).
constexpr int value_block(int vectors, int HG, int most) {
  int block = vectors;
  while (block > 1 && (block * HG > most || vectors % block != 0)) --block;
  return block;
}

// The online softmax update of the HG rows' scores s[g][k], k in [a, e): scaled (int8 keys),
// soft-capped, ALiBi-biased, then replaced by their weights exp(s - max), times the value
// scales of int8 rows; each row's running maximum and sum are updated and rescale[g] is the
// factor its accumulated output takes for the new maximum.
template <int HG>
void update_softmax(const RowStep& p, float* const (&s)[HG], float (&rescale)[HG]) {
  for (int g = 0; g < HG; ++g) {
    float* sg = s[g];
    int64_t k;
    if (p.key_scales != nullptr) {
      const float* scales = p.key_scales - p.k0;
      for (k = p.a; k < p.e; ++k) sg[k] *= scales[k];
    }
    if (p.soft_cap > 0.0f)
      for (k = p.a; k < p.e; ++k) sg[k] = p.soft_cap * std::tanh(sg[k] / p.soft_cap);
    if (p.slopes != nullptr)
      for (k = p.a; k < p.e; ++k) sg[k] += p.slopes[g] * static_cast<float>(k - p.position);
    Accumulator16 maxes(splat16(-std::numeric_limits<float>::infinity()));
    for (k = p.a; k + 16 <= p.e; k += 16) maxes.take_larger(load16(sg + k));
    float chunk_max = -std::numeric_limits<float>::infinity();
    const f32x16 lane_maxes = maxes.value();
    for (int i = 0; i < 16; ++i) chunk_max = std::max(chunk_max, lane_maxes[i]);
    for (; k < p.e; ++k) chunk_max = std::max(chunk_max, sg[k]);
    const float previous = p.maxes[g], max = std::max(previous, chunk_max);
    // exp(previous - max) in [0, 1]; the first chunk's rescale multiplies zeros.
    rescale[g] = previous == max ? 1.0f : exp_nonpositive<float, int32_t>(previous - max);
    p.maxes[g] = max;
    Accumulator16 weight_sums;
    for (k = p.a; k + 16 <= p.e; k += 16) {  // the weights of 16 keys at once
      const f32x16 weights = exp_nonpositive<f32x16, i32x16>(load16(sg + k) - max);
      store16(sg + k, weights);
      weight_sums.add(weights);
    }
    float sum = p.sums[g] * rescale[g] + horizontal_sum(weight_sums.value());
    for (; k < p.e; ++k) {
      sg[k] = exp_nonpositive<float, int32_t>(sg[k] - max);
      sum += sg[k];
    }
    p.sums[g] = sum;
    if (p.value_scales != nullptr) {
      const float* scales = p.value_scales - p.k0;
      for (k = p.a; k < p.e; ++k) sg[k] *= scales[k];
    }
  }
}

// The rows hold R elements (the cache's own type read in place, or float rows widened into
// scratch). Each key and value vector is loaded and widened once for the HG rows, which take
// it from a register: widening 16-bit or int8 rows into a float copy first took about as many
// instructions as the attention's multiply-adds. int8 scales are applied to the scores (keys)
// and to the softmax weights (values), not per element.
template <typename R, int NV, int HG>
void step_rows_wide(const RowStep& p) {
  constexpr int64_t W = NV * 16;
  const R* const* keys = reinterpret_cast<const R* const*>(p.keys) - p.k0;
  const R* const* values = reinterpret_cast<const R* const*>(p.values) - p.k0;
  float* s[HG];
  for (int g = 0; g < HG; ++g) s[g] = p.scores + g * p.score_stride - p.a;  // s[g][k], k in [a, e)
  f32x16 q[HG][NV];  // (loaded once: the stores below may alias p.queries for the compiler)
  for (int g = 0; g < HG; ++g)
    for (int v = 0; v < NV; ++v) q[g][v] = load16(p.queries + g * W + v * 16);
  auto dot = [&](const R* key, f32x16 (&acc)[HG]) {
    const f32x16 x = load16_float(key);
    for (int g = 0; g < HG; ++g) acc[g] = q[g][0] * x;
    for (int v = 1; v < NV; ++v) {
      const f32x16 y = load16_float(key + v * 16);
      for (int g = 0; g < HG; ++g) acc[g] += q[g][v] * y;
    }
  };
  int64_t k = p.a;
  for (; k + 16 <= p.e; k += 16) {  // 16 keys' products, summed together
    f32x16 products[HG][16];
    for (int i = 0; i < 16; ++i) {
      f32x16 acc[HG];
      dot(keys[k + i], acc);
      for (int g = 0; g < HG; ++g) products[g][i] = acc[g];
    }
    for (int g = 0; g < HG; ++g) store16(s[g] + k, horizontal_sums16(products[g]));
  }
  for (; k < p.e; ++k) {
    f32x16 acc[HG];
    dot(keys[k], acc);
    for (int g = 0; g < HG; ++g) s[g][k] = horizontal_sum(acc[g]);
  }

  float rescale[HG];
  update_softmax<HG>(p, s, rescale);

  constexpr int VB = value_block(NV, HG, 16);
  for (int v0 = 0; v0 < NV; v0 += VB) {
    f32x16 acc[HG][VB];
    for (int g = 0; g < HG; ++g)
      for (int v = 0; v < VB; ++v)
        acc[g][v] = load16(p.outputs + g * W + (v0 + v) * 16) * rescale[g];
    for (k = p.a; k < p.e; ++k) {
      const R* value = values[k] + v0 * 16;
      f32x16 w[HG];
      for (int g = 0; g < HG; ++g) w[g] = splat16(s[g][k]);
      for (int v = 0; v < VB; ++v) {
        const f32x16 x = load16_float(value + v * 16);
        for (int g = 0; g < HG; ++g) acc[g][v] += w[g] * x;
      }
    }
    for (int g = 0; g < HG; ++g)
      for (int v = 0; v < VB; ++v) store16(p.outputs + g * W + (v0 + v) * 16, acc[g][v]);
  }
}

#ifndef __AVX512F__
typedef float f32x4_unaligned __attribute__((vector_size(16), aligned(4)));

// The sums of the lanes of 4 vectors: lane i is ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 +
// a7)) of v[i] (vhaddps order; a key's score does not depend on which keys share its block).
inline f32x4 horizontal_sums4(const f32x8 (&v)[4]) {
  auto pairs = [](f32x8 x, f32x8 y) {  // [x01 x23 y01 y23 | x45 x67 y45 y67]
    return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
  };
  const f32x8 sums = pairs(pairs(v[0], v[1]), pairs(v[2], v[3]));
  return __builtin_shufflevector(sums, sums, 0, 1, 2, 3) +
         __builtin_shufflevector(sums, sums, 4, 5, 6, 7);
}

// The rows a few keys ahead are asked for as the loops go (every cache level): a decode step's
// rows come from memory, and asking for a whole chunk's rows at once before reading it
// (prefetch_rows) bought nothing here, where asking as the loop goes took 0.75-0.8x the time
// (one layer's decode at 9/3/64 heads, batch 8 x 1024 keys and 32 x 128, float32; int8 0.86x).
constexpr int64_t kPrefetchKeys = 8;
template <typename R>
inline void prefetch_row(const R* row, int vectors) {  // `vectors` 8-element vectors of R
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int at = 0; at < vectors * 8 * static_cast<int>(sizeof(R)); at += 64)
    __builtin_prefetch(bytes + at, 0, 3);
}

template <typename R, int NV, int HG>
void step_rows_narrow(const RowStep& p) {
  constexpr int64_t W = NV * 16;
  constexpr int H = 2 * NV;  // 8-lane vectors of a row
  const R* const* keys = reinterpret_cast<const R* const*>(p.keys) - p.k0;
  const R* const* values = reinterpret_cast<const R* const*>(p.values) - p.k0;
  float* s[HG];
  for (int g = 0; g < HG; ++g) s[g] = p.scores + g * p.score_stride - p.a;  // s[g][k], k in [a, e)
  const float* q = p.queries;
  auto query = [&](int g, int c) {
    return *reinterpret_cast<const f32x8_unaligned*>(q + g * W + c * 8);
  };
  int64_t k = p.a;
  for (; k + 4 <= p.e; k += 4) {
    f32x8 acc[HG][4] = {};
    const R* key[4] = {keys[k], keys[k + 1], keys[k + 2], keys[k + 3]};
    for (int i = 0; i < 4; ++i)
      if (k + kPrefetchKeys + i < p.e) prefetch_row(keys[k + kPrefetchKeys + i], H);
    for (int c = 0; c < H; ++c) {  // (HG query vectors, 1 key vector, 12 sums: 16 registers)
      f32x8 qc[HG];
      for (int g = 0; g < HG; ++g) qc[g] = query(g, c);
      for (int i = 0; i < 4; ++i) {
        const f32x8 x = load8_float(key[i] + c * 8);
        for (int g = 0; g < HG; ++g) acc[g][i] += qc[g] * x;
      }
    }
    for (int g = 0; g < HG; ++g)
      *reinterpret_cast<f32x4_unaligned*>(s[g] + k) = horizontal_sums4(acc[g]);
  }
  for (; k < p.e; ++k) {
    f32x8 acc[HG][4] = {};
    for (int c = 0; c < H; ++c) {
      const f32x8 x = load8_float(keys[k] + c * 8);
      for (int g = 0; g < HG; ++g) acc[g][0] += query(g, c) * x;
    }
    for (int g = 0; g < HG; ++g) s[g][k] = horizontal_sums4(acc[g])[0];
  }

  float rescale[HG];
  update_softmax<HG>(p, s, rescale);

  constexpr int VB = value_block(H, HG, 12);
  for (int c0 = 0; c0 < H; c0 += VB) {
    f32x8 acc[HG][VB];
    for (int g = 0; g < HG; ++g)
      for (int v = 0; v < VB; ++v)
        acc[g][v] = *reinterpret_cast<const f32x8_unaligned*>(p.outputs + g * W + (c0 + v) * 8) *
                    rescale[g];
    for (k = p.a; k < p.e; ++k) {
      const R* value = values[k] + c0 * 8;
      if (k + kPrefetchKeys < p.e) prefetch_row(values[k + kPrefetchKeys] + c0 * 8, VB);
      f32x8 w[HG];
      for (int g = 0; g < HG; ++g) w[g] = splat8(s[g][k]);
      for (int v = 0; v < VB; ++v) {
        const f32x8 x = load8_float(value + v * 8);
        for (int g = 0; g < HG; ++g) acc[g][v] += w[g] * x;
      }
    }
    for (int g = 0; g < HG; ++g)
      for (int v = 0; v < VB; ++v)
        *reinterpret_cast<f32x8_unaligned*>(p.outputs + g * W + (c0 + v) * 8) = acc[g][v];
  }
}
#endif

template <typename R, int NV, int HG>
void step_rows(const RowStep& p) {
#ifdef __AVX512F__
  step_rows_wide<R, NV, HG>(p);
#else
  step_rows_narrow<R, NV, HG>(p);
#endif
}

template <typename R, int NV>
void step_rows(const RowStep& p, int64_t rows) {
  constexpr int most = rows_per_step(NV);
  if constexpr (most >= 4)
    if (rows >= 4) return step_rows<R, NV, 4>(p);
  if constexpr (most >= 3)
    if (rows == 3) return step_rows<R, NV, 3>(p);
  if constexpr (most >= 2)
    if (rows >= 2) return step_rows<R, NV, 2>(p);
  return step_rows<R, NV, 1>(p);
}

}  // namespace

template <typename C, int NV>
void PagedAttention::attend(const Batch& batch, const WorkItem& item) const {
  constexpr int64_t W = NV * 16;  // padded row width
  // Rows whose head size fills whole vectors are read in place (in the cache's type); others
  // are widened (int8 ones dequantized) into float scratch rows once per chunk and KV head.
  const bool in_place = head_size == W;
  const int64_t group = num_heads / num_kv_heads, D = head_size;
  const int64_t length = batch.seq_lens[item.seq];
  const int64_t seq_start = batch.query_start[item.seq];
  const int64_t num_queries = batch.query_start[item.seq + 1] - seq_start;
  const int32_t* table = batch.block_tables + item.seq * batch.max_blocks;
  const int64_t heads = item.kv_end - item.kv_begin;
  const int64_t head_rows = item.num_queries * group;  // rows of one KV head
  const int64_t rows = heads * head_rows;

  // Visible keys of each query j of the tile: [lo[j], hi[j]); position p = length - q + j.
  int64_t lo[kQueryTile], hi[kQueryTile], position[kQueryTile];
  const std::pair<int64_t, int64_t> visible =
      visible_keys(length, num_queries, item.first_query, item.num_queries, lo, hi, position);
  const int64_t first_key = std::max(visible.first, item.block_begin * block_size);
  const int64_t end_key = std::min(visible.second, item.block_end * block_size);

  // Row r = (h - kv_begin) * head_rows + j * group + g is head h * group + g of token
  // seq_start + first + j (the G heads of a token are adjacent), scaled, zero padded to W.
  thread_local std::vector<float> queries, outputs, maxes, sums, scores, key_scratch,
      value_scratch, key_scales, value_scales;
  thread_local std::vector<const void*> key_rows, value_rows;
  queries.assign(rows * W, 0.0f);
  for (int64_t h = item.kv_begin; h < item.kv_end; ++h)
    for (int64_t j = 0; j < item.num_queries; ++j) {
      const int64_t src = ((seq_start + item.first_query + j) * num_heads + h * group) * D;
      float* dst = queries.data() + ((h - item.kv_begin) * head_rows + j * group) * W;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d)
          dst[g * W + d] = scale * load_element(batch.query, batch.query_type, src + g * D + d);
    }
  // One pass over the keys and values, a chunk of whole blocks at a time (an online softmax:
  // each row keeps its running maximum and sum, and rescales its accumulated output when the
  // maximum grows), so that every key and value row comes from memory once. Two passes (all
  // scores, then all values) read the values after a long context had evicted their prefetch.
  outputs.assign(rows * W, 0.0f);
  maxes.assign(rows, -std::numeric_limits<float>::infinity());
  sums.assign(rows, 0.0f);
  // A chunk's rows of all the item's heads stay within kChunkBytes (L2) until they are read.
  const int64_t row_pair_bytes = 2 * heads * D * static_cast<int64_t>(sizeof(C));
  const int64_t chunk_keys = std::min(kChunkKeys, kChunkBytes / row_pair_bytes);
  const int64_t chunk = std::max<int64_t>(1, chunk_keys / block_size) * block_size;
  constexpr int64_t step = rows_per_step(NV);
  scores.resize(step * (chunk + 16));
  key_rows.resize(chunk);
  value_rows.resize(chunk);
  constexpr bool int8 = std::is_same_v<C, int8_t>;
  if (int8 && in_place) {
    key_scales.resize(chunk);
    value_scales.resize(chunk);
  }
  if (!in_place) {
    key_scratch.resize(chunk * W);
    value_scratch.resize(chunk * W);
  }

  float* const query_rows = queries.data();
  float* const output_rows = outputs.data();
  float* const row_maxes = maxes.data();
  float* const row_sums = sums.data();
  float* const score_rows = scores.data();

  const C* key_cache = static_cast<const C*>(batch.key_cache);
  const C* value_cache = static_cast<const C*>(batch.value_cache);
  const int64_t slot_stride = num_kv_heads * D;
  // Chunks start at block boundaries: [c0, c1) with c0 a multiple of block_size.
  const int64_t first_chunk = first_key / block_size * block_size;
  // While a chunk is read, the next one's rows (of all the item's heads) are asked for (AVX-512).
  auto prefetch = [&](int64_t c0) {
    if (c0 >= end_key) return;
    const int64_t k0 = std::max(c0, first_key), k1 = std::min(c0 + chunk, end_key);
    prefetch_rows(key_cache, table, k0, k1, block_size, num_kv_heads, item.kv_begin, heads, D);
    prefetch_rows(value_cache, table, k0, k1, block_size, num_kv_heads, item.kv_begin, heads, D);
  };
  for (int64_t c0 = first_chunk; c0 < end_key; c0 += chunk) {
    const int64_t k0 = std::max(c0, first_key), k1 = std::min(c0 + chunk, end_key);
    if constexpr (kWideRegisters) prefetch(c0 + chunk);  // (AVX2: as the rows are read)
    for (int64_t h = item.kv_begin; h < item.kv_end; ++h) {
      // The chunk's rows of head h: key_rows[k - k0] for k in [k0, k1). (Raw pointers: each
      // use of a thread_local costs a __tls_get_addr call in a shared library.)
      const void** key_row = key_rows.data();
      const void** value_row = value_rows.data();
      float* key_scale_row = key_scales.data();
      float* value_scale_row = value_scales.data();
      float* key_widened = key_scratch.data();
      float* value_widened = value_scratch.data();
      for (int64_t k = k0; k < k1;) {
        const int64_t block = table[k / block_size], offset = k % block_size;
        const int64_t end = std::min(k1, k - offset + block_size);
        for (int64_t slot = block * block_size + offset; k < end; ++k, ++slot) {
          const int64_t i = k - k0, at = slot * slot_stride + h * D;
          float key_scale = 1.0f, value_scale = 1.0f;
          if constexpr (int8) {
            key_scale = batch.key_scales[slot * num_kv_heads + h];
            value_scale = batch.value_scales[slot * num_kv_heads + h];
          }
          if (in_place) {
            key_row[i] = key_cache + at;
            value_row[i] = value_cache + at;
            if constexpr (int8) {
              key_scale_row[i] = key_scale;
              value_scale_row[i] = value_scale;
            }
          } else {
            widen_row(key_cache + at, key_widened + i * W, D, W, key_scale);
            widen_row(value_cache + at, value_widened + i * W, D, W, value_scale);
            key_row[i] = key_widened + i * W;
            value_row[i] = value_widened + i * W;
          }
        }
      }
      for (int64_t j = 0; j < item.num_queries; ++j) {
        const int64_t a = std::max(lo[j], k0), e = std::min(hi[j], k1);
        if (a >= e) continue;
        for (int64_t g = 0; g < group; g += step) {
          const int64_t r = (h - item.kv_begin) * head_rows + j * group + g;
          const RowStep rows_step{query_rows + r * W,
                                  output_rows + r * W,
                                  row_maxes + r,
                                  row_sums + r,
                                  score_rows,
                                  chunk + 16,
                                  a,
                                  e,
                                  k0,
                                  key_row,
                                  value_row,
                                  int8 && in_place ? key_scale_row : nullptr,
                                  int8 && in_place ? value_scale_row : nullptr,
                             soft_cap,
                             batch.slopes.empty() ? nullptr : batch.slopes.data() + h * group + g,
                             position[j]};
          const int64_t count = std::min(step, group - g);
          if (in_place) step_rows<C, NV>(rows_step, count);
          else step_rows<float, NV>(rows_step, count);
        }
      }
    }
  }

  if (item.partial >= 0) {  // a decode split (one query: row r is head kv_begin * group + r)
    float* part = batch.partials + (item.partial * num_heads + item.kv_begin * group) * (W + 2);
    for (int64_t r = 0; r < rows; ++r, part += W + 2) {
      part[0] = maxes[r];
      part[1] = sums[r];
      std::copy(outputs.data() + r * W, outputs.data() + (r + 1) * W, part + 2);
    }
    return;
  }
  // A row that sees no key (sum 0) is zeros.
  for (int64_t h = item.kv_begin; h < item.kv_end; ++h)
    for (int64_t j = 0; j < item.num_queries; ++j) {
      const int64_t dst = ((seq_start + item.first_query + j) * num_heads + h * group) * D;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = (h - item.kv_begin) * head_rows + j * group + g;
        const float inverse = softmax_inverse(batch, h * group + g, sums[r], maxes[r]);
        for (int64_t d = 0; d < D; ++d)
          store_element(batch.out, batch.query_type, dst + g * D + d, outputs[r * W + d] * inverse);
      }
    }
}

}  // namespace attnexport
