#pragma once

#include <onnxruntime_c_api.h>

namespace attnexport {

// attnexport.NeoxRotaryEmbedding: x [T, H, D] rotated by the per-token tables cos, sin [T, D]
// (rotate-half layout), float32, float16 or bfloat16 with math in float32.
struct NeoxRotaryEmbedding {
  OrtStatus* init(const OrtKernelInfo*) { return nullptr; }
  OrtStatus* compute(OrtKernelContext* context) const;
};

}  // namespace attnexport
