// attnexport.PackedMatMul (packed_matmul.h): float32 weights in panels of 32 columns.
//
// Written here rather than left to onnxruntime's MatMul (MLAS SGEMM on its own packed copy)
// because a custom node cannot call MLAS, and the calls a decoder makes are short: 1-64 rows
// against a weight streamed from memory. One pass of rows reads a panel (or two, side by side:
// two streams from memory) once and keeps every row's totals in registers; on SmolLM2's
// [576 x 1536], 30 weights in turn (106 MB, from memory), 2 threads, alternating with
// onnxruntime's MatMul: 8 rows 2.1-2.2 against 3.2-3.3 ms, 32 rows 4.7-4.8 against 6.2-6.3 ms,
// one row the same (the stream's bandwidth), 128 rows 1.05x.
//
// attnexport.LosslessMatMul{4,8}Bits[SiluAndMul] (lossless_weights.py) are the same products on
// float32 weights stored as codes: the tiles decode each weight in registers to the checkpoint's
// float32 number (one fused multiply-add of its code, its block's float16 scale and offset,
// exact) and multiply as the float panels do, so the outputs are bit for bit PackedMatMul's. A
// call of many rows decodes an item's panels once into a float32 scratch and runs the float
// tiles on it (kInlinePasses).

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
// Lanes of float16 numbers, and of codes widened to int32 then converted (g++ 12's
// _mm512_cvtph_ps, _mm512_cvtepi32_ps and the plain widening intrinsics trip
// -Werror=maybe-uninitialized: vector_math.h's load16_float has the same workarounds).
inline Lanes load_halves(const uint16_t* p) {
  __m512 v;
  asm("vcvtph2ps %1, %0" : "=v"(v) : "m"(*reinterpret_cast<const __m256i*>(p)));
  return v;
}
template <int Bits, int Shift>
inline Lanes code_lanes(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  i32x16 wide = reinterpret_cast<i32x16>(Bits == 8 ? _mm512_maskz_cvtepi8_epi32(0xFFFF, bytes)
                                                   : _mm512_maskz_cvtepu8_epi32(0xFFFF, bytes));
  if constexpr (Bits == 4) wide = Shift ? wide >> 4 : wide & 0x0F;
  return reinterpret_cast<Lanes>(__builtin_convertvector(wide, f32x16));
}
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
inline Lanes load_halves(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <int Bits, int Shift>
inline Lanes code_lanes(const uint8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (Bits == 8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  const __m256i wide = _mm256_cvtepu8_epi32(bytes);
  return _mm256_cvtepi32_ps(Shift ? _mm256_srli_epi32(wide, 4)
                                  : _mm256_and_si256(wide, _mm256_set1_epi32(0x0F)));
}
#endif
constexpr int kPanelLanes = kPanel / kLanes;
// A work item's rows: a prefill's calls are cut into blocks whose activations stay in L2 while
// the item's panels stream past them (96 rows of K = 1536: 590 KB).
constexpr int64_t kRowBlock = 96;
static_assert(kRowBlock % kMostRows == 0, "row blocks are whole passes");
constexpr int64_t kCodeBlock = 32;  // coded weights: rows of k sharing a scale and an offset
constexpr int kFloat = 32;          // Panels<kFloat>: float32 panels
// Coded panels: calls of up to this many passes of rows decode in the tiles, each pass again;
// longer ones decode an item's panels once into a float32 scratch ([576 x 1536] x 30, 2
// threads, one run: 8 rows 2.0 ms decoding in both passes against 3.2-3.6 with the scratch;
// 13-32 rows within the noise of each other; 128 rows 15.7 against 20.8 ms decoding in all).
constexpr int64_t kInlinePasses = 2;

// Adjacent panels of a weight: float32 [panel][k][32] (Bits 32), or codes [panel][k][kRowBytes]
// (4 bits: byte j of a row holds column j in its low nibble and j + 16 in its high one; 8 bits:
// int8) with float16 parameters [panel][k / 32][2][32] (a block's scales, then its offsets).
template <int Bits>
struct Panels {
  static constexpr int64_t kRowBytes = Bits == kFloat ? kPanel * 4 : kPanel * Bits / 8;
  const uint8_t* data = nullptr;
  const uint16_t* params = nullptr;
  int64_t k = 0;

  Panels at(int64_t panel) const {
    return {data + panel * k * kRowBytes,
            Bits == kFloat ? nullptr : params + panel * (k / kCodeBlock) * 2 * kPanel, k};
  }
  // Lanes c (kLanes columns from c * kLanes) of row i of panel p, decoded.
  template <int C>
  Lanes weights(int64_t i, const Lanes* scale, const Lanes* offset) const {
    constexpr int p = C / kPanelLanes, column = C % kPanelLanes * kLanes;
    const uint8_t* row = data + (p * k + i) * kRowBytes;
    if constexpr (Bits == kFloat) {
      return load_lanes(reinterpret_cast<const float*>(row) + column);
    } else {
      constexpr int byte = Bits == 4 ? column % 16 : column, shift = Bits == 4 ? column / 16 : 0;
      // exact: the code times a float16 scale has at most 19 significant bits
      return fma_lanes(code_lanes<Bits, shift>(row + byte), scale[C], offset[C]);
    }
  }
  // The scales and offsets of block `block` of the tile's columns.
  template <int Columns>
  void block_params(int64_t block, Lanes* scale, Lanes* offset) const {
#pragma GCC unroll 8
    for (int c = 0; c < Columns; ++c) {
      const uint16_t* at = params + ((c / kPanelLanes) * (k / kCodeBlock) + block) * 2 * kPanel +
                           c % kPanelLanes * kLanes;
      scale[c] = load_halves(at);
      offset[c] = load_halves(at + kPanel);
    }
  }
};

// w[c] = the tile's lanes c of row i, for c in [0, Columns).
template <int Bits, int Columns, int C = 0>
inline void tile_weights(const Panels<Bits>& panels, int64_t i, const Lanes* scale,
                         const Lanes* offset, Lanes* w) {
  if constexpr (C < Columns) {
    w[C] = panels.template weights<C>(i, scale, offset);
    tile_weights<Bits, Columns, C + 1>(panels, i, scale, offset, w);
  }
}

// The lines [first, end) of `next` to bring into L2 while a pass runs, one a step of k.
struct Prefetch {
  const char* next = nullptr;
  int64_t first = 0, end = 0;
};

// y[R rows, P panels' columns] = a[R rows, k] @ panels (P of them): a's rows k apart, y's n
// apart. Coded panels are decoded a row at a time, a block's parameters loaded at its start.
template <int R, int P, int Bits>
void tile(const float* a, const Panels<Bits>& panels, float* y, int64_t n, Prefetch ahead) {
  constexpr int kColumns = P * kPanelLanes;
  const int64_t k = panels.k;
  Lanes totals[R][kColumns];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < kColumns; ++c) totals[r][c] = zero_lanes();
  const int64_t step = Bits == kFloat ? k : kCodeBlock;
  for (int64_t block = 0; block < k; block += step) {
    Lanes scale[kColumns], offset[kColumns];
    if constexpr (Bits != kFloat) panels.template block_params<kColumns>(block / step, scale, offset);
    for (int64_t i = block; i < block + step; ++i) {
      Lanes w[kColumns];
      tile_weights<Bits, kColumns>(panels, i, scale, offset, w);
      if (ahead.first + i < ahead.end)
        _mm_prefetch(ahead.next + (ahead.first + i) * 64, _MM_HINT_T1);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const Lanes x = broadcast(a[r * k + i]);
#pragma GCC unroll 8
        for (int c = 0; c < kColumns; ++c) totals[r][c] = fma_lanes(x, w[c], totals[r][c]);
      }
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
template <int R, int P, int Bits>
void tile_of(int64_t rows, const float* a, const Panels<Bits>& panels, float* y, int64_t n,
             Prefetch ahead) {
  if constexpr (R > 1) {
    if (rows < R) return tile_of<R - 1, P>(rows, a, panels, y, n, ahead);
  }
  tile<R, P>(a, panels, y, n, ahead);
}

// The float32 panels [count][k][32] of `count` coded panels, into `out`.
template <int Bits>
void decode_panels(const Panels<Bits>& panels, int64_t count, float* out) {
  const int64_t k = panels.k;
  for (int64_t p = 0; p < count; ++p) {
    const Panels<Bits> panel = panels.at(p);
    for (int64_t block = 0; block < k / kCodeBlock; ++block) {
      Lanes scale[kPanelLanes], offset[kPanelLanes];
      panel.template block_params<kPanelLanes>(block, scale, offset);
      for (int64_t i = block * kCodeBlock; i < (block + 1) * kCodeBlock; ++i) {
        Lanes w[kPanelLanes];
        tile_weights<Bits, kPanelLanes>(panel, i, scale, offset, w);
#pragma GCC unroll 4
        for (int c = 0; c < kPanelLanes; ++c)
          store_lanes(out + (p * k + i) * kPanel + c * kLanes, w[c]);
      }
    }
  }
}

// Rows [first, end) of y by `count` panels (the item's, `panels` at its first, which is panel
// `panel` of the weight), passes of kMostRows rows. The first pass streams the panels from
// memory; the others read them from L2 and bring in `next` (the lines of the work item this
// thread takes next), a line a step: the first pass's products alone need ~4x the bandwidth a
// core gets, and without this the next item's first pass waited on memory (SmolLM2's [576 x
// 1536], 30 weights, 32 rows: 4.8-5.0 -> 3.7-3.8 ms in a harness). With silu_and_mul, the panels
// are a pair (gate, up) and y's rows (ldy apart) get silu(gate) * up, 32 columns at panel / 2.
// Coded panels and more than kInlinePasses passes: decoded once into a float32 scratch first.
template <int Bits>
void rows_by_panels(const float* a, int64_t first, int64_t end, const Panels<Bits>& panels,
                    int64_t panel, int64_t count, float* y, int64_t ldy, bool silu_and_mul,
                    const char* next, int64_t next_lines) {
  const int64_t k = panels.k;
  if constexpr (Bits != kFloat) {
    if (end - first > kInlinePasses * kMostRows) {
      thread_local std::vector<float> scratch;
      scratch.resize(count * k * kPanel);
      decode_panels(panels, count, scratch.data());
      const Panels<kFloat> decoded{reinterpret_cast<const uint8_t*>(scratch.data()), nullptr, k};
      return rows_by_panels(a, first, end, decoded, panel, count, y, ldy, silu_and_mul, next,
                            next_lines);
    }
  }
  for (int64_t row = first, pass = 0; row < end; row += kMostRows, ++pass) {
    const int64_t rows = std::min<int64_t>(kMostRows, end - row);
    const float* x = a + row * k;
    // (coded panels: the first pass too; its decoding leaves memory time to spare)
    const int64_t skip = Bits == kFloat ? next_lines : 0;
    const Prefetch ahead{next, pass == 0 ? skip : (pass - 1) * k, next_lines};
    if (!silu_and_mul) {
      float* out = y + row * ldy + panel * kPanel;
      if (kMostPanels == 2 && count == 2)
        tile_of<kMostRows, kMostPanels>(rows, x, panels, out, ldy, ahead);
      else
        tile_of<kMostRows, 1>(rows, x, panels, out, ldy, ahead);
      continue;
    }
    // The pair's products, rows of 64 in L1, then the activation: the gate/up product never
    // leaves the core (SiluAndMul read it back, 12 MB a layer for 1024 rows).
    alignas(64) float products[kMostRows * 2 * kPanel];
    if constexpr (kMostPanels == 2) {
      tile_of<kMostRows, 2>(rows, x, panels, products, 2 * kPanel, ahead);
    } else {
      tile_of<kMostRows, 1>(rows, x, panels, products, 2 * kPanel, ahead);
      tile_of<kMostRows, 1>(rows, x, panels.at(1), products + kPanel, 2 * kPanel, ahead);
    }
    float* out = y + row * ldy + panel / 2 * kPanel;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < kPanel; c += 16) {
        const float* gate = products + r * 2 * kPanel + c;
        store16(out + r * ldy + c, silu16(load16(gate)) * load16(gate + kPanel));
      }
  }
}

// The call's items (PackedMatMul::compute) on the weight's panels `all`.
template <int Bits>
OrtStatus* run_items(OrtKernelContext* context, const float* x, int64_t rows,
                     const Panels<Bits>& all, int64_t n, float* y, bool silu_and_mul) {
  // Items of kMostPanels panels by kRowBlock rows, a row block's items adjacent. onnxruntime's
  // ParallelFor (num_batch 0: its TrySimpleParallelFor) hands each thread items in order from
  // its own share of the range, so item i + 1 is most often the one a thread takes next: its
  // panels are what rows_by_panels prefetches (the measured gain bears that out).
  const int64_t ldy = silu_and_mul ? n / 2 : n;
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
    rows_by_panels(x, row, std::min(row + kRowBlock, rows), all.at(panel), panel,
                   std::min<int64_t>(per_item, panels - panel), y, ldy, silu_and_mul,
                   reinterpret_cast<const char*>(all.at(next_panel).data),
                   last ? 0 : next_count * all.k * Panels<Bits>::kRowBytes / 64);
  };
  return parallel_for(context, static_cast<size_t>(items), item);
}

}  // namespace

