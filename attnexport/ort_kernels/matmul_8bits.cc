// attnexport.MatMul8Bits for onnxruntime's CPU execution provider: 8-bit weights times
// activations kept at 16 bits.
//
// Written here because no library offers it on the CPU: onnxruntime's MatMulNBits either rounds
// the activations to int8 per block (accuracy_level 4: what costs the 8-bit export its agreement
// with the float model) or dequantizes the whole weight to float32 on every call (level 1:
// ~14x slower at decode). Here each row of `a` is rounded once per call to int16 per block of
// K (its scale the block's largest magnitude / 32767: a rounding 256 times finer than int8's,
// below float32's own error on these sums), and each block of a column is an integer dot
// product (vpmaddwd: 16 products per instruction, the weights widened from bytes in registers),
// scaled into float32 accumulators:
//
//   y[r, n] = sum_b  s_w[n, b] * s_a[r, b] * sum_k qa[r, k] * qw[n, k]
//                  - zero[n, b] * s_w[n, b] * s_a[r, b] * sum_k qa[r, k]       (k in block b)
//
// Float32 multiply-adds of dequantized weights measured 1.8x slower at one row (a
// conversion and a multiply-add per weight besides the product).
//
// Each output is accumulated lane-wise in K order and summed across lanes at the end, from its
// row's own rounding: a row's numbers do not depend on how many rows the call has or which tile
// computes them (batch invariance, tested bit for bit).

#include "matmul_8bits.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernel_api.h"

namespace attnexport {
namespace {

// 256-bit integer and float vectors on both the AVX2 and AVX-512 builds (a block of 16 weights
// is one step; MatMulNBits' smallest block).
constexpr int64_t kStep = 16;
// A block's int32 lane sums stay exact up to 1024 weights: 64 pairs of 32767 * 255 per lane.
constexpr int64_t kMaxBlock = 1024;

// Weights w[0..16) widened to int16.
inline __m256i load_weights(const uint8_t* w) {
  return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
}

inline f32x8 to_floats(__m256i v) { return __builtin_convertvector(reinterpret_cast<i32x8>(v), f32x8); }

// The lanes' sum, pairwise in a fixed order.
inline float lane_sum(f32x8 v) {
  const f32x4 half = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (half[0] + half[2]) + (half[1] + half[3]);
}

// A call's rows of `a`, rounded: int16 [rows, blocks * block_size] (zero past K), the scale of
// each row's block and the scaled sum of its rounded values (for the zero points' term).
struct Rows {
  std::vector<int16_t> q;
  std::vector<float> scale, scaled_sum;
};

void round_rows(const float* a, int64_t first, int64_t end, int64_t k, int64_t blocks,
                int64_t block_size, Rows& rows) {
  const int64_t padded = blocks * block_size;
  for (int64_t r = first; r < end; ++r) {
    const float* x = a + r * k;
    int16_t* q = rows.q.data() + r * padded;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t start = b * block_size, stop = start + block_size < k ? start + block_size : k;
      float largest = 0.0f;
      bool finite = true;
      for (int64_t i = start; i < stop; ++i) {
        finite = finite && std::isfinite(x[i]);
        largest = std::fmax(largest, std::fabs(x[i]));
      }
      // A NaN or infinity has no int16 step: its block's scale is NaN, so the row's outputs
      // are NaN (as float32 arithmetic would make them), never a silently finite number.
      const float scale = finite ? largest / 32767.0f : NAN;
      const float inverse = finite && largest > 0.0f ? 32767.0f / largest : 0.0f;
      int32_t sum = 0;
      for (int64_t i = start; i < stop; ++i) {
        q[i] = finite ? static_cast<int16_t>(std::nearbyint(x[i] * inverse)) : 0;
        sum += q[i];
      }
      for (int64_t i = stop; i < start + block_size; ++i) q[i] = 0;
      rows.scale[r * blocks + b] = scale;
      rows.scaled_sum[r * blocks + b] = scale * static_cast<float>(sum);
    }
  }
}

struct Weights {
  const uint8_t* q;             // [n, blocks * block_size]
  const float* scales;          // [n * blocks]
  const float* float_zeros;     // [n * blocks], or nullptr: zero points in zero_bytes
  const uint8_t* zero_bytes;    // [n * blocks], or [1] when zero_stride is 0
  int64_t zero_stride, blocks, block_size;

