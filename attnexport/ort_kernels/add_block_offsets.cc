// attnexport.AddBlockOffsets for onnxruntime's CPU execution provider: the offsets half of a
// MatMulNBits with float (HQQ) zero points, in one node.
//
// Its function body is a Reshape, a ReduceSum, the offsets' MatMul and an Add: four nodes per
// projection, which at one row cost more than their arithmetic (SmolLM2-135M int4: 480 of a
// decode step's 1073 nodes). No library has the fused form, hence this kernel:
//
//   out[r, n] = y[r, n] + sum_b blocksum(a)[r, b] * (offsets[b, n] * scale[b / ob, n])
//
// in float32. The table is dequantized 64 columns at a time into a buffer that stays in L1, then
// every row's outputs sum over b in order from zero: a row's numbers do not depend on its batch.

#include "add_block_offsets.h"

#include <string>
#include <vector>

#include "kernel_api.h"
#include "vector_math.h"

namespace attnexport {
namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kTile = 64;  // columns per tile: 4 accumulators of 16 lanes
constexpr int64_t kDirectRows = 2;  // up to this many rows dequantize the table as they read it
#if defined(__AVX512F__)
constexpr int64_t kRowGroup = 4;  // rows that share a load of the table
#else
constexpr int64_t kRowGroup = 1;  // (AVX2's 16 registers hold one row's 4 accumulators)
#endif

// sums[b] = a[b * block_size : (b + 1) * block_size] summed, the last block short, b < blocks.
void block_sums(const float* a, int64_t k, int64_t block_size, int64_t blocks, float* sums) {
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * block_size, end = first + block_size < k ? first + block_size : k;
    int64_t i = first;
    Accumulator16 total;
    for (; i + kLanes <= end; i += kLanes) total.add(load16(a + i));
    float sum = horizontal_sum(total.value());
    for (; i < end; ++i) sum += a[i];
    sums[b] = sum;
  }
}

struct Problem {
  const float* y;
  const float* sums;      // [rows, blocks]
  const int8_t* offsets;  // [blocks, n]
  const float* scales;    // [ceil(blocks / offset_block_size), n]
  float* out;
  int64_t rows, n, blocks, offset_block_size;
};

// total[v] = sum_b sums[b] * table[b, first + 16 v : first + 16 (v + 1)] for one row, the table
// dequantized as it is read (a call of few rows reads each weight once or twice).
void row_direct(const Problem& p, const float* sums, int64_t first,
                f32x16 (&total)[kTile / kLanes]) {
  for (int64_t b = 0; b < p.blocks; ++b) {
    const int8_t* q = p.offsets + b * p.n + first;
    const float* s = p.scales + (b / p.offset_block_size) * p.n + first;
    const f32x16 sum = splat16(sums[b]);
    for (int64_t v = 0; v < kTile / kLanes; ++v) {
      const f32x16 entry = load16_float(q + v * kLanes) * load16(s + v * kLanes);
      total[v] += sum * entry;
    }
  }
}

// out[r, first : first + width] = y[r, ...] + total[v] lanes, for one row r.
void store_row(const Problem& p, int64_t r, int64_t first, int64_t width,
               const f32x16 (&total)[kTile / kLanes]) {
  const float* y = p.y + r * p.n + first;
  float* out = p.out + r * p.n + first;
  if (width == kTile) {
    for (int64_t v = 0; v < kTile / kLanes; ++v)
      store16(out + v * kLanes, load16(y + v * kLanes) + total[v]);
    return;
  }
  alignas(64) float lanes[kTile];
  for (int64_t v = 0; v < kTile / kLanes; ++v) store16(lanes + v * kLanes, total[v]);
  for (int64_t c = 0; c < width; ++c) out[c] = y[c] + lanes[c];
}

// Rows [first_row, first_row + kRows) of a tile from its dequantized table, each table row
// loaded once for the kRows rows (4: 16 accumulators, which AVX-512's 32 registers hold).
template <int64_t kRows>
void rows_from_table(const Problem& p, int64_t first_row, int64_t first, int64_t width,
                     const float* table) {
  f32x16 total[kRows][kTile / kLanes] = {};
  for (int64_t b = 0; b < p.blocks; ++b) {
    f32x16 entries[kTile / kLanes];
    for (int64_t v = 0; v < kTile / kLanes; ++v)
      entries[v] = load16(table + b * kTile + v * kLanes);
    for (int64_t g = 0; g < kRows; ++g) {
      const f32x16 sum = splat16(p.sums[(first_row + g) * p.blocks + b]);
      for (int64_t v = 0; v < kTile / kLanes; ++v) total[g][v] += sum * entries[v];
    }
  }
  for (int64_t g = 0; g < kRows; ++g) store_row(p, first_row + g, first, width, total[g]);
}

