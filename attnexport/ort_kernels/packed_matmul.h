#pragma once

#include <onnxruntime_c_api.h>

#include <cstdint>
#include <string>

namespace attnexport {

// attnexport.PackedMatMul: a[..., K] float32 @ W -> [..., N] float32, the constant W [K, N]
// stored as panels of 32 columns: b [N / 32, K, 32] float32, b[p, k, j] = W[k, 32p + j] (N a
// multiple of 32). A panel is one contiguous stream of the columns' weights, k after k, which
// the kernel's register tiles read once per pass of rows (packed_matmul.cc). Every output
// element is the sum over k in order, one fused multiply-add at a time, whatever the call's row
// count or the kernel variant: a row's numbers do not depend on its batch.
struct PackedMatMul {
  int64_t k = 0, n = 0;
  bool silu_and_mul = false;  // PackedMatMulSiluAndMul
  int bits = 32;              // 32: float32 panels; 4 or 8: LosslessMatMul{4,8}Bits' codes
  OrtStatus* init(const OrtKernelInfo* info);
  OrtStatus* compute(OrtKernelContext* context) const;
  std::string op_name() const;
};

// attnexport.PackedMatMulSiluAndMul: SiluAndMul(PackedMatMul(a, b)) -> [..., N / 2], the panels
// in pairs: panel 2q holds the gate's columns [32q, 32q + 32), panel 2q + 1 the up projection's
// (columns N / 2 + 32q on): each work item computes a pair and writes silu(gate) * up, the
// product of N columns never stored (N a multiple of 64).
struct PackedMatMulSiluAndMul : PackedMatMul {
  PackedMatMulSiluAndMul() { silu_and_mul = true; }
};

// attnexport.LosslessMatMul4Bits / LosslessMatMul8Bits (a, codes, params) [SiluAndMul]: the
// same product, its float32 weights stored exactly as codes (lossless_weights.py): codes
// [N / 32, K, 16] uint8 (two 4-bit codes a byte: column j of a panel's row in byte j's low nibble,
// j + 16 in its high one) or [N / 32, K, 32] int8, params [N / 32, K / 32, 2, 32] float16 (each
// block of 32 rows' scales, then offsets); weight = fma(code, scale, offset), the checkpoint's
// float32 number, so the outputs are PackedMatMul's bit for bit (K a multiple of 32).
struct LosslessMatMul4Bits : PackedMatMul {
  LosslessMatMul4Bits() { bits = 4; }
};
struct LosslessMatMul8Bits : PackedMatMul {
  LosslessMatMul8Bits() { bits = 8; }
};
struct LosslessMatMul4BitsSiluAndMul : PackedMatMul {
  LosslessMatMul4BitsSiluAndMul() { bits = 4, silu_and_mul = true; }
};
struct LosslessMatMul8BitsSiluAndMul : PackedMatMul {
  LosslessMatMul8BitsSiluAndMul() { bits = 8, silu_and_mul = true; }
};

}  // namespace attnexport
