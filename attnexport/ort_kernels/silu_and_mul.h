#pragma once

#include <onnxruntime_c_api.h>

namespace attnexport {

// attnexport.SiluAndMul: x [T, 2d] -> silu(x[:, :d]) * x[:, d:] [T, d], float32, float16 or
// bfloat16 with math in float32.
struct SiluAndMul {
  OrtStatus* init(const OrtKernelInfo*) { return nullptr; }
  OrtStatus* compute(OrtKernelContext* context) const;
};

}  // namespace attnexport
