// attnexport.MatMul8Bits and MatMul4Bits for onnxruntime's CPU execution provider: 8-bit (or
// 4-bit, widened from their nibbles in registers) weights times activations kept at 16 bits.
//
// Written here because no library offers it on the CPU: onnxruntime's MatMulNBits either rounds
// the activations to int8 per block (accuracy_level 4: what costs the 8-bit export its agreement
// with the float model) or dequantizes the whole weight to float32 on every call (level 1:
// ~14x slower at decode). Here each row of `a` is rounded once per call to int16 per block of
// K (its scale the block's largest magnitude / 32767: a rounding 256 times finer than int8's,
// below float32's own error on these sums), and each block of a column is an integer dot
// product (vpmaddwd: 16 products per instruction, 32 in the AVX-512 build; the weights widened
// from bytes in registers),
// scaled into float32 accumulators:
//
//   y[r, n] = sum_b  s_w[n, b] * s_a[r, b] * sum_k qa[r, k] * qw[n, k]
//                  - zero[n, b] * s_w[n, b] * s_a[r, b] * sum_k qa[r, k]       (k in block b)
//
// Float32 multiply-adds of dequantized weights measured 1.8x slower at one row (a
// conversion and a multiply-add per weight besides the product).
//
// Each output is computed from its row's own rounding in one fixed sequence whatever the call's
// row count or tile: a row's numbers do not depend on its batch (batch invariance, tested bit
// for bit). Both builds sum each block's products exactly in int32 per column and scale them
// in vectors of columns, from a copy of the weights with 16 columns side by side
// (interleaved_rows; the AVX2 build reads a tile as two halves of 8 columns and makes the copy
// per call where the graph computes the weights). The AVX-512 build, where the graph computes
// them, takes two other ways to the same integers, hence the same bits: transposed_rows from 4
// rows, few_rows below; it takes AVX512_VNNI's vpdpwssd where the CPU has it, the same integers
// again. 8-bit blocks over 256, whose sums do not fit an int32 lane, accumulate a column's 8
// lanes in float32 block by block (columns) or, without batch invariance, multiply float32
// panels. A node with int8_from_rows rounds calls of that many rows (a prefill's) to int8
// steps (/ 127) instead; with the tiles on AVX512_VNNI those take vpdpbusd, 4 byte products a
// lane (tile_rows_s8), elsewhere the paths above, on the same integers.

#include "matmul_8bits.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "kernel_api.h"
#include "rotary_embedding.h"
#include "vector_math.h"

namespace attnexport {
namespace {

// A block's int32 lane sums stay exact up to 1024 weights where a lane sums a column's block in
// 16 (64 pairs of 32767 * 255); wide_integer_path's single lanes say how far theirs do.
constexpr int64_t kMaxBlock = 1024;

// The AVX2 build's integer path (and the AVX-512 build's for blocks of 16): 256-bit integer and
// float vectors, lanes per column (a block of 16 weights is one step; MatMulNBits' smallest block).
constexpr int64_t kStep = 16;

// Bytes of a column's first k weights (k even, as every block is).
template <int kBits>
constexpr int64_t weight_bytes(int64_t k) {
  return k * kBits / 8;
}

// 4-bit weights come two to a byte, weight 2j in byte j's low nibble and 2j + 1 in its high one
// (MatMulNBits' packing): with byte j zero-extended to 32-bit lane j, (x | x << 12) & 0x000F000F
// puts the low nibble in the lane's low int16 and the high nibble in its high one, so the lanes
// hold the weights as int16 in order.
#if defined(__AVX2__)
inline __m256i nibbles_to_int16(__m256i bytes_as_lanes) {
  return _mm256_and_si256(_mm256_or_si256(bytes_as_lanes, _mm256_slli_epi32(bytes_as_lanes, 12)),
                          _mm256_set1_epi32(0x000F000F));
}
#endif

// Weights [i, i + 16) of a column widened to int16 (`column`: its first byte).
template <int kBits>
inline __m256i load_weights(const uint8_t* column, int64_t i) {
  if constexpr (kBits == 4)
    return nibbles_to_int16(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(column + i / 2))));
  else
    return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(column + i)));
}

// fn(std::integral_constant<int, 4>) for 4-bit weights, else fn(std::integral_constant<int,
// 8>): a node's width as the kernels' template argument.
template <typename Fn>
inline auto with_bits(int64_t bits, Fn fn) {
  return bits == 4 ? fn(std::integral_constant<int, 4>{}) : fn(std::integral_constant<int, 8>{});
}

// Weight i of a column, for the scalar tails.
template <int kBits>
inline int weight_at(const uint8_t* column, int64_t i) {
  if constexpr (kBits == 4) return (column[i / 2] >> (4 * (i % 2))) & 0x0F;
  else return column[i];
}

inline f32x8 to_floats(__m256i v) { return __builtin_convertvector(reinterpret_cast<i32x8>(v), f32x8); }

// A call's rows of `a`, rounded: int16 values (zero past K), the scale of each row's block and
// the scaled sum of its rounded values (for the zero points' term), in groups of `group` rows:
// a group's pairs of values [padded / 2][group] and its block parameters [blocks][group]. The
// tiles' paths, which broadcast a pair at a time, take groups of kRowGroup, so that a pass over
// a group's rows reads them all from one pointer at fixed offsets (with a pointer a row, 8 rows'
// pointers and their increments did not fit the registers: the AVX-512 tiles ran 1.08-1.13x
// slower at 8-128 rows of [576 x 3072]); the paths that read a row's values as vectors, and
// one-row calls, take groups of 1, which is the row-major layout ([rows, padded], [rows, blocks]).
constexpr int64_t kRowGroup = 8;

struct Rows {
  std::vector<int16_t> q;
  std::vector<float> scale, scaled_sum;
  int64_t group = 1, padded = 0, blocks = 0;
  // The steps a block's largest magnitude is rounded to: 32767 (int16), or 127 where the node
  // asks for int8 activations in calls of many rows (int8_from_rows).
  float levels = 32767.0f;
  // With int8 steps on AVX512_VNNI (the tiles' path, groups of kRowGroup): the values as int8,
  // a group's quads of values [padded / 4][kRowGroup] (4 bytes each) in q8, for vpdpbusd; q
  // is then unused.
  std::vector<int8_t> q8;
  bool quads = false;

  void shape(int64_t rows, int64_t block_count, int64_t block_size, int64_t group_rows,
             float steps = 32767.0f, bool int8_quads = false) {
    group = group_rows, padded = block_count * block_size, blocks = block_count;
    levels = steps, quads = int8_quads;
    const int64_t stored = (rows + group - 1) / group * group;
    if (quads) q8.resize(static_cast<size_t>(stored * padded));
    else q.resize(static_cast<size_t>(stored * padded));
    scale.resize(static_cast<size_t>(stored * blocks));
    scaled_sum.resize(static_cast<size_t>(stored * blocks));
  }
  // Where the pair of values 0, 1 of `row` is in q (its next pairs 2 * group values on).
  int64_t pair_at(int64_t row) const { return row / group * group * padded + row % group * 2; }
  // Where the quad of values 0 .. 3 of `row` is in q8 (its next quads 4 * group bytes on).
  int64_t quad_at(int64_t row) const { return row / group * group * padded + row % group * 4; }
  // Where block b of `row` is in scale and scaled_sum.
  int64_t block_at(int64_t row, int64_t b) const {
    return (row / group * blocks + b) * group + row % group;
  }
};

#if defined(__AVX512F__)
// The sum of v's lanes (exact: no int32 overflow in the callers' sums).
inline int32_t lane_total(i32x16 v) {
  typedef int32_t i32x4 __attribute__((vector_size(16)));
  const i32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const i32x4 b =
      __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[1]) + (b[2] + b[3]);
}
#endif

// A row x ([k] float32) rounded in blocks of block_size to `levels` steps a side of zero (32767
// or 127): its values into q ([blocks * block_size], zero past k; int16, or int8 for 127 steps),
// block b's scale and scaled sum into scale[b * stride] and scaled_sum[b * stride].
template <typename Q>
void round_row(const float* x, int64_t k, int64_t blocks, int64_t block_size, Q* q,
               float* scale_out, float* scaled_sum_out, int64_t stride, float levels) {
  static_assert(std::is_same_v<Q, int16_t> || std::is_same_v<Q, int8_t>, "int16 or int8 steps");
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t start = b * block_size, stop = start + block_size < k ? start + block_size : k;
#if defined(__AVX512F__)
    // A whole block of 16s at once, reduced in registers: the loop below (8 lanes, its sums
    // through memory) took 1.1 cycles a value, ~8% of a prefill's int8 products at SmolLM2's
    // shapes; this pass rounds 1.3-1.7x faster, the same numbers.
    if (stop - start == block_size && block_size % 16 == 0) {
      // (Vector types and maskz forms: g++ 12's plain max/abs/convert intrinsics trip
      // -Werror=maybe-uninitialized.)
      f32x16 largest16{};
      __mmask16 not_finite = 0;
      for (int64_t i = start; i < stop; i += 16) {
        const f32x16 v = load16(x + i);
        const f32x16 magnitude = reinterpret_cast<f32x16>(reinterpret_cast<i32x16>(v) & 0x7FFFFFFF);
        largest16 = reinterpret_cast<f32x16>(_mm512_maskz_max_ps(
            0xFFFF, reinterpret_cast<__m512>(largest16), reinterpret_cast<__m512>(magnitude)));
        not_finite |= _mm512_fpclass_ps_mask(reinterpret_cast<__m512>(v), 0x99);  // NaN, infinity
      }
      if (not_finite != 0) {  // its values 0 and its scale NaN, as below
        std::fill(q + start, q + stop, Q{0});
        scale_out[b * stride] = scaled_sum_out[b * stride] = NAN;
        continue;
      }
      const float largest = horizontal_max(largest16);
      const float scale = largest / levels;
      const f32x16 inverse = splat16(largest > 0.0f ? levels / largest : 0.0f);
      i32x16 sum16{};
      for (int64_t i = start; i < stop; i += 16) {
        const __m512i rounded =
            _mm512_maskz_cvtps_epi32(0xFFFF, reinterpret_cast<__m512>(load16(x + i) * inverse));
        sum16 += reinterpret_cast<i32x16>(rounded);
        if constexpr (std::is_same_v<Q, int16_t>)  // (|values| <= levels: exact)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i),
                              _mm512_maskz_cvtepi32_epi16(0xFFFF, rounded));
        else
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i),
                           _mm512_maskz_cvtepi32_epi8(0xFFFF, rounded));
      }
      scale_out[b * stride] = scale;
      scaled_sum_out[b * stride] = scale * static_cast<float>(lane_total(sum16));
      continue;
    }
