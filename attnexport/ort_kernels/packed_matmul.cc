// attnexport.PackedMatMul (packed_matmul.h): float32 weights in panels of 32 columns.
//
// Written here rather than left to onnxruntime's MatMul (MLAS SGEMM on its own packed copy)
// because a custom node cannot call MLAS, and the calls a decoder makes are short: 1-64 rows
// against a weight streamed from memory. One pass of rows reads a panel (or two, side by side:
// two streams from memory) once and keeps every row's totals in registers; on SmolLM2's
// [576 x 1536], 30 weights in turn (106 MB, from memory), 2 threads, alternating with
// onnxruntime's MatMul: 8 rows 2.1-2.2 against 3.2-3.3 ms, 32 rows 4.7-4.8 against 6.2-6.3 ms,
// one row the same (the stream's bandwidth), 128 rows 1.05x.

#include "packed_matmul.h"

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "kernel_api.h"
#include "vector_math.h"

namespace attnexport {
namespace {

constexpr int64_t kPanel = 32;  // columns of a panel (the file's layout)

#if defined(__AVX512F__)
using Lanes = __m512;
constexpr int kLanes = 16;
// 6 rows x 2 panels x 2 registers: 24 totals, 4 panel registers and a broadcast of 32.
constexpr int kMostRows = 6, kMostPanels = 2;
inline Lanes zero_lanes() { return _mm512_setzero_ps(); }
inline Lanes load_lanes(const float* p) { return _mm512_loadu_ps(p); }
inline Lanes broadcast(float x) { return _mm512_set1_ps(x); }
inline Lanes fma_lanes(Lanes a, Lanes b, Lanes c) { return _mm512_fmadd_ps(a, b, c); }
inline void store_lanes(float* p, Lanes v) { _mm512_storeu_ps(p, v); }
#else
using Lanes = __m256;
constexpr int kLanes = 8;
// 2 rows x 4 registers: 8 totals, 4 panel registers and a broadcast of 16 (3 rows spilled:
// SmolLM2 b32 decode, ATTNEXPORT_ISA=avx2, PackedMatMul 43.5-44.5 -> 29.1-30.8 ms a step).
constexpr int kMostRows = 2, kMostPanels = 1;
inline Lanes zero_lanes() { return _mm256_setzero_ps(); }
inline Lanes load_lanes(const float* p) { return _mm256_loadu_ps(p); }
inline Lanes broadcast(float x) { return _mm256_set1_ps(x); }
inline Lanes fma_lanes(Lanes a, Lanes b, Lanes c) { return _mm256_fmadd_ps(a, b, c); }
inline void store_lanes(float* p, Lanes v) { _mm256_storeu_ps(p, v); }
#endif
constexpr int kPanelLanes = kPanel / kLanes;
// A work item's rows: a prefill's calls are cut into blocks whose activations stay in L2 while
// the item's panels stream past them (96 rows of K = 1536: 590 KB).
constexpr int64_t kRowBlock = 96;
static_assert(kRowBlock % kMostRows == 0, "row blocks are whole passes");

// The lines [first, end) of `next` to bring into L2 while a pass runs, one a step of k.
struct Prefetch {
  const char* next = nullptr;
  int64_t first = 0, end = 0;
};

// y[R rows, P panels' columns] = a[R rows, k] @ panels[P][k][32]: a's rows k apart, y's n apart,
// the panels k * 32 apart.
template <int R, int P>
void tile(const float* a, int64_t k, const float* panels, float* y, int64_t n, Prefetch ahead) {
  constexpr int kColumns = P * kPanelLanes;
  Lanes totals[R][kColumns];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < kColumns; ++c) totals[r][c] = zero_lanes();
  for (int64_t i = 0; i < k; ++i) {
    Lanes w[kColumns];
#pragma GCC unroll 8
    for (int c = 0; c < kColumns; ++c)
      w[c] = load_lanes(panels + (c / kPanelLanes) * k * kPanel + i * kPanel +
                        (c % kPanelLanes) * kLanes);
    if (ahead.first + i < ahead.end) _mm_prefetch(ahead.next + (ahead.first + i) * 64, _MM_HINT_T1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const Lanes x = broadcast(a[r * k + i]);
#pragma GCC unroll 8
      for (int c = 0; c < kColumns; ++c) totals[r][c] = fma_lanes(x, w[c], totals[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < kColumns; ++c)
      store_lanes(y + r * n + (c / kPanelLanes) * kPanel + (c % kPanelLanes) * kLanes,
                  totals[r][c]);
}

// tile<rows, P> for 1 <= rows <= R.
template <int R, int P>
void tile_of(int64_t rows, const float* a, int64_t k, const float* panels, float* y, int64_t n,
             Prefetch ahead) {
  if constexpr (R > 1) {
    if (rows < R) return tile_of<R - 1, P>(rows, a, k, panels, y, n, ahead);
  }
  tile<R, P>(a, k, panels, y, n, ahead);
}

// Rows [first, end) of y by the panels [panel, panel + count), passes of kMostRows rows. The
// first pass streams the panels from memory; the others read them from L2 and bring in `next`
// (the lines of the work item this thread takes next), a line a step: the first pass's products
// alone need ~4x the bandwidth a core gets, and without this the next item's first pass waited
// on memory (SmolLM2's [576 x 1536], 30 weights, 32 rows: 4.8-5.0 -> 3.7-3.8 ms in a harness).
// With silu_and_mul, the panels are a pair (gate, up) and y's rows (ldy apart) get
// silu(gate) * up, 32 columns at panel / 2.
void rows_by_panels(const float* a, int64_t first, int64_t end, int64_t k, const float* b,
                    int64_t panel, int64_t count, float* y, int64_t ldy, bool silu_and_mul,
                    const char* next, int64_t next_lines) {
  const float* panels = b + panel * k * kPanel;
  for (int64_t row = first, pass = 0; row < end; row += kMostRows, ++pass) {
    const int64_t rows = std::min<int64_t>(kMostRows, end - row);
    const float* x = a + row * k;
    const Prefetch ahead{next, pass == 0 ? next_lines : (pass - 1) * k, next_lines};
    if (!silu_and_mul) {
      float* out = y + row * ldy + panel * kPanel;
      if (kMostPanels == 2 && count == 2)
        tile_of<kMostRows, kMostPanels>(rows, x, k, panels, out, ldy, ahead);
      else
        tile_of<kMostRows, 1>(rows, x, k, panels, out, ldy, ahead);
      continue;
    }
    // The pair's products, rows of 64 in L1, then the activation: the gate/up product never
    // leaves the core (SiluAndMul read it back, 12 MB a layer for 1024 rows).
    alignas(64) float products[kMostRows * 2 * kPanel];
    if constexpr (kMostPanels == 2) {
      tile_of<kMostRows, 2>(rows, x, k, panels, products, 2 * kPanel, ahead);
    } else {
      tile_of<kMostRows, 1>(rows, x, k, panels, products, 2 * kPanel, ahead);
      tile_of<kMostRows, 1>(rows, x, k, panels + k * kPanel, products + kPanel, 2 * kPanel,
                            ahead);
    }
    float* out = y + row * ldy + panel / 2 * kPanel;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < kPanel; c += 16) {
        const float* gate = products + r * 2 * kPanel + c;
        store16(out + r * ldy + c, silu16(load16(gate)) * load16(gate + kPanel));
      }
  }
}

}  // namespace

OrtStatus* PackedMatMul::init(const OrtKernelInfo* info) {
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "K", &k));
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "N", &n));
  const int64_t multiple = silu_and_mul ? 2 * kPanel : kPanel;
  if (k <= 0 || n <= 0 || n % multiple != 0)
    return invalid(op_name() + ": expected K > 0 and N a positive multiple of " +
                   std::to_string(multiple) + ", got K=" + std::to_string(k) +
                   ", N=" + std::to_string(n));
  return nullptr;
}

