#pragma once

#include <onnxruntime_c_api.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace attnexport {

// Whether the prefill path can multiply bfloat16 pairs for heads of `head_size`: the AVX-512
// build on a CPU with AVX512_BF16, head_size a multiple of 16 (paged_prefill.cc).
bool bf16_pairs_available(int64_t head_size);

struct Batch;
struct WorkItem;
struct Split;
struct PrefillPlan;
struct PrefillTile;

// The node's attributes; compute() reads the seven inputs (nine with int8 caches: the key and
// value scale caches) and writes output [T, H, D] in the query's type (float32, float16 or
// bfloat16; math in float32). The caches may have another type than the query.
struct PagedAttention {
  int64_t num_heads = 0, num_kv_heads = 0, head_size = 0, block_size = 0;
  int64_t causal = 1, sliding_window = -1;
  float scale = 1.0f, soft_cap = 0.0f;
  // 1: the prefill path multiplies bfloat16 pairs where the CPU has AVX512_BF16 (docs/lowering.md).
  int64_t prefill_bf16 = 0;

  OrtStatus* init(const OrtKernelInfo* info);
  OrtStatus* compute(OrtKernelContext* context) const;

 private:
  int64_t padded_width() const;
  // Queries [first_query, first_query + count) of a sequence of `length` keys and `num_queries`
  // queries (indices within its queries): each one's position and visible keys [lo[j], hi[j]).
  // Returns the bounds of their union, {length, 0} when none sees a key.
  std::pair<int64_t, int64_t> visible_keys(int64_t length, int64_t num_queries,
                                           int64_t first_query, int64_t count, int64_t* lo,
                                           int64_t* hi, int64_t* position) const;
  void combine_splits(const Batch& batch, const Split& split) const;
  template <typename C>
  OrtStatus* run_all(OrtKernelContext* context, const Batch& batch, const PrefillPlan& prefill,
                     const std::vector<WorkItem>& items) const;
  // A decode item (one query token per sequence; paged_attention.cc).
  template <typename C, int NV>
  void attend(const Batch& batch, const WorkItem& item) const;
  // The prefill path (paged_prefill.cc): the packed keys and tiles of sequence `seq` (more than
  // one query), then, once every sequence is planned, the order of the tiles; packing one
  // chunk of keys; one tile.
  void plan_prefill(const Batch& batch, int64_t seq, PrefillPlan* plan) const;
  void order_tiles(const Batch& batch, PrefillPlan* plan) const;
  template <typename C>
  void pack_chunk(const Batch& batch, const PrefillPlan& plan, int64_t job) const;
  void attend_tile(const Batch& batch, const PrefillPlan& plan, const PrefillTile& tile) const;
};

}  // namespace attnexport