#endif
    // 8 lanes at a time, then the rest one by one (the same numbers: the largest magnitude
    // is exact in any order, and vcvtps2dq rounds as nearbyint does, to nearest even; one
    // value at a time this was a tenth of a 128-row call's time on AVX-512).
    const __m256 sign = _mm256_set1_ps(-0.0f), infinity = _mm256_set1_ps(INFINITY);
    __m256 largest8 = _mm256_setzero_ps(), not_finite8 = _mm256_setzero_ps();
    int64_t i = start;
    for (; i + 8 <= stop; i += 8) {
      const __m256 magnitude = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
      largest8 = _mm256_max_ps(largest8, magnitude);
      not_finite8 = _mm256_or_ps(not_finite8, _mm256_cmp_ps(magnitude, infinity, _CMP_NLT_UQ));
    }
    // (In registers: eight std::fmax calls, libm's, were ~0.5% of a batch-32 decode. A NaN
    // lane leaves `largest` unspecified, and unused: the block is then not finite.)
    float largest = horizontal_max(reinterpret_cast<f32x8>(largest8));
    bool finite = _mm256_movemask_ps(not_finite8) == 0;
    for (; i < stop; ++i) {
      finite = finite && std::isfinite(x[i]);
      largest = std::fmax(largest, std::fabs(x[i]));
    }
    // A NaN or infinity has no int16 step: its block's scale is NaN, so the row's outputs
    // are NaN (as float32 arithmetic would make them), never a silently finite number.
    const float scale = finite ? largest / levels : NAN;
    const float inverse = finite && largest > 0.0f ? levels / largest : 0.0f;
    int32_t sum = 0;
    i = start;
    if (finite) {
      const __m256 inverse8 = _mm256_set1_ps(inverse);
      __m256i sum8 = _mm256_setzero_si256();
      for (; i + 8 <= stop; i += 8) {
        const __m256i rounded = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), inverse8));
        sum8 = _mm256_add_epi32(sum8, rounded);
        const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(rounded),
                                              _mm256_extracti128_si256(rounded, 1));
        if constexpr (std::is_same_v<Q, int16_t>)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), words);
        else  // (|values| <= 127: exact)
          _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(words, words));
      }
      alignas(32) int32_t sums[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums), sum8);
      for (int32_t lane : sums) sum += lane;
    }
    for (; i < stop; ++i) {
      const Q value = finite ? static_cast<Q>(std::nearbyint(x[i] * inverse)) : 0;
      q[i] = value;
      sum += value;
    }
    for (; i < start + block_size; ++i) q[i] = 0;  // (i == stop)
    scale_out[b * stride] = scale;
    scaled_sum_out[b * stride] = scale * static_cast<float>(sum);
  }
}

// kRowGroup rows of `words` int32 words each ([kRowGroup][words], row-major: a row's int16 pairs
// or int8 quads) as Rows' grouped layout ([words][kRowGroup]) at `out`: 8 words of the 8 rows at
// a time, an 8 x 8 transpose (a pair's stores one by one made rounding 1.8x slower).
inline void group_words(const int32_t* staged, int64_t words, int32_t* out) {
  static_assert(kRowGroup == 8, "an 8 x 8 transpose");
  for (int64_t p = 0; p < words; p += 8) {  // (a multiple of 8: kStep; quads: blocks of 32)
    __m256i v[8], t[8], u[8];
    for (int r = 0; r < 8; ++r)
      v[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(staged + r * words + p));
    for (int h = 0; h < 8; h += 4) {
      t[h] = _mm256_unpacklo_epi32(v[h], v[h + 1]);
      t[h + 1] = _mm256_unpackhi_epi32(v[h], v[h + 1]);
      t[h + 2] = _mm256_unpacklo_epi32(v[h + 2], v[h + 3]);
      t[h + 3] = _mm256_unpackhi_epi32(v[h + 2], v[h + 3]);
      u[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);          // words 0, 4 of rows h .. h + 3
      u[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]);      // 1, 5
      u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);  // 2, 6
      u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);  // 3, 7
    }
    for (int j = 0; j < 4; ++j) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (p + j) * kRowGroup),
                          _mm256_permute2x128_si256(u[j], u[4 + j], 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (p + 4 + j) * kRowGroup),
                          _mm256_permute2x128_si256(u[j], u[4 + j], 0x31));
    }
  }
}

// Rows [first, end) of `a` ([rows, k] float32) into `rows` (shaped for them; grouped, `first` a
// multiple of the group: a group's words are written whole).
void round_rows(const float* a, int64_t first, int64_t end, int64_t k, Rows& rows) {
  const int64_t padded = rows.padded, blocks = rows.blocks, block_size = padded / blocks;
  if (rows.group == 1) {
    for (int64_t r = first; r < end; ++r)
      round_row(a + r * k, k, blocks, block_size, rows.q.data() + r * padded,
                rows.scale.data() + r * blocks, rows.scaled_sum.data() + r * blocks, 1,
                rows.levels);
    return;
  }
  // A group's rows rounded row-major, then put in the grouped layout (int16 pairs or int8 quads
  // as int32 words). (Rows past `end` in a group: never read.)
  const auto group_rows = [&](auto* staged, int64_t words, int32_t* out, int64_t group) {
    for (int64_t r = group; r < std::min(group + kRowGroup, end); ++r)
      round_row(a + r * k, k, blocks, block_size, staged + (r - group) * padded,
                rows.scale.data() + rows.block_at(r, 0), rows.scaled_sum.data() + rows.block_at(r, 0),
                kRowGroup, rows.levels);
    group_words(reinterpret_cast<const int32_t*>(staged), words, out);
  };
  thread_local std::vector<int16_t> staged;
  thread_local std::vector<int8_t> staged_bytes;
  for (int64_t group = first; group < end; group += kRowGroup) {
    if (rows.quads) {
      staged_bytes.resize(static_cast<size_t>(kRowGroup * padded));
      group_rows(staged_bytes.data(), padded / 4,
                 reinterpret_cast<int32_t*>(rows.q8.data() + rows.quad_at(group)), group);
    } else {
      staged.resize(static_cast<size_t>(kRowGroup * padded));
      group_rows(staged.data(), padded / 2,
                 reinterpret_cast<int32_t*>(rows.q.data() + rows.pair_at(group)), group);
    }
  }
}

struct Weights {
  const uint8_t* q;             // [n, blocks * block_size]
  const float* scales;          // [n * blocks]
  const float* float_zeros;     // [n * blocks], or nullptr: zero points in zero_bytes
  const uint8_t* zero_bytes;    // [n * blocks], or [1] when zero_stride is 0
  int64_t zero_stride, blocks, block_size;
  int64_t n;  // columns
  // The fused nodes' work items take tile pairs, `column` and `column + pair.stride` within each
  // `pair.period` columns (MatMul8BitsSiluAndMul: N / 2 of N; MatMul8BitsQKVRotary: half a head
  // of a head), which their kernel-made copies (tiles, lanes) hold side by side (tile_slot).
  TilePairs pair = {};
  const float* lanes = nullptr;  // MatMul8Bits::lane_parameters, or nullptr
  // MatMul8Bits::tiles (or the AVX2 build's copy for one call), or nullptr; where set, so is
  // lanes or half_lanes.
  const uint8_t* tiles = nullptr;
  const uint16_t* half_lanes = nullptr;  // MatMul8Bits::half_lanes, or nullptr

  float zero(int64_t index) const {
    return float_zeros != nullptr ? float_zeros[index]
                                  : static_cast<float>(zero_bytes[index * zero_stride]);
  }
};

// The position among the kernel-made copies' tiles (MatMul8Bits::tiles, lane_parameters,
// half_lanes: 16 columns each) of the tile holding `column`: column / 16, or with tile pairs
// the j-th pair of each period at 2j and 2j + 1, so that a fused work item's two tiles are
// adjacent and a thread's items read one stream, as the unfused node's do (apart, a one-token
// decode of SmolLM2 int4 ran at 0.96x the unfused nodes').
inline int64_t tile_slot(int64_t column, const TilePairs& pair) {
  constexpr int64_t kColumns = 16;
  if (pair.stride == 0) return column / kColumns;
  const int64_t within = column % pair.period, second = within >= pair.stride ? 1 : 0;
  return column / pair.period * (pair.period / kColumns) +
         2 * ((within - second * pair.stride) / kColumns) + second;
}
inline int64_t tile_slot(const Weights& w, int64_t column) { return tile_slot(column, w.pair); }

// Where the paths below write a call's products: element (row, column) of the call's product
// at at(row, column). The node's output ([rows, N]: stride N, from row 0 and column 0), or a
// work item's scratch (from its first row and column): MatMul8BitsSiluAndMul keeps an item's
// gate and up columns there and writes only silu(gate) * up to the node's output.
struct Output {
  float* data;
  int64_t stride, first_row = 0, first_column = 0;
  float* at(int64_t row, int64_t column) const {
    return data + (row - first_row) * stride + (column - first_column);
  }
};