  float zero(int64_t index) const {
    return float_zeros != nullptr ? float_zeros[index]
                                  : static_cast<float>(zero_bytes[index * zero_stride]);
  }
};

// out[r][c] (r < R, c < C) = row first_row + r of `a` . column `column` + c of W.
template <int R, int C>
inline void dot_tile(const Rows& rows, int64_t first_row, const Weights& w, int64_t column,
                     float* out, int64_t ldo) {
  const int64_t padded = w.blocks * w.block_size;
  static_assert(C <= 4, "a row's zero-point terms are the lanes of one f32x4");
  f32x8 acc[R][C];
  // Lane c: column c's zero-point term. (As float zero_term[R][C], g++ 12 packed the terms
  // into general registers two by two on every block: as much time as the multiply-adds.)
  f32x4 zero_terms[R];
  for (int r = 0; r < R; ++r) {
    zero_terms[r] = f32x4{};
    for (int c = 0; c < C; ++c) acc[r][c] = f32x8{};
  }
  const int16_t* a = rows.q.data() + first_row * padded;
  const uint8_t* q = w.q + column * padded;
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m256i dots[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dots[r][c] = _mm256_setzero_si256();
    const int64_t start = b * w.block_size;
    // The next tile's columns, one block ahead of their use: each column is a stream of K
    // bytes, too short for the hardware prefetcher to follow (SmolLM2 int8 decode at batch 1:
    // 37 -> 57 tokens/s).
    for (int c = 0; c < C; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(q + (C + c) * padded + start), _MM_HINT_T0);
    for (int64_t i = start; i < start + w.block_size; i += kStep) {
      __m256i weight[C];
      for (int c = 0; c < C; ++c) weight[c] = load_weights(q + c * padded + i);
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + r * padded + i));
        for (int c = 0; c < C; ++c)
          dots[r][c] = _mm256_add_epi32(dots[r][c], _mm256_madd_epi16(x, weight[c]));
      }
    }
    float weight_scales[C];
    f32x4 offsets{};
    for (int c = 0; c < C; ++c) {
      const int64_t index = (column + c) * w.blocks + b;
      weight_scales[c] = w.scales[index];
      offsets[c] = -w.zero(index) * weight_scales[c];
    }
    for (int r = 0; r < R; ++r) {
      const int64_t row_block = (first_row + r) * w.blocks + b;
      const float row_scale = rows.scale[row_block], scaled_sum = rows.scaled_sum[row_block];
      zero_terms[r] += offsets * scaled_sum;
      for (int c = 0; c < C; ++c)
        acc[r][c] += to_floats(dots[r][c]) * splat8(weight_scales[c] * row_scale);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * ldo + c] = lane_sum(acc[r][c]) + zero_terms[r][c];
}

// Rows four (then two) at a time by 2 columns, one row by 4: the integer accumulators stay in
// the 16 vector registers (the float ones, touched once a block, may not). Four rows share each
// widened weight vector: 1.13x two rows' tiles at 8 to 128 rows; six rows spill (1.0x).
template <int R>
void rows_by_columns(const Rows& rows, int64_t first_row, const Weights& w, int64_t first_column,
                     int64_t end_column, float* out, int64_t ldo) {
  constexpr int kColumnTile = R == 1 ? 4 : 2;
  int64_t column = first_column;
  for (; column + kColumnTile <= end_column; column += kColumnTile)
    dot_tile<R, kColumnTile>(rows, first_row, w, column, out + column, ldo);
  for (; column < end_column; ++column) dot_tile<R, 1>(rows, first_row, w, column, out + column, ldo);
}

// The float32 panel path (nodes with batch_invariant = 0, calls of kPanelRows rows or more):
// the columns of a work item are dequantized once into float32 (W[k, n] exactly as the function
// body computes it) and every row multiplies them with float32 multiply-adds, as a float32 GEMM
// does. On AVX2 CPUs with 128-bit execution units (Zen 1) vpmaddwd makes 16 products in the time
// of two 8-lane multiply-adds, so the integer path is no faster per product there and adds its
// per-block epilogue (convert, scale, add: ~40% more instructions at block 32): SmolLM2's int8
// decode at batch 32 ran at half the float32 model's speed. Its numbers differ from the integer
// path's (float32 activations, not int16-rounded ones), hence only where a row's numbers may
// depend on its batch. From 4 rows (chain of SmolLM2's shapes against the integer path: 1.16x
// at 4 rows, 1.2x at 8, 1.6x at 32, 2.0x at 128; 0.64x at 2).
constexpr int64_t kPanelRows = 4;
// Columns per work item (two tiles of 3): their panel and 4 rows of activations stay in L1
// (chain of SmolLM2's shapes, 32 rows: 6, 12, 16, 24 columns within 5%; 6 the fastest).
constexpr int64_t kPanelColumns = 6;
// Rows per work item: a prefill's thousands of rows streamed from memory once per 6 columns
// made a 2048-row call bandwidth-bound; 64 rows (147 KB at K = 576) stay in L2 across the
// columns, and the panel's dequantization is 1/64 of a row's products.
constexpr int64_t kPanelRowBlock = 64;

