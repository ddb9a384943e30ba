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
  OrtStatus* init(const OrtKernelInfo* info);
  OrtStatus* compute(OrtKernelContext* context) const;
  std::string op_name() const { return silu_and_mul ? "PackedMatMulSiluAndMul" : "PackedMatMul"; }
};

// attnexport.PackedMatMulSiluAndMul: SiluAndMul(PackedMatMul(a, b)) -> [..., N / 2], the panels
// in pairs: panel 2q holds the gate's columns [32q, 32q + 32), panel 2q + 1 the up projection's
// (columns N / 2 + 32q on): each work item computes a pair and writes silu(gate) * up, the
// product of N columns never stored (N a multiple of 64).
struct PackedMatMulSiluAndMul : PackedMatMul {
  PackedMatMulSiluAndMul() { silu_and_mul = true; }
};

}  // namespace attnexport