// out[r][c] (r < R, c < C) = row first_row + r of `a` . column `column` + c of W.
template <int kBits, int R, int C>
inline void dot_tile(const Rows& rows, int64_t first_row, const Weights& w, int64_t column,
                     float* out, int64_t ldo) {
  const int64_t padded = w.blocks * w.block_size, column_bytes = weight_bytes<kBits>(padded);
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
  const uint8_t* q = w.q + column * column_bytes;
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m256i dots[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) dots[r][c] = _mm256_setzero_si256();
    const int64_t start = b * w.block_size;
    // The next tile's columns, one block ahead of their use: each column is a stream of K
    // bytes, too short for the hardware prefetcher to follow (SmolLM2 int8 decode at batch 1:
    // 37 -> 57 tokens/s).
    for (int c = 0; c < C; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(q + (C + c) * column_bytes +
                                                 weight_bytes<kBits>(start)),
                   _MM_HINT_T0);
    for (int64_t i = start; i < start + w.block_size; i += kStep) {
      __m256i weight[C];
      for (int c = 0; c < C; ++c) weight[c] = load_weights<kBits>(q + c * column_bytes, i);
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
    for (int c = 0; c < C; ++c) out[r * ldo + c] = horizontal_sum(acc[r][c]) + zero_terms[r][c];
}

// Rows four (then two) at a time by 2 columns, one row by 4: the integer accumulators stay in
// the 16 vector registers (the float ones, touched once a block, may not). Four rows share each
// widened weight vector: 1.13x two rows' tiles at 8 to 128 rows; six rows spill (1.0x).
template <int kBits, int R>
void rows_by_columns(const Rows& rows, int64_t first_row, const Weights& w, int64_t first_column,
                     int64_t end_column, const Output& out) {
  constexpr int kColumnTile = R == 1 ? 4 : 2;
  int64_t column = first_column;
  for (; column + kColumnTile <= end_column; column += kColumnTile)
    dot_tile<kBits, R, kColumnTile>(rows, first_row, w, column, out.at(first_row, column),
                                    out.stride);
  for (; column < end_column; ++column)
    dot_tile<kBits, R, 1>(rows, first_row, w, column, out.at(first_row, column), out.stride);
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
template <int kBits>
void dequantize_columns(const Weights& w, int64_t first, int64_t end, int64_t k, int64_t stride,
                        float* panel) {
  const int64_t column_bytes = weight_bytes<kBits>(w.blocks * w.block_size);
  for (int64_t column = first; column < end; ++column) {
    float* out = panel + (column - first) * stride;
    const uint8_t* q = w.q + column * column_bytes;
    for (int64_t b = 0; b < w.blocks; ++b) {
      const int64_t index = column * w.blocks + b;
      const float scale = w.scales[index], zero = w.zero(index);
      const int64_t start = b * w.block_size, stop = std::min(start + w.block_size, k);
      int64_t i = start;
      if constexpr (kBits == 8)
        for (; i + 8 <= stop; i += 8)
          *reinterpret_cast<f32x8_unaligned*>(out + i) = (load8_float(q + i) - zero) * scale;
      for (; i < stop; ++i) out[i] = (static_cast<float>(weight_at<kBits>(q, i)) - zero) * scale;
    }
    for (int64_t i = k; i < stride; ++i) out[i] = 0.0f;
  }
}

// out[r][c] (r < R, c < C) = row first_row + r of `a` . panel column c: 8 lanes in K order, then
// horizontal_sum and the scalar tail, the same order for every R and C.
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
      float sum = horizontal_sum(acc[r][c]);
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

// Rows [first_row, first_row + count) of columns [first, end) (`a`: row first_row of the
// activations).
template <int kBits>
void panel_columns(const float* a, int64_t first_row, int64_t count, int64_t k, const Weights& w,
                   int64_t first, int64_t end, const Output& out) {
  const int64_t stride = (k + 7) / 8 * 8;
  thread_local std::vector<float> panel;
  panel.resize(static_cast<size_t>((end - first) * stride));
  dequantize_columns<kBits>(w, first, end, k, stride, panel.data());
  const int64_t columns = end - first;
  int64_t row = 0;
  for (; row + 4 <= count; row += 4)
    panel_rows<4>(a + row * k, k, panel.data(), stride, columns, out.at(first_row + row, first),
                  out.stride);
  for (; row + 2 <= count; row += 2)
    panel_rows<2>(a + row * k, k, panel.data(), stride, columns, out.at(first_row + row, first),
                  out.stride);
  if (row < count)
    panel_rows<1>(a + row * k, k, panel.data(), stride, columns, out.at(first_row + row, first),
                  out.stride);
}

template <int kBits>
void columns(const Rows& rows, int64_t first_row, int64_t end_row, const Weights& w,
             int64_t first_column, int64_t end_column, const Output& out) {
  int64_t row = first_row;
  for (; row + 4 <= end_row; row += 4)
    rows_by_columns<kBits, 4>(rows, row, w, first_column, end_column, out);
  for (; row + 2 <= end_row; row += 2)
    rows_by_columns<kBits, 2>(rows, row, w, first_column, end_column, out);
  if (row < end_row)
    rows_by_columns<kBits, 1>(rows, row, w, first_column, end_column, out);
}

#if defined(__AVX2__)
// The interleaved tiles (both builds; AVX2 reads a tile as two halves of 8 columns).
constexpr int64_t kLaneColumns = 16;

// The index of the first element of `storage` at a 64-byte boundary (std::vector aligns to 16
// bytes at most; vectors that straddle cache lines touch one line more each).
template <typename T>
inline size_t line_start(const T* storage) {
  return (64 - reinterpret_cast<uintptr_t>(storage) % 64) % 64 / sizeof(T);
}

// The interleaved path: weights of 16 columns side by side (MatMul8Bits::tiles, copied from
// MatMulNBits' layout at kernel creation), so that a row's pair of activations, broadcast,
// multiplies 16 columns' pairs in one instruction straight from the copy: no transposition per
// call (transposed_rows) and no cross-lane sum per block and column (few_rows, whose one-row
// [576 x 3072] call was compute-bound at 80 us in L1). A tile is 16 columns (zero past N) of
// the whole padded K, groups of 4 weights of each column in turn:
//   8-bit, 64 bytes a group: byte 32h + 2c + j = weight 4g + 2h + j of column c;
//   4-bit, 32 bytes a group: byte 2c + j = weight 4g + j of column c in its low nibble,
//          weight 4g + 2 + j in its high one,
// so a group widens to two vectors of int16 pairs (vpmovzxbw; at 4 bits a mask and a shift).
// The block sums are the same exact integers as the other two ways', hence the same bits.
constexpr int64_t kGroupWeights = 4;
// How far ahead of its use the tile stream is asked for: a tile starts a new stream every 9 KB
// (K = 576, 8 bits), which the hardware prefetcher (it stops at 4 KB pages) did not follow;
// SmolLM2's [576 x 3072] shape, 20 nodes a call, 2 threads: 1024 bytes ahead 35.5 / 77.2 /
// 289 us at 1 / 8 / 32 rows, 8192 bytes 29.4 / 70.3 / 279 (none: 36.4 / 89.5 / 343).
constexpr int64_t kTilePrefetchBytes = 8192;

template <int kBits>
constexpr int64_t group_bytes() {
  return kLaneColumns * kGroupWeights * kBits / 8;
}

// The tiles of MatMulNBits-layout weights `q` ([n, padded_k * kBits / 8]), from the returned
// vector's line_start on, each at its tile_slot.
template <int kBits>
std::vector<uint8_t> interleave(const uint8_t* q, int64_t n, int64_t padded_k,
                                const TilePairs& pair) {
  const int64_t tiles = (n + kLaneColumns - 1) / kLaneColumns, groups = padded_k / kGroupWeights;
  const int64_t column_bytes = weight_bytes<kBits>(padded_k);
  std::vector<uint8_t> storage(static_cast<size_t>(tiles * groups * group_bytes<kBits>() + 64));
  uint8_t* const start = storage.data() + line_start(storage.data());
  for (int64_t t = 0; t < tiles; ++t) {
    uint8_t* out = start + tile_slot(t * kLaneColumns, pair) * groups * group_bytes<kBits>();
    for (int64_t g = 0; g < groups; ++g, out += group_bytes<kBits>())
      for (int64_t c = 0; c < kLaneColumns && t * kLaneColumns + c < n; ++c)
        for (int64_t j = 0; j < 2; ++j) {
          const int64_t column = t * kLaneColumns + c, k = g * kGroupWeights + j;
          const int low = weight_at<kBits>(q + column * column_bytes, k);
          const int high = weight_at<kBits>(q + column * column_bytes, k + 2);
          if constexpr (kBits == 8) {
            out[2 * c + j] = static_cast<uint8_t>(low);
            out[32 + 2 * c + j] = static_cast<uint8_t>(high);
          } else {
            out[2 * c + j] = static_cast<uint8_t>(low | high << 4);
          }
        }
  }
  return storage;
}

// Floats a block of a work item takes in MatMul8Bits::lane_parameters: its 16 scales, and their
// offsets (-zero * scale) unless one zero point serves every block.
inline int64_t lane_parameters_per_block(const Weights& w) {
  return w.zero_stride == 0 ? kLaneColumns : 2 * kLaneColumns;
}

// [items][blocks][scales, offsets][16 lanes] (no offsets for one zero point; zero past N), from
// line_start on: every work item's LaneParameters, for kernel creation.
std::vector<float> pack_lane_parameters(const Weights& w, int64_t n) {
  const int64_t items = (n + kLaneColumns - 1) / kLaneColumns, per_block = lane_parameters_per_block(w);
  std::vector<float> storage(static_cast<size_t>(items * w.blocks * per_block + kLaneColumns), 0.0f);
  float* packed = storage.data() + line_start(storage.data());
  for (int64_t column = 0; column < n; ++column)
    for (int64_t b = 0; b < w.blocks; ++b) {
      float* block = packed + (tile_slot(w, column) * w.blocks + b) * per_block;
      const int64_t index = column * w.blocks + b, lane = column % kLaneColumns;
      block[lane] = w.scales[index];
      if (per_block > kLaneColumns) block[kLaneColumns + lane] = -w.zero(index) * w.scales[index];
    }
  return storage;
}

// The lanes' copy of the block parameters (pack_lane_parameters' layout: scales, then the
// zero points where there is one a block, not their offsets) in float16, when every scale and
// zero point is a float16 value (the lowering stores them so: docs/quantization.md), else
// empty: half the bytes a decoded token reads of them (a third of a 4-bit export's at block 32).
std::vector<uint16_t> pack_half_lanes(const Weights& w, int64_t n) {
  const int64_t items = (n + kLaneColumns - 1) / kLaneColumns;
  const int64_t per_block = lane_parameters_per_block(w);
  std::vector<uint16_t> halves(static_cast<size_t>(items * w.blocks * per_block), 0);
  const auto half = [](float x, uint16_t* out) {
    *out = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
    return _cvtsh_ss(*out) == x || (std::isnan(x) && std::isnan(_cvtsh_ss(*out)));
  };
  for (int64_t column = 0; column < n; ++column)
    for (int64_t b = 0; b < w.blocks; ++b) {
      uint16_t* block = halves.data() + (tile_slot(w, column) * w.blocks + b) * per_block;
      const int64_t index = column * w.blocks + b, lane = column % kLaneColumns;
      if (!half(w.scales[index], block + lane)) return {};
      if (per_block > kLaneColumns && !half(w.zero(index), block + kLaneColumns + lane)) return {};
    }
  return halves;
}

// Where a tile's block parameters are: its stretch of the lanes' copy, in float16 (halves) or
// else float32 (floats), per_block values a block.
struct TileParameters {
  int64_t per_block;
  const float* floats;
  const uint16_t* halves;

  TileParameters(const Weights& w, int64_t tile_index) : per_block(lane_parameters_per_block(w)) {
    const int64_t start = tile_index * w.blocks * per_block;
    floats = w.lanes == nullptr ? nullptr : w.lanes + start;
    halves = w.half_lanes == nullptr ? nullptr : w.half_lanes + start;
  }
};

// fn(row, std::integral_constant<int, R>{}) for passes of R rows over [row, end_row): R = kMost
// while kMost rows are left, then kMost / 2, ..., 1 once each where they fit.
template <int kMost, typename Fn>
inline void row_passes(int64_t row, int64_t end_row, Fn fn, bool repeat = true) {
  do {
    if (end_row - row < kMost) break;
    fn(row, std::integral_constant<int, kMost>{});
    row += kMost;
  } while (repeat);
  if constexpr (kMost > 1) row_passes<kMost / 2>(row, end_row, fn, false);
}

// a[r]: row first_row + r of rounded activations in the row-major layout (groups of 1).
template <int R>
inline void row_starts(const Rows& rows, int64_t first_row, int64_t padded,
                       const int16_t* (&a)[R]) {
  for (int r = 0; r < R; ++r) a[r] = rows.q.data() + (first_row + r) * padded;
}

#endif

#if defined(__AVX512BW__)
// The AVX-512 build's integer path for blocks that are a multiple of 32: a vector's 16 lanes are
// 16 columns. Each step transposes 32 weights of 16 columns so that vector p holds every
// column's pair of weights k + 2p, k + 2p + 1 (as int16), and a row's pair of activations,
// broadcast, multiplies all 16 columns in one vpmaddwd: a block's dot products come out summed
// per column, and the per-block epilogue (convert, scale, add) is one vector for 16 columns
// instead of one per column (the lanes-per-column layout above, widened to 512 bits, spent most
// of its time there: SmolLM2's [576 x 1536] projections at 128 rows, 2.3x slower than this).
// The sums are exact, so a row's numbers are the epilogue's on the same integers whichever
// way they were made (batch invariance).
constexpr int64_t kPairStep = 32;  // weights of a column per transposed step: 16 pairs
// Rows per pass over a work item's blocks: their sums (128 bytes a row) and a step's
// activations (64 bytes a row) stay in L1; the transposition is redone per pass.
constexpr int64_t kLaneRowBlock = 64;
// Rows from which a step's weights are transposed (below: a row's dots column by column).
constexpr int64_t kTransposeRows = 4;
// How far ahead of a transposed step each of the item's 16 column streams is asked for.
constexpr int64_t kPrefetchBytes = 128;

// r[p] lane c <- r[c] lane p. (Shuffles of vector types: g++ 12's unpack intrinsics trip
// -Werror=maybe-uninitialized.)
inline void transpose16(i32x16 (&r)[16]) {
  i32x16 t[16];
  for (int i = 0; i < 8; ++i) {  // unpack{lo,hi}_epi32
    t[2 * i] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 0, 16, 1, 17, 4, 20, 5, 21, 8, 24,
                                       9, 25, 12, 28, 13, 29);
    t[2 * i + 1] = __builtin_shufflevector(r[2 * i], r[2 * i + 1], 2, 18, 3, 19, 6, 22, 7, 23, 10,
                                           26, 11, 27, 14, 30, 15, 31);
  }
  for (int i = 0; i < 4; ++i)  // unpack{lo,hi}_epi64
    for (int j = 0; j < 2; ++j) {
      r[4 * i + 2 * j] = __builtin_shufflevector(t[4 * i + j], t[4 * i + j + 2], 0, 1, 16, 17, 4, 5,
                                                 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
      r[4 * i + 2 * j + 1] = __builtin_shufflevector(t[4 * i + j], t[4 * i + j + 2], 2, 3, 18, 19,
                                                     6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    }
  for (int i = 0; i < 2; ++i)  // shuffle_i32x4 0x88, 0xdd
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = __builtin_shufflevector(r[8 * i + j], r[8 * i + 4 + j], 0, 1, 2, 3, 8, 9, 10,
                                             11, 16, 17, 18, 19, 24, 25, 26, 27);
      t[8 * i + 4 + j] = __builtin_shufflevector(r[8 * i + j], r[8 * i + 4 + j], 4, 5, 6, 7, 12, 13,
                                                 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = __builtin_shufflevector(t[j], t[8 + j], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                                   26, 27);
    r[8 + j] = __builtin_shufflevector(t[j], t[8 + j], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23,
                                       28, 29, 30, 31);
  }
}

// The block parameters of columns [first, first + columns) for blocks [b0, b0 + 16) as lanes:
// scales[j] lane c = the scale of column first + c in block b0 + j, offsets[j] = -zero * scale
// (zero past `columns` and past the last block). Loaded 16 blocks of a column at a time and
// transposed: a gather per block (16 scattered loads) took 40% of a one-row call, scalar
// copies a third.
inline void column_parameters(const Weights& w, int64_t first, int columns, int64_t b0,
                              f32x16 (&scales)[kLaneColumns], f32x16 (&offsets)[kLaneColumns]) {
  const int64_t count = std::min(kLaneColumns, w.blocks - b0);
  // Blocks [b0, b0 + count) of a column. (Masked loads of the last blocks measured 10x a plain
  // load here, every column's parameters starting mid-line.)
  const auto blocks_of = [&](const float* column) {
    if (count == kLaneColumns) return reinterpret_cast<i32x16>(load16(column));
    f32x16 v{};
    for (int64_t j = 0; j < count; ++j) v[j] = column[j];
    return reinterpret_cast<i32x16>(v);
  };
  i32x16 s[kLaneColumns], z[kLaneColumns];
  for (int c = 0; c < kLaneColumns; ++c)
    s[c] = c < columns ? blocks_of(w.scales + (first + c) * w.blocks + b0) : i32x16{};
  transpose16(s);
  if (w.float_zeros != nullptr) {
    for (int c = 0; c < kLaneColumns; ++c)
      z[c] = c < columns ? blocks_of(w.float_zeros + (first + c) * w.blocks + b0) : i32x16{};
    transpose16(z);
  } else {
    for (int j = 0; j < kLaneColumns; ++j) {
      f32x16 zero{};
      for (int c = 0; c < columns && j < count; ++c) zero[c] = w.zero((first + c) * w.blocks + b0 + j);
      z[j] = reinterpret_cast<i32x16>(zero);
    }
  }
  for (int j = 0; j < kLaneColumns; ++j) {
    scales[j] = reinterpret_cast<f32x16>(s[j]);
    offsets[j] = -reinterpret_cast<f32x16>(z[j]) * scales[j];
  }
}

// The block parameters of a work item's 16 columns, block by block: from the copy in the lanes'
// layout made at kernel creation (a stream of 128 bytes a block), else transposed here 16
// blocks at a time. The values are the same either way.
struct LaneParameters {
  const Weights& w;
  int64_t first;
  int columns;
  // Filled by at() 16 blocks at a time where there is no copy; left uninitialized (zeroing
  // 2 KB per work item was 3% of a one-row call).
  f32x16 scales[kLaneColumns], offsets[kLaneColumns];

  LaneParameters(const Weights& weights, int64_t first_column, int column_count)
      : w(weights), first(first_column), columns(column_count) {}

  void at(int64_t b, f32x16& scale, f32x16& offset) {
    if (w.lanes != nullptr) {
      const int64_t per_block = lane_parameters_per_block(w);
      const float* p = w.lanes + (tile_slot(w, first) * w.blocks + b) * per_block;
      scale = load16(p);
      offset = per_block == kLaneColumns ? -splat16(w.zero(0)) * scale : load16(p + kLaneColumns);
      return;
    }
    if (b % kLaneColumns == 0) column_parameters(w, first, columns, b, scales, offsets);
    scale = scales[b % kLaneColumns], offset = offsets[b % kLaneColumns];
  }

  // Lanes c0 .. c0 + 3 of at(b).
  void at4(int64_t b, int c0, __m128& scale, __m128& offset) {
    if (w.lanes != nullptr) {
      const int64_t per_block = lane_parameters_per_block(w);
      const float* p = w.lanes + (tile_slot(w, first) * w.blocks + b) * per_block + c0;
      scale = _mm_loadu_ps(p);
      offset = per_block == kLaneColumns ? _mm_mul_ps(_mm_set1_ps(-w.zero(0)), scale)
                                         : _mm_loadu_ps(p + kLaneColumns);
      return;
    }
    f32x16 scale16, offset16;
    at(b, scale16, offset16);
    scale = _mm_loadu_ps(&scale16[c0]);
    offset = _mm_loadu_ps(&offset16[c0]);
  }
};

// Asks for the next work item's block parameters in the lanes' copy (64 or 128 bytes a block,
// read a block at a time after each block's products): one row of the 28 MB logits projection
// 0.63 -> 0.59 ms, [576 x 3072] 0.041 -> 0.038 ms (Zen 5, separate processes alternating).
// Parameters without the copy (computed by the graph) are transposed 16 blocks at a time.
// (The float16 copy instead where the kernel has one: half_lanes.)
inline void prefetch_next_parameters(const Weights& w, int64_t first) {
  if ((w.lanes == nullptr && w.half_lanes == nullptr) || first + kLaneColumns >= w.n) return;
  const int64_t per_item = w.blocks * lane_parameters_per_block(w);
  const int64_t size = w.half_lanes != nullptr ? sizeof(uint16_t) : sizeof(float);
  const int64_t at = (tile_slot(w, first) + 1) * per_item;  // (the item's next tile)
  const char* next = w.half_lanes != nullptr ? reinterpret_cast<const char*>(w.half_lanes + at)
                                             : reinterpret_cast<const char*>(w.lanes + at);
  for (int64_t i = 0; i < per_item * size; i += 64) _mm_prefetch(next + i, _MM_HINT_T0);
}

// Weights [k, k + 32) of a column widened to int16 (`column`: its first byte).
template <int kBits>
inline __m512i load32_weights(const uint8_t* column, int64_t k) {
  if constexpr (kBits == 4) {
    // (the maskz form and vector shifts: g++ 12's plain ones trip -Werror=maybe-uninitialized)
    const i32x16 x = reinterpret_cast<i32x16>(_mm512_maskz_cvtepu8_epi32(
        0xFFFF, _mm_loadu_si128(reinterpret_cast<const __m128i*>(column + k / 2))));
    return reinterpret_cast<__m512i>((x | (x << 12)) & 0x000F000F);
  } else {
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(column + k)));
  }
}

// Whether this CPU has AVX512_VNNI's vpdpwssd (int16 pairs multiplied and added into int32 lanes
// in one instruction, a memory operand broadcast to every lane), and ATTNEXPORT_VNNI is not "0".
// The AVX-512 variant is built for CPUs without it as well, hence the check at run time and the
// instruction written in assembly (its intrinsic needs -mavx512vnni for the whole library). Its
// sums are the same integers as vpmaddwd's and vpaddd's: the same bits either way.
inline bool use_vnni() {
  static const bool use = [] {
    __builtin_cpu_init();
    const char* setting = std::getenv("ATTNEXPORT_VNNI");
    return __builtin_cpu_supports("avx512vnni") &&
           !(setting != nullptr && std::string(setting) == "0");
  }();
  return use;
}

inline __m512i broadcast_pair(const int16_t* a) {
  int32_t pair;
  std::memcpy(&pair, a, sizeof pair);
  return _mm512_set1_epi32(pair);
}

// sum += the pair a[0], a[1] (int16, broadcast) times `weights`' lanes' pairs, in int32 lanes:
// vpdpwssd with the pair broadcast from memory ({1to16}) where kVnni, else vpmaddwd and vpaddd
// (the same integers).
template <bool kVnni>
inline void add_pair_dots(__m512i& sum, __m512i weights, const int16_t* a) {
  if constexpr (kVnni)
    asm("vpdpwssd %2%{1to16%}, %1, %0"
        : "+v"(sum)
        : "v"(weights), "m"(*reinterpret_cast<const int32_t*>(a)));
  else
    sum = _mm512_add_epi32(sum, _mm512_madd_epi16(broadcast_pair(a), weights));
}

// sum over p < 16 of the pair a[2p], a[2p + 1] (int16) times t[p]'s lanes' pairs, in int32 lanes,
// in four chains (one would serialize on vpdpwssd's latency; with it, one [576 x 3072] call:
// 261 -> 237 us at 32 rows, 954 -> 900 us at 128).
template <bool kVnni>
inline __m512i pair_dots(const int16_t* a, const i32x16 (&t)[kLaneColumns]) {
  __m512i chains[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                       _mm512_setzero_si512()};
  for (int p = 0; p < kLaneColumns; ++p)
    add_pair_dots<kVnni>(chains[p % 4], reinterpret_cast<__m512i>(t[p]), a + 2 * p);
  return _mm512_add_epi32(_mm512_add_epi32(chains[0], chains[1]),
                          _mm512_add_epi32(chains[2], chains[3]));
}

// One block's contribution to a row's 16 columns, added to its sums: the block's dot products
// (exact int32) scaled by the columns' and the row's scales, then the zero points' term. The one
// place the ways of computing the dots below meet: a row's numbers are these operations on the
// same integers whichever way, hence the same bits in any batch. (One accumulator for both
// terms: with a second one, 8 rows' accumulators spilled to the stack every block.)
// (Explicit multiply-adds: few_rows does the same on 4 lanes, and its numbers must be these.)
inline void add_block(f32x16& sums, i32x16 dots, f32x16 scales, f32x16 offsets, float row_scale,
                      float scaled_sum) {
  const __m512 products =
      _mm512_fmadd_ps(reinterpret_cast<__m512>(__builtin_convertvector(dots, f32x16)),
                      reinterpret_cast<__m512>(scales * splat16(row_scale)),
                      reinterpret_cast<__m512>(sums));
  sums = reinterpret_cast<f32x16>(_mm512_fmadd_ps(
      reinterpret_cast<__m512>(offsets), reinterpret_cast<__m512>(splat16(scaled_sum)), products));
}

// add_block on 4 lanes (columns c0 .. c0 + 3 of a work item): the same operations lane by lane.
inline void add_block4(__m128& sums, __m128i dots, __m128 scales, __m128 offsets,
                       float row_scale, float scaled_sum) {
  const __m128 products =
      _mm_fmadd_ps(_mm_cvtepi32_ps(dots), _mm_mul_ps(scales, _mm_set1_ps(row_scale)), sums);
  sums = _mm_fmadd_ps(offsets, _mm_set1_ps(scaled_sum), products);
}

inline void store_columns(float* out, int columns, f32x16 sums) {
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << columns) - 1),
                        reinterpret_cast<__m512>(sums));
}

