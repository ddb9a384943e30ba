#pragma once

#include <onnxruntime_c_api.h>

#include <cstdint>

namespace attnexport {

// attnexport.AddBlockOffsets: y [..., N] float32 + blocksum(a) @ table -> [..., N] float32.
// a [..., K] float32; blocksum(a)[..., b] sums a[..., k] over block b of `block_size` (the last
// block may be short), for the `blocks` = ceil(K / block_size) blocks; offsets [blocks, N] int8
// and offset_scales [ceil(blocks / offset_block_size), N] float32:
// table[b, n] = offsets[b, n] * offset_scales[b / offset_block_size, n]. The offsets half of a
// MatMulNBits with float (HQQ) zero points (lowering/float_zero_points.py).
struct AddBlockOffsets {
  int64_t block_size = 0, offset_block_size = 0;
  OrtStatus* init(const OrtKernelInfo* info);
  OrtStatus* compute(OrtKernelContext* context) const;
};

}  // namespace attnexport