// panel[c * stride + i] = W[i, first + c] for i < K (zero up to stride), c < end - first.
void dequantize_columns(const Weights& w, int64_t first, int64_t end, int64_t k, int64_t stride,
                        float* panel) {
  const int64_t padded = w.blocks * w.block_size;
  for (int64_t column = first; column < end; ++column) {
    float* out = panel + (column - first) * stride;
    const uint8_t* q = w.q + column * padded;
    for (int64_t b = 0; b < w.blocks; ++b) {
      const int64_t index = column * w.blocks + b;
      const float scale = w.scales[index], zero = w.zero(index);
      const int64_t start = b * w.block_size, stop = std::min(start + w.block_size, k);
      int64_t i = start;
      for (; i + 8 <= stop; i += 8)
        *reinterpret_cast<f32x8_unaligned*>(out + i) = (load8_float(q + i) - zero) * scale;
      for (; i < stop; ++i) out[i] = (static_cast<float>(q[i]) - zero) * scale;
    }
    for (int64_t i = k; i < stride; ++i) out[i] = 0.0f;
  }
}

// out[r][c] (r < R, c < C) = row first_row + r of `a` . panel column c: 8 lanes in K order, then
// lane_sum and the scalar tail, the same order for every R and C.
template <int R, int C>
inline void panel_tile(const float* a, int64_t k, const float* panel, int64_t stride, float* out,
                       int64_t ldo) {
  f32x8 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = f32x8{};
  const int64_t whole = k / 8 * 8;
  for (int64_t i = 0; i < whole; i += 8) {
    f32x8 weight[C];
    for (int c = 0; c < C; ++c)
      weight[c] = *reinterpret_cast<const f32x8_unaligned*>(panel + c * stride + i);
    for (int r = 0; r < R; ++r) {
      const f32x8 x = *reinterpret_cast<const f32x8_unaligned*>(a + r * k + i);
      for (int c = 0; c < C; ++c) acc[r][c] += x * weight[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float sum = lane_sum(acc[r][c]);
      for (int64_t i = whole; i < k; ++i) sum += a[r * k + i] * panel[c * stride + i];
      out[r * ldo + c] = sum;
    }
}

// Rows four at a time by three columns: 12 accumulators, 3 weight vectors and an activation
// vector in AVX2's 16 registers (1.2x six rows by two, which load 8 vectors per 12 products).
template <int R>
void panel_rows(const float* a, int64_t k, const float* panel, int64_t stride, int64_t columns,
                float* out, int64_t ldo) {
  int64_t c = 0;
  for (; c + 3 <= columns; c += 3)
    panel_tile<R, 3>(a, k, panel + c * stride, stride, out + c, ldo);
  for (; c < columns; ++c) panel_tile<R, 1>(a, k, panel + c * stride, stride, out + c, ldo);
}

void panel_columns(const float* a, int64_t count, int64_t k, const Weights& w, int64_t first,
                   int64_t end, float* out, int64_t n) {
  const int64_t stride = (k + 7) / 8 * 8;
  thread_local std::vector<float> panel;
  panel.resize(static_cast<size_t>((end - first) * stride));
  dequantize_columns(w, first, end, k, stride, panel.data());
  const int64_t columns = end - first;
  int64_t row = 0;
  for (; row + 4 <= count; row += 4)
    panel_rows<4>(a + row * k, k, panel.data(), stride, columns, out + row * n + first, n);
  for (; row + 2 <= count; row += 2)
    panel_rows<2>(a + row * k, k, panel.data(), stride, columns, out + row * n + first, n);
  if (row < count)
    panel_rows<1>(a + row * k, k, panel.data(), stride, columns, out + row * n + first, n);
}

void columns(const Rows& rows, int64_t count, const Weights& w, int64_t first_column,
             int64_t end_column, float* out, int64_t n) {
  int64_t row = 0;
  for (; row + 4 <= count; row += 4)
    rows_by_columns<4>(rows, row, w, first_column, end_column, out + row * n, n);
  for (; row + 2 <= count; row += 2)
    rows_by_columns<2>(rows, row, w, first_column, end_column, out + row * n, n);
  if (row < count) rows_by_columns<1>(rows, row, w, first_column, end_column, out + row * n, n);
}

}  // namespace

OrtStatus* MatMul8Bits::init(const OrtKernelInfo* info) {
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "K", &k));
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "N", &n));
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "block_size", &block_size));
  if (OrtStatus* s = int_attribute(info, "batch_invariant", &batch_invariant))
    api().ReleaseStatus(s);  // (optional: 1)
  if (k <= 0 || n <= 0 || block_size % kStep != 0 || block_size > kMaxBlock)
    return invalid("MatMul8Bits: expected K > 0, N > 0 and a block_size that is a multiple of " +
                   std::to_string(kStep) + " up to " + std::to_string(kMaxBlock) +
                   ", got K=" + std::to_string(k) +
                   ", N=" + std::to_string(n) + ", block_size=" + std::to_string(block_size));
  return nullptr;
}