// Rows [first_row, end_row) (kTransposeRows or more) of columns [first, first + columns),
// columns <= 16: each step's weights transposed once (64 shuffles), then a row's 16 columns in
// 16 multiply-adds of its broadcast activation pairs.
template <int kBits, bool kVnni>
void transposed_rows(const Rows& rows, int64_t first_row, int64_t end_row, const Weights& w,
                     int64_t first, int columns, const Output& out) {
  prefetch_next_parameters(w, first);
  const int64_t padded = w.blocks * w.block_size, steps = w.block_size / kPairStep;
  const int64_t column_bytes = weight_bytes<kBits>(padded);
  f32x16 sums[kLaneRowBlock];
  i32x16 dots[kLaneRowBlock];
  const int64_t count = end_row - first_row;
  for (int64_t r = 0; r < count; ++r) sums[r] = f32x16{};
  const uint8_t* q = w.q + first * column_bytes;
  LaneParameters parameters(w, first, columns);
  for (int64_t b = 0; b < w.blocks; ++b) {
    f32x16 scales, offsets;
    parameters.at(b, scales, offsets);
    for (int64_t step = 0; step < steps; ++step) {
      const int64_t k = b * w.block_size + step * kPairStep;
      // Each column is a stream of K bytes, too short for the hardware prefetcher to follow.
      if (weight_bytes<kBits>(k) % 64 == 0)
        for (int c = 0; c < columns; ++c)
          _mm_prefetch(reinterpret_cast<const char*>(q + c * column_bytes + weight_bytes<kBits>(k) +
                                                     kPrefetchBytes),
                       _MM_HINT_T0);
      i32x16 t[kLaneColumns];
      for (int c = 0; c < kLaneColumns; ++c)
        t[c] = columns == kLaneColumns || c < columns
                   ? reinterpret_cast<i32x16>(load32_weights<kBits>(q + c * column_bytes, k))
                   : i32x16{};
      transpose16(t);
      for (int64_t r = 0; r < count; ++r) {
        const int16_t* a = rows.q.data() + (first_row + r) * padded + k;
        const __m512i dot = pair_dots<kVnni>(a, t);
        dots[r] = step > 0 ? dots[r] + reinterpret_cast<i32x16>(dot) : reinterpret_cast<i32x16>(dot);
        if (step + 1 == steps) {
          const int64_t row_block = (first_row + r) * w.blocks + b;
          add_block(sums[r], dots[r], scales, offsets, rows.scale[row_block],
                    rows.scaled_sum[row_block]);
        }
      }
    }
  }
  for (int64_t r = 0; r < count; ++r)
    store_columns(out.at(first_row + r, first), columns, sums[r]);
}