OrtStatus* PackedMatMul::init(const OrtKernelInfo* info) {
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "K", &k));
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "N", &n));
  const int64_t multiple = silu_and_mul ? 2 * kPanel : kPanel;
  // (coded weights: whole blocks of kCodeBlock rows of k)
  const int64_t k_multiple = bits == kFloat ? 1 : kCodeBlock;
  if (k <= 0 || n <= 0 || n % multiple != 0 || k % k_multiple != 0)
    return invalid(op_name() + ": expected K > 0" +
                   (k_multiple > 1 ? " a multiple of " + std::to_string(k_multiple) : "") +
                   " and N a positive multiple of " + std::to_string(multiple) +
                   ", got K=" + std::to_string(k) + ", N=" + std::to_string(n));
  return nullptr;
}

std::string PackedMatMul::op_name() const {
  const std::string base = bits == kFloat ? "PackedMatMul"
                                          : "LosslessMatMul" + std::to_string(bits) + "Bits";
  return silu_and_mul ? base + "SiluAndMul" : base;
}

OrtStatus* PackedMatMul::compute(OrtKernelContext* context) const {
  Tensor a, b;
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 0, &a));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 1, &b));
  if (a.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || a.dims.empty() || a.dims.back() != k)
    return invalid(op_name() + ": a: expected float32 [..., " + std::to_string(k) + "], got " +
                   type_name(a.type) + " " + a.shape());
  const auto expect = [&](const char* name, const Tensor& t, ONNXTensorElementDataType type,
                          const std::vector<int64_t>& dims) -> OrtStatus* {
    if (t.type == type && t.dims == dims) return nullptr;
    return invalid(op_name() + ": " + name + ": expected " + type_name(type) + " " +
                   format_dims(dims) + ", got " + type_name(t.type) + " " + t.shape());
  };
  const int64_t panels = n / kPanel;
  Tensor params;
  if (bits == kFloat) {
    ATTNEXPORT_RETURN_IF_ERROR(
        expect("b", b, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT, {panels, k, kPanel}));
  } else {
    ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 2, &params));
    ATTNEXPORT_RETURN_IF_ERROR(expect(
        "codes", b, bits == 4 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8,
        {panels, k, kPanel * bits / 8}));
    ATTNEXPORT_RETURN_IF_ERROR(expect("params", params, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16,
                                      {panels, k / kCodeBlock, 2, kPanel}));
  }
  std::vector<int64_t> out_dims = a.dims;
  out_dims.back() = silu_and_mul ? n / 2 : n;
  Tensor out;
  ATTNEXPORT_RETURN_IF_ERROR(make_output(context, 0, out_dims, &out));
  const int64_t rows = a.numel() / k;
  if (rows == 0) return nullptr;
  const auto* x = static_cast<const float*>(a.data);
  auto* y = static_cast<float*>(out.data);
  const auto* data = static_cast<const uint8_t*>(b.data);
  const auto* halves = static_cast<const uint16_t*>(params.data);
  switch (bits) {
    case 4:
      return run_items(context, x, rows, Panels<4>{data, halves, k}, n, y, silu_and_mul);
    case 8:
      return run_items(context, x, rows, Panels<8>{data, halves, k}, n, y, silu_and_mul);
    default:
      return run_items(context, x, rows, Panels<kFloat>{data, nullptr, k}, n, y, silu_and_mul);
  }
}

}  // namespace attnexport
