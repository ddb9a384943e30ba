// Register-blocked products of small row-major panels, float32 or bfloat16 pairs (kPairs): the
// two matrix products of the tiled prefill attention (paged_prefill.cc), scores = queries .
// keys^T and outputs += weights . values, each over panels that sit in L1/L2, into float32.
#pragma once

#include <cstdint>
#include <type_traits>

#include "vector_math.h"

namespace attnexport {

// The register tile: kTileRows rows of b's kTileVectors native vectors (kLanes floats each):
// AVX2 (16 ymm): 6 rows x 16 columns = 12 accumulators + a row of b (2) + a broadcast;
// AVX-512 (32 zmm): 8 rows x 32 columns = 16 + 2 + 1. Each element of a, broadcast from
// memory, serves kTileVectors vectors of b, and each vector of b serves kTileRows rows.
// Native-width vectors, not the kernels' f32x16: g++ 12 keeps an array of 64-byte vectors on
// AVX2 in memory, moving each through general registers (measured ~7x slower).
#if defined(__AVX512F__)
typedef float lane_vector __attribute__((vector_size(64)));
typedef int32_t lane_int_vector __attribute__((vector_size(64)));
constexpr int kLanes = 16, kTileRows = 8, kTileVectors = 2;
#else
typedef float lane_vector __attribute__((vector_size(32)));
typedef int32_t lane_int_vector __attribute__((vector_size(32)));
constexpr int kLanes = 8, kTileRows = 6, kTileVectors = 2;
#endif
typedef float lane_vector_unaligned __attribute__((vector_size(sizeof(lane_vector)), aligned(4)));

inline lane_vector load_lanes(const float* p) {
  return *reinterpret_cast<const lane_vector_unaligned*>(p);
}
inline void store_lanes(float* p, lane_vector v) { *reinterpret_cast<lane_vector_unaligned*>(p) = v; }
inline lane_vector splat_lanes(float x) {
#if defined(__AVX512F__)
  return lane_vector{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#else
  return lane_vector{x, x, x, x, x, x, x, x};
#endif
}

// What the products multiply: float32 elements (multiply-adds of a broadcast element), or
// bfloat16 pairs held as uint32 words (AVX-512 builds on AVX512_BF16 CPUs: vdpbf16ps, a
// broadcast pair of a times b's lanes' pairs, both products added to the float32 lane: twice
// the multiply-adds an instruction). With pairs, `depth` counts pairs.
template <typename T>
constexpr bool kPairs = std::is_same_v<T, uint32_t>;

// c[R rows][V * kLanes columns] (+)= a[R rows][depth] . b[depth][V * kLanes columns]; the rows
// of a, b and c lie lda, ldb and ldc elements apart.
template <int R, int V, bool Accumulate, typename T>
inline void tile_product(const T* a, int64_t lda, const T* b, int64_t ldb, int64_t depth,
                         float* c, int64_t ldc) {
  lane_vector acc[R][V];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v)
      acc[r][v] = Accumulate ? load_lanes(c + r * ldc + v * kLanes) : lane_vector{};
  for (int64_t k = 0; k < depth; ++k, b += ldb) {
    lane_vector row[V];
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) row[v] = load_lanes(reinterpret_cast<const float*>(b) + v * kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      if constexpr (kPairs<T>) {
#if defined(__AVX512F__)
#pragma GCC unroll 16
        for (int v = 0; v < V; ++v)
          asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc[r][v]) : "v"(row[v]), "m"(a[r * lda + k]));
#else
        static_assert(!kPairs<T>, "bfloat16 pairs: the AVX-512 build only");
#endif
      } else {
        const lane_vector splat = splat_lanes(a[r * lda + k]);
#pragma GCC unroll 16
        for (int v = 0; v < V; ++v) acc[r][v] += splat * row[v];
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int v = 0; v < V; ++v) store_lanes(c + r * ldc + v * kLanes, acc[r][v]);
}

// The last `rows` (< R) rows of a column panel: tile_product<rows, V>.
template <int R, int V, bool Accumulate, typename T>
inline void tile_product_rows(int rows, const T* a, int64_t lda, const T* b, int64_t ldb,
                              int64_t depth, float* c, int64_t ldc) {
  if constexpr (R > 0) {
    if (rows == R) return tile_product<R, V, Accumulate>(a, lda, b, ldb, depth, c, ldc);
    return tile_product_rows<R - 1, V, Accumulate>(rows, a, lda, b, ldb, depth, c, ldc);
  }
}

template <int V, bool Accumulate, typename T>
inline void column_panel(int64_t m, const T* a, int64_t lda, const T* b, int64_t ldb,
                         int64_t depth, float* c, int64_t ldc) {
  int64_t r = 0;
  for (; r + kTileRows <= m; r += kTileRows)
    tile_product<kTileRows, V, Accumulate>(a + r * lda, lda, b, ldb, depth, c + r * ldc, ldc);
  if (r < m)
    tile_product_rows<kTileRows - 1, V, Accumulate>(static_cast<int>(m - r), a + r * lda, lda, b,
                                                    ldb, depth, c + r * ldc, ldc);
}

// c[m][n] (+)= a[m][depth] . b[depth][n] for n a multiple of 16, one column panel of b at a
// time (it stays in L1 while every row of a passes over it). (Pairs: b's rows are n words.)
template <bool Accumulate, typename T>
inline void panel_product(int64_t m, int64_t n, int64_t depth, const T* a, int64_t lda,
                          const T* b, int64_t ldb, float* c, int64_t ldc) {
  constexpr int64_t columns = kTileVectors * kLanes;
  int64_t col = 0;
  for (; col + columns <= n; col += columns)
    column_panel<kTileVectors, Accumulate>(m, a, lda, b + col, ldb, depth, c + col, ldc);
  for (; col < n; col += 16)  // AVX-512: 16 columns left
    column_panel<16 / kLanes, Accumulate>(m, a, lda, b + col, ldb, depth, c + col, ldc);
}

}  // namespace attnexport