// A group's two vectors of 16 columns' int16 pairs: weights 4g, 4g + 1 and 4g + 2, 4g + 3.
template <int kBits>
inline void load_group(const uint8_t* group, __m512i& first, __m512i& second) {
  if constexpr (kBits == 8) {
    first = _mm512_cvtepu8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(group)));
    second = _mm512_cvtepu8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(group + 32)));
  } else {
    const __m512i bytes =
        _mm512_cvtepu8_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(group)));
    first = _mm512_and_si512(bytes, _mm512_set1_epi16(0x0F));
    second = _mm512_srli_epi16(bytes, 4);
  }
}

// 16 float16 values as float32 lanes (exact).
inline f32x16 load_halves16(const uint16_t* p) {
  return load16_float(reinterpret_cast<const Half*>(p));
}

// Block b's 16 scales and offsets of a tile, from the lanes' copy (read so, not through
// LaneParameters: a call there that may transpose made the compiler spill every accumulator
// around it, per block). From float16, (-zero) * scale, as column_parameters computes the float
// copy's offsets: the same bits.
inline void tile_block_parameters(const TileParameters& tp, const Weights& w, int64_t b,
                                  f32x16& scales, f32x16& offsets) {
  if (tp.halves != nullptr) {
    const uint16_t* block = tp.halves + b * tp.per_block;
    scales = load_halves16(block);
    const f32x16 zeros =
        tp.per_block == kLaneColumns ? splat16(w.zero(0)) : load_halves16(block + kLaneColumns);
    offsets = -zeros * scales;
  } else {
    scales = load16(tp.floats + b * tp.per_block);
    offsets = tp.per_block == kLaneColumns ? -splat16(w.zero(0)) * scales
                                        : load16(tp.floats + b * tp.per_block + kLaneColumns);
  }
}

// Rows [first_row, first_row + R) of Rows in groups of kGroup (R <= kGroup, one group's): pair p
// of row r (values 2p, 2p + 1) at pairs + p * kPairStride + 2 * r, block b's scale and scaled
// sum at scale[b * kGroup + r] and scaled_sum[b * kGroup + r].
// (With Rows::quads, int8 values: quad q of row r at quads[q * kGroup + r], as int32 words.)
template <int64_t kGroup>
struct GroupRows {
  static constexpr int64_t kPairStride = 2 * kGroup;
  const int16_t* pairs;
  const int32_t* quads;
  const float* scale;
  const float* scaled_sum;

  GroupRows(const Rows& rows, int64_t first_row)
      : pairs(rows.quads ? nullptr : rows.q.data() + rows.pair_at(first_row)),
        quads(rows.quads ? reinterpret_cast<const int32_t*>(rows.q8.data() + rows.quad_at(first_row))
                         : nullptr),
        scale(rows.scale.data() + rows.block_at(first_row, 0)),
        scaled_sum(rows.scaled_sum.data() + rows.block_at(first_row, 0)) {}
};

// fn(row, std::integral_constant<int, R>{}, std::integral_constant<int64_t, G>{}): the passes of
// row_passes<kMost> over rows grouped by kRowGroup (G = kRowGroup, kMost <= kRowGroup), or
// the one row of a call's Rows in groups of 1 (G = 1).
template <int kMost, typename Fn>
inline void group_passes(const Rows& rows, int64_t row, int64_t end_row, Fn fn) {
  if (rows.group == 1) {
    for (; row < end_row; ++row)
      fn(row, std::integral_constant<int, 1>{}, std::integral_constant<int64_t, 1>{});
    return;
  }
  row_passes<kMost>(row, end_row, [&](int64_t first, auto count) {
    fn(first, count, std::integral_constant<int64_t, kRowGroup>{});
  });
}

// Rows [first_row, first_row + R) of a tile's columns [first, first + columns): each group
// widened once for the R rows (one group's, rows grouped), each row's sums in kChains chains (8
// at once in all: the instruction's latency is 4 cycles and 2 issue a cycle on Zen 5), added per
// block.
template <int kBits, bool kVnni, int R, int64_t kGroup>
void tile_rows(const Rows& rows, int64_t first_row, const Weights& w, const uint8_t* tile,
               int64_t tile_index, int64_t first, int columns, const Output& out) {
  const TileParameters tp(w, tile_index);
  constexpr int kChains = R >= 8 ? 1 : R >= 4 ? 2 : 4;
  using Group = GroupRows<kGroup>;
  const Group g(rows, first_row);
  const int16_t* x = g.pairs;
  f32x16 totals[R];
  for (int r = 0; r < R; ++r) totals[r] = f32x16{};
  const uint8_t* group = tile;
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m512i sums[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChains; ++c) sums[r][c] = _mm512_setzero_si512();
    // Two groups (4 pairs) a step: pair p into chain p % kChains. (Blocks are multiples of 32.)
    for (int64_t k = b * w.block_size; k < (b + 1) * w.block_size; k += 2 * kGroupWeights) {
      __m512i pairs[4];
      for (int64_t line = 0; line < 2 * group_bytes<kBits>(); line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(group + kTilePrefetchBytes + line), _MM_HINT_T0);
      load_group<kBits>(group, pairs[0], pairs[1]);
      load_group<kBits>(group + group_bytes<kBits>(), pairs[2], pairs[3]);
      group += 2 * group_bytes<kBits>();
      for (int p = 0; p < 4; ++p)
        for (int r = 0; r < R; ++r)
          add_pair_dots<kVnni>(sums[r][p % kChains], pairs[p], x + p * Group::kPairStride + 2 * r);
      x += 4 * Group::kPairStride;
    }
    f32x16 scales, offsets;
    tile_block_parameters(tp, w, b, scales, offsets);
    for (int r = 0; r < R; ++r) {
      __m512i dots = sums[r][0];
      for (int c = 1; c < kChains; ++c) dots = _mm512_add_epi32(dots, sums[r][c]);
      add_block(totals[r], reinterpret_cast<i32x16>(dots), scales, offsets,
                g.scale[b * kGroup + r], g.scaled_sum[b * kGroup + r]);
    }
  }
  for (int r = 0; r < R; ++r)
    store_columns(out.at(first_row + r, first), columns, totals[r]);
}

// Rows [first_row, first_row + R) of a tile's columns from int8 activations (Rows::quads, one
// group's): a group's 16 columns' weights 4g .. 4g + 3 put in vpdpbusd's order, a column's 4
// weights in its lane (8-bit: one vpermw; 4-bit: widened and masked, 3 instructions; for the R
// rows), times a row's broadcast quad of int8 values: 4 products an instruction where
// vpdpwssd makes 2, the same exact block sums and epilogue as tile_rows. (vpdpbusd multiplies
// unsigned bytes, the weights, by signed ones, the activations.) Every loop over the rows is
// unrolled by pragma: where g++ kept one a loop (the stores at the end), the totals it indexes
// lived on the stack, stored every block, and a [576 x 3072] call of 1024 rows ran 1.3-1.5x
// slower (1.03-1.1x at SmolLM2's other shapes).
template <int kBits, int R>
void tile_rows_s8(const Rows& rows, int64_t first_row, const Weights& w, const uint8_t* tile,
                  int64_t tile_index, int64_t first, int columns, const Output& out) {
  const TileParameters tp(w, tile_index);
  const GroupRows<kRowGroup> g(rows, first_row);
  const int32_t* x = g.quads;
  // Word 2c <- word c (weights 4g, 4g + 1 of column c), word 2c + 1 <- word 16 + c (4g + 2, 4g + 3).
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  f32x16 totals[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) totals[r] = f32x16{};
  const uint8_t* group = tile;
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m512i sums[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) sums[r] = _mm512_setzero_si512();
    for (int64_t k = 0; k < w.block_size; k += kGroupWeights) {
      _mm_prefetch(reinterpret_cast<const char*>(group + kTilePrefetchBytes), _MM_HINT_T0);
      __m512i weights;
      if constexpr (kBits == 8) {
        weights = _mm512_permutexvar_epi16(order, _mm512_load_si512(group));
      } else {
        // Column c's 16 bits, nibbles k0, k2, k1, k3 from the low one, widened to its lane d:
        // (d | d << 12) & 0x0F0F0F0F is k0, k1, k2, k3 a byte each (one vpternlogd; the high
        // half of d is zero, and d << 12 puts k2, k3 at bits 16 and 24 with only masked bits
        // elsewhere).
        // (The maskz forms and a vector shift: g++ 12's plain intrinsics trip
        // -Werror=maybe-uninitialized.)
        const __m512i d = _mm512_maskz_cvtepu16_epi32(
            0xFFFF, _mm256_load_si256(reinterpret_cast<const __m256i*>(group)));
        const __m512i shifted = reinterpret_cast<__m512i>(reinterpret_cast<i32x16>(d) << 12);
        weights = _mm512_maskz_ternarylogic_epi32(0xFFFF, d, shifted,
                                                  _mm512_set1_epi32(0x0F0F0F0F), 0xA8);
      }
      group += group_bytes<kBits>();
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sums[r]) : "v"(weights), "m"(x[r]));
      x += kRowGroup;
    }
    f32x16 scales, offsets;
    tile_block_parameters(tp, w, b, scales, offsets);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      add_block(totals[r], reinterpret_cast<i32x16>(sums[r]), scales, offsets,
                g.scale[b * kRowGroup + r], g.scaled_sum[b * kRowGroup + r]);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    store_columns(out.at(first_row + r, first), columns, totals[r]);
}

