#pragma once

#include <onnxruntime_c_api.h>

namespace attnexport {

// attnexport.FusedAddRMSNorm: x, residual [T, hidden], weight [hidden] -> output = weight *
// rms_norm(x + residual), residual_out = x + residual; float32, float16 or bfloat16 with math
// in float32, roundings where the torch op rounds.
struct FusedAddRMSNorm {
  float epsilon = 0.0f;
  OrtStatus* init(const OrtKernelInfo* info);
  OrtStatus* compute(OrtKernelContext* context) const;
};

}  // namespace attnexport