OrtStatus* MatMul8Bits::compute(OrtKernelContext* context) const {
  Tensor a, b, scales, zero_points;
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 0, &a));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 1, &b));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 2, &scales));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 3, &zero_points));
  const int64_t blocks = (k + block_size - 1) / block_size;
  if (a.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || a.dims.empty() || a.dims.back() != k)
    return invalid("MatMul8Bits: a: expected float32 [..., " + std::to_string(k) + "], got " +
                   type_name(a.type) + " " + a.shape());
  if (b.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 || b.numel() != n * blocks * block_size)
    return invalid("MatMul8Bits: b: expected uint8 [" + std::to_string(n) + ", " +
                   std::to_string(blocks) + ", " + std::to_string(block_size) + "], got " +
                   type_name(b.type) + " " + b.shape());
  if (scales.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || scales.numel() != n * blocks)
    return invalid("MatMul8Bits: scales: expected float32 [" + std::to_string(n * blocks) +
                   "], got " + type_name(scales.type) + " " + scales.shape());
  const bool float_zero_points = zero_points.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  if (!(float_zero_points || zero_points.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8) ||
      !(zero_points.numel() == n * blocks || (!float_zero_points && zero_points.numel() == 1)))
    return invalid("MatMul8Bits: zero_points: expected uint8 [1] or uint8 or float32 [" +
                   std::to_string(n * blocks) + "], got " + type_name(zero_points.type) + " " +
                   zero_points.shape());
  std::vector<int64_t> out_dims = a.dims;
  out_dims.back() = n;
  Tensor out;
  ATTNEXPORT_RETURN_IF_ERROR(make_output(context, 0, out_dims, &out));
  const int64_t rows = a.numel() / k;
  if (rows == 0) return nullptr;

  const bool one_zero = zero_points.numel() == 1;
  const Weights weights{static_cast<const uint8_t*>(b.data),
                        static_cast<const float*>(scales.data),
                        float_zero_points ? static_cast<const float*>(zero_points.data) : nullptr,
                        float_zero_points ? nullptr : static_cast<const uint8_t*>(zero_points.data),
                        one_zero ? 0 : 1,
                        blocks,
                        block_size};
  const auto* x = static_cast<const float*>(a.data);
  auto* y = static_cast<float*>(out.data);
  if (!batch_invariant && rows >= kPanelRows) {
    // Items of kPanelRowBlock rows by kPanelColumns columns, a row block's items adjacent.
    const int64_t column_items = (n + kPanelColumns - 1) / kPanelColumns;
    const int64_t row_blocks = (rows + kPanelRowBlock - 1) / kPanelRowBlock;
    auto panel_item = [&](size_t i) {
      const int64_t row = static_cast<int64_t>(i) / column_items * kPanelRowBlock;
      const int64_t first = static_cast<int64_t>(i) % column_items * kPanelColumns;
      panel_columns(x + row * k, std::min(kPanelRowBlock, rows - row), k, weights, first,
                    std::min(first + kPanelColumns, n), y + row * n, n);
    };
    return parallel_for(context, static_cast<size_t>(row_blocks * column_items), panel_item);
  }

  Rows rounded;
  rounded.q.resize(static_cast<size_t>(rows * blocks * block_size));
  rounded.scale.resize(static_cast<size_t>(rows * blocks));
  rounded.scaled_sum.resize(static_cast<size_t>(rows * blocks));
  ATTNEXPORT_RETURN_IF_ERROR(for_row_ranges(context, rows, k, [&](int64_t first, int64_t end) {
    round_rows(x, first, end, k, blocks, block_size, rounded);
  }));
  // Work items of 16 columns (every row): a decoded token's [576 x 960] projection is 60 items.
  constexpr int64_t kColumnsPerItem = 16;
  const int64_t items = (n + kColumnsPerItem - 1) / kColumnsPerItem;
  auto item = [&](size_t i) {
    const int64_t first = static_cast<int64_t>(i) * kColumnsPerItem;
    columns(rounded, rows, weights, first, std::min(first + kColumnsPerItem, n), y, n);
  };
  return parallel_for(context, static_cast<size_t>(items), item);
}

}  // namespace attnexport