// Rows [first_row, end_row) of columns [first, first + columns) (columns <= 16: one tile) from
// the tiles and the lanes' copy of the block parameters (made together at kernel creation): 8
// rows at a time, then 4, 2, 1; from int16 pairs, or int8 quads (Rows::quads).
template <int kBits, bool kVnni>
void interleaved_rows(const Rows& rows, int64_t first_row, int64_t end_row, const Weights& w,
                      int64_t first, int columns, const Output& out) {
  prefetch_next_parameters(w, first);
  const int64_t tile_bytes = w.blocks * w.block_size / kGroupWeights * group_bytes<kBits>();
  const int64_t parameters = tile_slot(w, first);
  const uint8_t* tile = w.tiles + parameters * tile_bytes;
  if (rows.quads) {
    row_passes<8>(first_row, end_row, [&](int64_t row, auto count) {
      tile_rows_s8<kBits, decltype(count)::value>(rows, row, w, tile, parameters, first, columns, out);
    });
    return;
  }
  group_passes<8>(rows, first_row, end_row, [&](int64_t row, auto count, auto group) {
    tile_rows<kBits, kVnni, decltype(count)::value, decltype(group)::value>(
        rows, row, w, tile, parameters, first, columns, out);
  });
}

// The four sums of d[0..4)'s lanes, exact.
inline __m128i lane_sums4(const __m512i (&d)[4]) {
  __m256i half[4];
  for (int c = 0; c < 4; ++c) {
    const i32x16 v = reinterpret_cast<i32x16>(d[c]);
    half[c] = reinterpret_cast<__m256i>(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                                        __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  const i32x8 pairs = reinterpret_cast<i32x8>(_mm256_hadd_epi32(
      _mm256_hadd_epi32(half[0], half[1]), _mm256_hadd_epi32(half[2], half[3])));
  return reinterpret_cast<__m128i>(__builtin_shufflevector(pairs, pairs, 0, 1, 2, 3) +
                                   __builtin_shufflevector(pairs, pairs, 4, 5, 6, 7));
}

// Columns [c0, c0 + C) (C <= 4) of row `row`: the C columns read side by side through K (the
// next tile's asked for a block ahead, as a row of weights streams from memory best), each
// block's dots summed across lanes and added to 4-lane sums on the spot.
template <int kBits, int C>
void few_rows_tile(const Rows& rows, int64_t row, const Weights& w, const uint8_t* q,
                   LaneParameters& parameters, int c0, float* out) {
  const int64_t padded = w.blocks * w.block_size, column_bytes = weight_bytes<kBits>(padded);
  const int16_t* a = rows.q.data() + row * padded;
  __m128 sums = _mm_setzero_ps();
  for (int64_t b = 0; b < w.blocks; ++b) {
    const int64_t start = b * w.block_size;
    for (int c = 0; c < C; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(q + (c0 + C + c) * column_bytes +
                                                 weight_bytes<kBits>(start)),
                   _MM_HINT_T0);
    __m512i d[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                    _mm512_setzero_si512()};
    for (int64_t i = start; i < start + w.block_size; i += kPairStep) {
      const __m512i x = _mm512_loadu_si512(a + i);
      for (int c = 0; c < C; ++c)
        d[c] = _mm512_add_epi32(
            d[c], _mm512_madd_epi16(x, load32_weights<kBits>(q + (c0 + c) * column_bytes, i)));
    }
    __m128 scales, offsets;
    parameters.at4(b, c0, scales, offsets);
    const int64_t row_block = row * w.blocks + b;
    add_block4(sums, lane_sums4(d), scales, offsets, rows.scale[row_block],
               rows.scaled_sum[row_block]);
  }
  alignas(16) float totals[4];
  _mm_store_ps(totals, sums);
  for (int c = 0; c < C; ++c) out[c0 + c] = totals[c];
}

// Rows [first_row, end_row) (fewer than kTransposeRows) of columns [first, first + columns): a
// row's block dots four columns at a time, their epilogue add_block's on 4 lanes. (No
// transposition to amortize over one row; 16 column streams at once, or the dots kept for one
// 16-lane epilogue after them, read a 28 MB logits projection at half the speed.)
template <int kBits>
void few_rows(const Rows& rows, int64_t first_row, int64_t end_row, const Weights& w,
              int64_t first, int columns, const Output& out) {
  prefetch_next_parameters(w, first);
  const uint8_t* q = w.q + first * weight_bytes<kBits>(w.blocks * w.block_size);
  LaneParameters parameters(w, first, columns);
  for (int64_t row = first_row; row < end_row; ++row) {
    float* y = out.at(row, first);
    int c0 = 0;
    for (; c0 + 4 <= columns; c0 += 4) few_rows_tile<kBits, 4>(rows, row, w, q, parameters, c0, y);
    if (columns - c0 == 3) few_rows_tile<kBits, 3>(rows, row, w, q, parameters, c0, y);
    if (columns - c0 == 2) few_rows_tile<kBits, 2>(rows, row, w, q, parameters, c0, y);
    if (columns - c0 == 1) few_rows_tile<kBits, 1>(rows, row, w, q, parameters, c0, y);
  }
}
#endif

#if defined(__AVX2__) && !defined(__AVX512BW__)
// The AVX2 build's interleaved path: the AVX-512 build's tiles, each group read as two halves of
// 8 columns (a 256-bit vector of int32 lanes), a row's broadcast activation pair multiplied by
// them with vpmaddwd. A block's sums come out exact per column as on AVX-512, and the per-block
// epilogue is one vector for 8 columns: the lanes-per-column path below paid it per column and
// block (SmolLM2's [576 x 3072] shape at 8 to 128 rows: ~5 multiply-adds a cycle a core).

// A group's two vectors of columns 8h .. 8h + 7's int16 pairs: weights 4g, 4g + 1 and 4g + 2,
// 4g + 3 (interleave's layout: the half's bytes are 16 in a row).
template <int kBits>
inline void load_half_group(const uint8_t* group, int h, __m256i& first, __m256i& second) {
  if constexpr (kBits == 8) {
    first = _mm256_cvtepu8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(group + 16 * h)));
    second = _mm256_cvtepu8_epi16(
        _mm_load_si128(reinterpret_cast<const __m128i*>(group + 32 + 16 * h)));
  } else {
    const __m256i bytes =
        _mm256_cvtepu8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(group + 16 * h)));
    first = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F));
    second = _mm256_srli_epi16(bytes, 4);
  }
}

inline __m256i broadcast_pair8(const int16_t* a) {
  int32_t pair;
  std::memcpy(&pair, a, sizeof pair);
  return _mm256_set1_epi32(pair);
}

// Rows [first_row, first_row + R) of a tile's columns: each group's halves widened once for the
// R rows (R x 2 int32 accumulators, two weight vectors and a broadcast pair in AVX2's 16
// registers at R = 4; the float totals, touched once a block, may live in memory), added per
// block.
template <int kBits, int R>
void tile_rows(const Rows& rows, int64_t first_row, const Weights& w, const uint8_t* tile,
               int64_t tile_index, int64_t first, int columns, const Output& out) {
  const TileParameters tp(w, tile_index);
  const int64_t padded = w.blocks * w.block_size;
  __m256 totals[R][2];
  const int16_t* a[R];
  row_starts(rows, first_row, padded, a);
  for (int r = 0; r < R; ++r) {
    totals[r][0] = totals[r][1] = _mm256_setzero_ps();
  }
  const uint8_t* group = tile;
  for (int64_t b = 0; b < w.blocks; ++b) {
    __m256i sums[R][2];
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
    for (int64_t k = b * w.block_size; k < (b + 1) * w.block_size; k += kGroupWeights) {
      _mm_prefetch(reinterpret_cast<const char*>(group + kTilePrefetchBytes), _MM_HINT_T0);
      for (int h = 0; h < 2; ++h) {
        __m256i first, second;
        load_half_group<kBits>(group, h, first, second);
        for (int r = 0; r < R; ++r)
          sums[r][h] = _mm256_add_epi32(
              sums[r][h], _mm256_add_epi32(_mm256_madd_epi16(broadcast_pair8(a[r] + k), first),
                                           _mm256_madd_epi16(broadcast_pair8(a[r] + k + 2), second)));
      }
      group += group_bytes<kBits>();
    }
    for (int h = 0; h < 2; ++h) {
      __m256 scales, offsets;
      if (tp.halves != nullptr) {
        // (-zero) * scale, as pack_lane_parameters computes the float copy's offsets.
        const uint16_t* block = tp.halves + b * tp.per_block + 8 * h;
        scales = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
        const __m256 zeros =
            tp.per_block == kLaneColumns
                ? _mm256_set1_ps(w.zero(0))
                : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kLaneColumns)));
        offsets = _mm256_mul_ps(_mm256_xor_ps(zeros, _mm256_set1_ps(-0.0f)), scales);
      } else {
        const float* block = tp.floats + b * tp.per_block + 8 * h;
        scales = _mm256_loadu_ps(block);
        offsets = tp.per_block == kLaneColumns
                      ? _mm256_mul_ps(_mm256_set1_ps(-w.zero(0)), scales)
                      : _mm256_loadu_ps(block + kLaneColumns);
      }
      for (int r = 0; r < R; ++r) {
        const int64_t row_block = (first_row + r) * w.blocks + b;
        // (add_block's two multiply-adds into one accumulator)
        const __m256 products = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(sums[r][h]),
            _mm256_mul_ps(scales, _mm256_set1_ps(rows.scale[row_block])), totals[r][h]);
        totals[r][h] =
            _mm256_fmadd_ps(offsets, _mm256_set1_ps(rows.scaled_sum[row_block]), products);
      }
    }
  }
  alignas(32) float sums[kLaneColumns];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(sums, totals[r][0]);
    _mm256_store_ps(sums + 8, totals[r][1]);
    std::memcpy(out.at(first_row + r, first), sums,
                sizeof(float) * static_cast<size_t>(columns));
  }
}