OrtStatus* PackedMatMul::compute(OrtKernelContext* context) const {
  Tensor a, b;
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 0, &a));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 1, &b));
  if (a.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || a.dims.empty() || a.dims.back() != k)
    return invalid(op_name() + ": a: expected float32 [..., " + std::to_string(k) + "], got " +
                   type_name(a.type) + " " + a.shape());
  const std::vector<int64_t> panels_dims = {n / kPanel, k, kPanel};
  if (b.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || b.dims != panels_dims)
    return invalid(op_name() + ": b: expected float32 " + format_dims(panels_dims) + ", got " +
                   type_name(b.type) + " " + b.shape());
  const int64_t ldy = silu_and_mul ? n / 2 : n;
  std::vector<int64_t> out_dims = a.dims;
  out_dims.back() = ldy;
  Tensor out;
  ATTNEXPORT_RETURN_IF_ERROR(make_output(context, 0, out_dims, &out));
  const int64_t rows = a.numel() / k;
  if (rows == 0) return nullptr;
  const auto* x = static_cast<const float*>(a.data);
  const auto* w = static_cast<const float*>(b.data);
  auto* y = static_cast<float*>(out.data);
  // Items of kMostPanels panels by kRowBlock rows, a row block's items adjacent. onnxruntime's
  // ParallelFor (num_batch 0: its TrySimpleParallelFor) hands each thread items in order from
  // its own share of the range, so item i + 1 is most often the one a thread takes next: its
  // panels are what rows_by_panels prefetches (the measured gain bears that out).
  const int64_t panels = n / kPanel;
  const int64_t per_item = silu_and_mul ? 2 : kMostPanels;  // (a gate/up pair)
  const int64_t column_items = (panels + per_item - 1) / per_item;
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  const int64_t items = row_blocks * column_items;
  auto item = [&](size_t i) {
    const int64_t row = static_cast<int64_t>(i) / column_items * kRowBlock;
    const int64_t panel = static_cast<int64_t>(i) % column_items * per_item;
    const int64_t next_panel = static_cast<int64_t>(i + 1) % column_items * per_item;
    const int64_t next_count = std::min<int64_t>(per_item, panels - next_panel);
    const bool last = static_cast<int64_t>(i) + 1 == items;
    rows_by_panels(x, row, std::min(row + kRowBlock, rows), k, w, panel,
                   std::min<int64_t>(per_item, panels - panel), y, ldy, silu_and_mul,
                   reinterpret_cast<const char*>(w + next_panel * k * kPanel),
                   last ? 0 : next_count * k * kPanel * 4 / 64);
  };
  return parallel_for(context, static_cast<size_t>(items), item);
}

}  // namespace attnexport