// out[:, first : first + kTile] for every row; `width` < kTile columns at the end.
void add_tile(const Problem& p, int64_t first) {
  const int64_t width = first + kTile <= p.n ? kTile : p.n - first;
  if (width == kTile && p.rows <= kDirectRows) {
    for (int64_t r = 0; r < p.rows; ++r) {
      f32x16 total[kTile / kLanes] = {};
      row_direct(p, p.sums + r * p.blocks, first, total);
      store_row(p, r, first, width, total);
    }
    return;
  }
  // the tile dequantized once, then read by every row from L1
  thread_local std::vector<float> table;
  table.resize(static_cast<size_t>(p.blocks * kTile));
  for (int64_t b = 0; b < p.blocks; ++b) {
    const int8_t* q = p.offsets + b * p.n + first;
    const float* s = p.scales + (b / p.offset_block_size) * p.n + first;
    float* row = &table[b * kTile];
    if (width == kTile) {
      for (int64_t c = 0; c < kTile; c += kLanes)
        store16(row + c, load16_float(q + c) * load16(s + c));
    } else {
      for (int64_t c = 0; c < kTile; ++c)
        row[c] = c < width ? static_cast<float>(q[c]) * s[c] : 0.0f;
    }
  }
  int64_t r = 0;
  for (; r + kRowGroup <= p.rows; r += kRowGroup)
    rows_from_table<kRowGroup>(p, r, first, width, table.data());
  for (; r < p.rows; ++r) rows_from_table<1>(p, r, first, width, table.data());
}

}  // namespace

OrtStatus* AddBlockOffsets::init(const OrtKernelInfo* info) {
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "block_size", &block_size));
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "offset_block_size", &offset_block_size));
  if (block_size <= 0 || offset_block_size <= 0)
    return invalid("AddBlockOffsets: expected block_size > 0 and offset_block_size > 0, got " +
                   std::to_string(block_size) + " and " + std::to_string(offset_block_size));
  return nullptr;
}

OrtStatus* AddBlockOffsets::compute(OrtKernelContext* context) const {
  Tensor y, a, offsets, scales;
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 0, &y));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 1, &a));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 2, &offsets));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 3, &scales));
  constexpr ONNXTensorElementDataType kFloat = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  if (y.type != kFloat || a.type != kFloat || scales.type != kFloat ||
      offsets.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8)
    return invalid(std::string("AddBlockOffsets: expected y, a and offset_scales float32 and "
                               "offsets int8, got ") +
                   type_name(y.type) + ", " + type_name(a.type) + ", " + type_name(scales.type) +
                   " and " + type_name(offsets.type));
  if (a.dims.empty() || offsets.dims.size() != 2)
    return invalid("AddBlockOffsets: expected a [..., K] and offsets [blocks, N], got a " +
                   a.shape() + " and offsets " + offsets.shape());
  const int64_t k = a.dims.back(), blocks = (k + block_size - 1) / block_size;
  const int64_t n = offsets.dims[1];
  if (offsets.dims[0] != blocks)
    return invalid("AddBlockOffsets: offsets: expected " + std::to_string(blocks) +
                   " rows (the blocks of K=" + std::to_string(k) + " by block_size " +
                   std::to_string(block_size) + "), got " + offsets.shape());
  const std::vector<int64_t> scale_dims = {(blocks + offset_block_size - 1) / offset_block_size, n};
  if (scales.dims != scale_dims)
    return invalid("AddBlockOffsets: offset_scales: expected " + format_dims(scale_dims) +
                   " (offset_block_size " + std::to_string(offset_block_size) + "), got " +
                   scales.shape());
  std::vector<int64_t> y_dims(a.dims.begin(), a.dims.end() - 1);
  y_dims.push_back(n);
  if (y.dims != y_dims)
    return invalid("AddBlockOffsets: y: expected " + format_dims(y_dims) + " (a " + a.shape() +
                   " with offsets for N=" + std::to_string(n) + "), got " + y.shape());
  Tensor out;
  ATTNEXPORT_RETURN_IF_ERROR(make_output(context, 0, y_dims, &out));
  const int64_t rows = n ? y.numel() / n : 0;
  if (rows == 0 || n == 0) return nullptr;
  std::vector<float> sums(static_cast<size_t>(rows * blocks));
  const auto* as = static_cast<const float*>(a.data);
  for (int64_t r = 0; r < rows; ++r)
    block_sums(as + r * k, k, block_size, blocks, &sums[r * blocks]);
  const Problem problem{static_cast<const float*>(y.data), sums.data(),
                        static_cast<const int8_t*>(offsets.data),
                        static_cast<const float*>(scales.data), static_cast<float*>(out.data),
                        rows, n, blocks, offset_block_size};
  const int64_t tiles = (n + kTile - 1) / kTile;
  // One thread below 2^15 multiply-adds, where waking the pool costs more than it saves; else a
  // tile per item on the pool (one row of a 576 x 3072 projection's: 3.5 -> 2.2 us a call).
  if (rows * n * blocks < (int64_t{1} << 15)) {
    for (int64_t t = 0; t < tiles; ++t) add_tile(problem, t * kTile);
    return nullptr;
  }
  auto item = [&](size_t t) { add_tile(problem, static_cast<int64_t>(t) * kTile); };
  return parallel_for(context, static_cast<size_t>(tiles), item);
}

}  // namespace attnexport