// Rows [first_row, end_row) of columns [first, first + columns) (columns <= 16: one tile) from
// the tiles and the lanes' copy of the block parameters: 4 rows at a time, then 2, 1.
template <int kBits>
void interleaved_rows(const Rows& rows, int64_t first_row, int64_t end_row, const Weights& w,
                      int64_t first, int columns, const Output& out) {
  const int64_t tile_bytes = w.blocks * w.block_size / kGroupWeights * group_bytes<kBits>();
  const int64_t parameters = tile_slot(w, first);
  const uint8_t* tile = w.tiles + parameters * tile_bytes;
  row_passes<4>(first_row, end_row, [&](int64_t row, auto count) {
    tile_rows<kBits, decltype(count)::value>(rows, row, w, tile, parameters, first, columns, out);
  });
}
#endif

// Whether the AVX-512 build's integer path takes the node's blocks. Where it does, it also
// serves the nodes that need no batch invariance: it is 2-2.4x the float32 panel path from 4
// rows to 512 (Zen 5, SmolLM2's [576 x 3072] projection), which is there for CPUs whose integer
// products are no faster than float ones (AVX2 on 128-bit units). A column's whole block is
// summed in one int32 lane there, exact only while block_size * 32767 * (2^bits - 1) < 2^31:
// 8-bit blocks up to 256 (a block of 512 wrapped to the wrong sign), 4-bit ones up to 1024
// (kMaxBlock); longer 8-bit blocks take the lanes-per-column path (block_size / 8 products a
// lane).
constexpr bool wide_integer_path(int64_t block_size, int64_t bits) {
#if defined(__AVX512BW__)
  return block_size % kPairStep == 0 &&
         block_size * 32767 * ((int64_t{1} << bits) - 1) <= int64_t{0x7FFFFFFF};
#else
  (void)block_size;
  (void)bits;
  return false;
#endif
}

// Whether the node's products take the interleaved tiles: the AVX-512 build's wide integer path
// where its weights are initializers; in the AVX2 build every node whose block sums stay exact
// in one int32 lane (8-bit blocks up to 256, 4-bit ones up to 1024), its tiles made per call
// where the graph computes the weights (every call of a node the same way: batch invariance).
constexpr bool tiles_path(int64_t block_size, int64_t bits) {
#if defined(__AVX512BW__)
  return wide_integer_path(block_size, bits);
#else
  return block_size % (2 * kGroupWeights) == 0 &&
         block_size * 32767 * ((int64_t{1} << bits) - 1) <= int64_t{0x7FFFFFFF};
#endif
}

// Columns [first_column, end_column) of every row, on the widest integer path this build has for
// the node's block size.
template <int kBits>
void integer_columns(const Rows& rows, int64_t first_row, int64_t end_row, const Weights& w,
                     int64_t first_column, int64_t end_column, const Output& out) {
#if defined(__AVX512BW__)
  if (wide_integer_path(w.block_size, kBits)) {
    // (vpdpwssd or not chosen once here, as the paths' template argument: use_vnni)
    const auto run = [&](auto vnni) {
      constexpr bool kVnni = decltype(vnni)::value;
      for (int64_t first = first_column; first < end_column; first += kLaneColumns)
        for (int64_t row = first_row; row < end_row; row += kLaneRowBlock)
          (w.tiles != nullptr                ? interleaved_rows<kBits, kVnni>
           : end_row - row >= kTransposeRows ? transposed_rows<kBits, kVnni>
                                             : few_rows<kBits>)(
              rows, row, std::min(row + kLaneRowBlock, end_row), w, first,
              static_cast<int>(std::min(kLaneColumns, end_column - first)), out);
    };
    if (use_vnni()) run(std::true_type{});
    else run(std::false_type{});
    return;
  }
#else
  if (tiles_path(w.block_size, kBits)) {
    for (int64_t first = first_column; first < end_column; first += kLaneColumns)
      interleaved_rows<kBits>(rows, first_row, end_row, w, first,
                              static_cast<int>(std::min(kLaneColumns, end_column - first)),
                              out);
    return;
  }
#endif
  columns<kBits>(rows, first_row, end_row, w, first_column, end_column, out);
}

// Columns of a work item's tile (the plain node's items, and each of the two a fused form's
// item takes: the up projection's columns, N / 2 on, start a tile where N is a multiple of 32).
constexpr int64_t kFusedColumns = 16;

// y[r, c] = silu(gate[r, c]) * up[r, c] for r < rows, c < columns (<= kFusedColumns): gate and
// up from a work item's scratch ([rows][gate's 16 | up's 16]), y's rows `ldy` apart.
void silu_and_mul_scratch(const float* scratch, int64_t rows, int columns, float* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = scratch + r * 2 * kFusedColumns;
    const f32x16 gated = silu16(load16_float(gate)) * load16_float(gate + kFusedColumns);
    if (columns == kFusedColumns) {
      store16_float(y + r * ldy, gated);
    } else {
      float lanes[kFusedColumns];
      store16_float(lanes, gated);
      std::memcpy(y + r * ldy, lanes, sizeof(float) * static_cast<size_t>(columns));
    }
  }
}

bool is_half(const Tensor& t) { return t.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16; }

// The block parameters of `scales` and `zero_points` as Weights (q left null), or the error that
// names what is wrong with them. Float16 ones (the lowering stores them so) are read as float32
// from `kept` (the kernel's copy of initializers) or else widened into `widened`: the scales,
// then the float zero points, as far as each is float16.
OrtStatus* weights_of(const std::string& op, const Tensor& scales, const Tensor& zero_points,
                      int64_t n, int64_t blocks, int64_t block_size, const std::vector<float>& kept,
                      std::vector<float>& widened, Weights* out) {
  const int64_t count = n * blocks;
  if (!(scales.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || is_half(scales)) ||
      scales.numel() != count)
    return invalid(op + ": scales: expected float32 or float16 [" + std::to_string(count) +
                   "], got " + type_name(scales.type) + " " + scales.shape());
  const bool float_zero_points =
      zero_points.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || is_half(zero_points);
  if (!(float_zero_points || zero_points.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8) ||
      !(zero_points.numel() == count || (!float_zero_points && zero_points.numel() == 1)))
    return invalid(op + ": zero_points: expected uint8 [1] or uint8, float32 or float16 [" +
                   std::to_string(count) + "], got " + type_name(zero_points.type) + " " +
                   zero_points.shape());
  const int64_t halves = (is_half(scales) ? count : 0) + (is_half(zero_points) ? count : 0);
  const float* floats = kept.data();
  if (halves > 0 && static_cast<int64_t>(kept.size()) != halves) {
    widened.resize(static_cast<size_t>(halves));
    float* to = widened.data();
    for (const Tensor* t : {&scales, &zero_points})
      if (is_half(*t))
        for (int64_t i = 0; i < count; ++i) *to++ = to_float(static_cast<const Half*>(t->data)[i]);
    floats = widened.data();
  }
  const auto floats_of = [&](const Tensor& t, int64_t at) {
    return is_half(t) ? floats + at : static_cast<const float*>(t.data);
  };
  *out = Weights{nullptr,
                 floats_of(scales, 0),
                 float_zero_points ? floats_of(zero_points, is_half(scales) ? count : 0) : nullptr,
                 float_zero_points ? nullptr : static_cast<const uint8_t*>(zero_points.data),
                 zero_points.numel() == 1 ? 0 : 1,
                 blocks,
                 block_size,
                 n};
  return nullptr;
}

}  // namespace

OrtStatus* MatMul8Bits::init(const OrtKernelInfo* info) {
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "K", &k));
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "N", &n));
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "block_size", &block_size));
  if (OrtStatus* s = int_attribute(info, "batch_invariant", &batch_invariant))
    api().ReleaseStatus(s);  // (optional: 1)
  if (OrtStatus* s = int_attribute(info, "int8_from_rows", &int8_from_rows))
    api().ReleaseStatus(s);  // (optional: 0, never)
  if (qkv_rotary) {
    ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "num_heads", &num_heads));
    ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "num_kv_heads", &num_kv_heads));
    ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "head_size", &head_size));
    if (num_heads < 1 || num_kv_heads < 1 || head_size < 1 || head_size % (2 * kFusedColumns) ||
        n != (num_heads + 2 * num_kv_heads) * head_size)
      return invalid(op_name() + ": expected positive num_heads and num_kv_heads, a head_size "
                     "that is a multiple of " + std::to_string(2 * kFusedColumns) +
                     " and N = (num_heads + 2 * num_kv_heads) * head_size, got num_heads=" +
                     std::to_string(num_heads) + ", num_kv_heads=" + std::to_string(num_kv_heads) +
                     ", head_size=" + std::to_string(head_size) + ", N=" + std::to_string(n));
  }
  if (silu_and_mul && n % (2 * kFusedColumns) != 0)
    return invalid(op_name() + ": expected N (the gate's and the up projection's columns) a "
                   "multiple of " + std::to_string(2 * kFusedColumns) + ", got N=" +
                   std::to_string(n));
  if (k <= 0 || n <= 0 || block_size % kStep != 0 || block_size > kMaxBlock)
    return invalid(op_name() + ": expected K > 0, N > 0 and a block_size that is a multiple of " +
                   std::to_string(kStep) + " up to " + std::to_string(kMaxBlock) +
                   ", got K=" + std::to_string(k) +
                   ", N=" + std::to_string(n) + ", block_size=" + std::to_string(block_size));
  // Initializer scales and zero points (every export's): float16 ones (the lowering's) widened
  // to float32 once, for the paths that read them so; on AVX-512, their lanes' copy (transposed
  // on every call, their loads and shuffles took as long as the products of a one-row call) and
  // the weights' tiles. Inputs the graph computes, or invalid ones, are left to compute().
  Tensor scales, zero_points;
  bool constant_scales = false, constant_zero_points = false;
  ATTNEXPORT_RETURN_IF_ERROR(read_constant_input(info, 2, &scales, &constant_scales));
  ATTNEXPORT_RETURN_IF_ERROR(read_constant_input(info, 3, &zero_points, &constant_zero_points));
  if (!(constant_scales && constant_zero_points)) return nullptr;
  Tensor b;
  bool constant_b = false;
  ATTNEXPORT_RETURN_IF_ERROR(read_constant_input(info, 1, &b, &constant_b));
  if (constant_b) {
    initializer_inputs = true;
    initializer_b = b, initializer_scales = scales, initializer_zero_points = zero_points;
  }
  const int64_t blocks = (k + block_size - 1) / block_size;
  Weights weights;
  if (OrtStatus* status = weights_of(op_name(), scales, zero_points, n, blocks, block_size, {},
                                     float_parameters, &weights)) {
    api().ReleaseStatus(status);
    return nullptr;
  }
  weights.pair = tile_pairs();
  if (tiles_path(block_size, bits)) {
    // The tiles with the parameters' copy in float16 where they are float16 values (the
    // lowering's), else (or without the tiles) the float32 copy.
    if (constant_b && b.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 &&
        b.numel() == n * blocks * block_size * bits / 8) {
      with_bits(bits, [&](auto width) {
        tiles = interleave<decltype(width)::value>(static_cast<const uint8_t*>(b.data), n,
                                                   blocks * block_size, weights.pair);
      });
      half_lanes = pack_half_lanes(weights, n);
    }
    if (half_lanes.empty()) lane_parameters = pack_lane_parameters(weights, n);
  }
  return nullptr;
}

OrtStatus* MatMul8Bits::compute(OrtKernelContext* context) const {
  Tensor a, read_b, read_scales, read_zero_points;
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 0, &a));
  if (!initializer_inputs) {
    ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 1, &read_b));
    ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 2, &read_scales));
    ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 3, &read_zero_points));
  }
  const Tensor& b = initializer_inputs ? initializer_b : read_b;
  const Tensor& scales = initializer_inputs ? initializer_scales : read_scales;
  const Tensor& zero_points = initializer_inputs ? initializer_zero_points : read_zero_points;
  const int64_t blocks = (k + block_size - 1) / block_size;
  if (a.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || a.dims.empty() || a.dims.back() != k)
    return invalid(op_name() + ": a: expected float32 [..., " + std::to_string(k) + "], got " +
                   type_name(a.type) + " " + a.shape());
  if (b.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 ||
      b.numel() != n * blocks * block_size * bits / 8)
    return invalid(op_name() + ": b: expected uint8 [" + std::to_string(n) + ", " +
                   std::to_string(blocks) + ", " + std::to_string(block_size * bits / 8) +
                   "], got " + type_name(b.type) + " " + b.shape());
  Weights weights;
  std::vector<float> widened;  // (float16 parameters the graph computes)
  ATTNEXPORT_RETURN_IF_ERROR(weights_of(op_name(), scales, zero_points, n, blocks, block_size,
                                        float_parameters, widened, &weights));
  weights.q = static_cast<const uint8_t*>(b.data);
  weights.pair = tile_pairs();
  if (!lane_parameters.empty())
    weights.lanes = lane_parameters.data() + line_start(lane_parameters.data());
  if (!tiles.empty()) weights.tiles = tiles.data() + line_start(tiles.data());
  if (!half_lanes.empty()) weights.half_lanes = half_lanes.data();
#if !defined(__AVX512BW__)
  // The AVX2 build's tiles and parameters' copy where the graph computes the weights or the
  // parameters: made for this call (the AVX-512 build has paths that need neither).
  std::vector<uint8_t> call_tiles;
  std::vector<float> call_lanes;
  if (tiles_path(block_size, bits) && weights.tiles == nullptr) {
    with_bits(bits, [&](auto width) {
      call_tiles = interleave<decltype(width)::value>(weights.q, n, blocks * block_size,
                                                      weights.pair);
    });
    weights.tiles = call_tiles.data() + line_start(call_tiles.data());
  }
  if (tiles_path(block_size, bits) && weights.lanes == nullptr && weights.half_lanes == nullptr) {
    call_lanes = pack_lane_parameters(weights, n);
    weights.lanes = call_lanes.data() + line_start(call_lanes.data());
  }
#endif
  const int64_t rows = a.numel() / k;
  // The outputs: y [..., N] (silu_and_mul: [..., N / 2], silu(gate) * up of the product's
  // halves), or with qkv_rotary query, key, value and the tables they are rotated by.
  Tensor outs[3], cos, sin;
  const int64_t y_columns = silu_and_mul ? n / 2 : n;
  if (qkv_rotary) {
    ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 4, &cos));
    ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 5, &sin));
    const std::vector<int64_t> table_dims{rows, head_size};
    if (a.dims.size() != 2)
      return invalid(op_name() + ": a: expected float32 [num_tokens, " + std::to_string(k) +
                     "], got " + a.shape());
    if (cos.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || cos.dims != table_dims ||
        sin.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || sin.dims != table_dims)
      return invalid(op_name() + ": cos, sin: expected float32 " + format_dims(table_dims) +
                     " ([num_tokens, head_size]), got " + type_name(cos.type) + " " +
                     cos.shape() + " and " + type_name(sin.type) + " " + sin.shape());
    const int64_t counts[3] = {num_heads, num_kv_heads, num_kv_heads};
    for (size_t i = 0; i < 3; ++i)
      ATTNEXPORT_RETURN_IF_ERROR(make_output(context, i, {rows, counts[i], head_size}, &outs[i]));
  } else {
    std::vector<int64_t> out_dims = a.dims;
    out_dims.back() = y_columns;
    ATTNEXPORT_RETURN_IF_ERROR(make_output(context, 0, out_dims, &outs[0]));
  }
  if (rows == 0) return nullptr;

  const auto* x = static_cast<const float*>(a.data);
  // Nodes without batch invariance multiply 8-bit blocks over 256 as float32 panels (calls of
  // kPanelRows rows or more); every other call rounds its rows first.
  const bool panels = !batch_invariant && rows >= kPanelRows && !tiles_path(block_size, bits);
  // The calling thread's buffers, kept between calls (round_rows writes every element): fresh
  // ones, allocated and zeroed on every call, took 1.05x the time at 1 and 32 rows, 1.01x at
  // 1024 ([1536 x 576], 4 bits, the two alternating). (A reference, so that the workers'
  // lambdas capture this thread's buffers, not name their own.)
  thread_local Rows buffers;
  Rows& rounded = buffers;
  if (!panels) {
    // (Groups of kRowGroup for the AVX-512 tiles' path, which every call of a node with tiles
    // takes. The AVX2 build's tiles read rows in the row-major layout: grouped, its 16
    // registers could not hold a pass's broadcast pairs and accumulators, 1.2-1.45x slower.)
    // A call of int8_from_rows rows or more rounds to int8 steps (the same integers whichever
    // path multiplies them; vpdpbusd's where the tiles and AVX512_VNNI are).
    const bool int8_steps = int8_from_rows > 0 && rows >= int8_from_rows;
#if defined(__AVX512BW__)
    const int64_t group = weights.tiles != nullptr && rows > 1 ? kRowGroup : 1;
    const bool quads = int8_steps && group == kRowGroup && use_vnni();
#else
    const int64_t group = 1;
    const bool quads = false;
#endif
    rounded.shape(rows, blocks, block_size, group, int8_steps ? 127.0f : 32767.0f, quads);
    ATTNEXPORT_RETURN_IF_ERROR(for_row_ranges(context, rows, k, [&](int64_t first, int64_t end) {
      round_rows(x, first, end, k, rounded);
    }));
  }
  // Columns [first, end) of rows [row, end_row) of the product, written through `into`.
  const auto product = [&](int64_t row, int64_t end_row, int64_t first, int64_t end,
                           const Output& into) {
    with_bits(bits, [&](auto width) {
      constexpr int kBits = decltype(width)::value;
      if (panels)
        panel_columns<kBits>(x + row * k, row, end_row - row, k, weights, first, end, into);
      else
        integer_columns<kBits>(rounded, row, end_row, weights, first, end, into);
    });
  };
  // Two stretches of `columns` (<= kFusedColumns) product columns, from first_a and from
  // first_b, of rows [row, end_row) into the calling thread's scratch ([rows][a's 16 | b's 16]),
  // for an epilogue to read from L1.
  const auto pair_into_scratch = [&](int64_t row, int64_t end_row, int64_t first_a,
                                     int64_t first_b, int64_t columns) {
    thread_local std::vector<float> scratch;
    scratch.resize(static_cast<size_t>((end_row - row) * 2 * kFusedColumns));
    product(row, end_row, first_a, first_a + columns,
            Output{scratch.data(), 2 * kFusedColumns, row, first_a});
    product(row, end_row, first_b, first_b + columns,
            Output{scratch.data() + kFusedColumns, 2 * kFusedColumns, row, first_b});
    return static_cast<const float*>(scratch.data());
  };

  // Work items of kRowsPerItem rows by a few columns, a row block's items adjacent: a prefill's
  // rows are read from L2 by the items of their block (with every row in each item, a
  // 1024-row prefill's rounded activations, 1.2 MB at K = 576, were streamed again for every 16
  // columns); a decoded token's [576 x 576] projection is 36 items of 16 columns.
  constexpr int64_t kRowsPerItem = 64;
  static_assert(kRowsPerItem == kPanelRowBlock, "the panels' row blocks are the items'");
  const int64_t row_blocks = (rows + kRowsPerItem - 1) / kRowsPerItem;
  const auto run_items = [&](int64_t per_block, auto&& item) {
    auto at = [&](size_t i) {
      const int64_t row = static_cast<int64_t>(i) / per_block * kRowsPerItem;
      item(row, std::min(row + kRowsPerItem, rows), static_cast<int64_t>(i) % per_block);
    };
    return parallel_for(context, static_cast<size_t>(row_blocks * per_block), at);
  };
  auto* y = static_cast<float*>(outs[0].data);
  if (qkv_rotary) {
    // Per row block, items of a head's lanes [16j, 16j + 16) in both halves (the same work
    // each: with value items of 16 columns, a decode step's 36 items of SmolLM2 split unevenly
    // between 2 threads, 1.07x the unfused nodes' step at batch 32): (num_heads + num_kv_heads)
    // x half / 16 of query and key heads, rotated from the scratch, then num_kv_heads x half /
    // 16 of value heads, written in place.
    const int64_t D = head_size, half = D / 2, lanes = half / kFusedColumns;
    const int64_t rotated = (num_heads + num_kv_heads) * lanes;
    const auto* cs = static_cast<const float*>(cos.data);
    const auto* ss = static_cast<const float*>(sin.data);
    return run_items(rotated + num_kv_heads * lanes, [&](int64_t row, int64_t end_row, int64_t i) {
      const int64_t head = i / lanes, lane = i % lanes * kFusedColumns;
      if (i >= rotated) {
        const Output value{static_cast<float*>(outs[2].data), num_kv_heads * D, 0,
                           (num_heads + num_kv_heads) * D};
        const int64_t first = head * D + lane;
        product(row, end_row, first, first + kFusedColumns, value);
        return product(row, end_row, first + half, first + half + kFusedColumns, value);
      }
      const float* scratch =
          pair_into_scratch(row, end_row, head * D + lane, head * D + half + lane, kFusedColumns);
      const bool query = head < num_heads;
      const int64_t stride = (query ? num_heads : num_kv_heads) * D;
      float* dst = static_cast<float*>(outs[query ? 0 : 1].data) +
                   (query ? head : head - num_heads) * D + lane;
      for (int64_t t = row; t < end_row; ++t) {
        const float* pair = scratch + (t - row) * 2 * kFusedColumns;
        rotate16(load16(pair), load16(pair + kFusedColumns), cs + t * D + lane,
                 ss + t * D + lane, half, dst + t * stride, dst + t * stride + half);
      }
    });
  }
  if (silu_and_mul) {
    // Items of 16 gate columns and the 16 up columns N / 2 further: y gets silu(gate) * up.
    return run_items((y_columns + kFusedColumns - 1) / kFusedColumns,
                     [&](int64_t row, int64_t end_row, int64_t i) {
                       const int64_t first = i * kFusedColumns;
                       const int64_t columns = std::min(kFusedColumns, y_columns - first);
                       const float* scratch =
                           pair_into_scratch(row, end_row, first, y_columns + first, columns);
                       silu_and_mul_scratch(scratch, end_row - row, static_cast<int>(columns),
                                            y + row * y_columns + first, y_columns);
                     });
  }
  // (The panels: items of kPanelColumns columns, whose panel and rows stay in L1.)
  const int64_t columns_per_item = panels ? kPanelColumns : kFusedColumns;
  return run_items((n + columns_per_item - 1) / columns_per_item,
                   [&](int64_t row, int64_t end_row, int64_t i) {
                     const int64_t first = i * columns_per_item;
                     product(row, end_row, first, std::min(first + columns_per_item, n),
                             Output{y, n});
                   });
}

}  // namespace attnexport
