#pragma once

#include <onnxruntime_c_api.h>

#include <cstdint>

namespace attnexport {

// attnexport.NeoxRotaryEmbedding: x [T, H, D] rotated by the per-token tables cos, sin [T, D]
// (rotate-half layout), float32, float16 or bfloat16 with math in float32.
struct NeoxRotaryEmbedding {
  OrtStatus* init(const OrtKernelInfo*) { return nullptr; }
  OrtStatus* compute(OrtKernelContext* context) const;
};

// attnexport.NeoxQKVRotaryEmbedding: qkv [T, (H + 2 Hkv) * D] -> query [T, H, D] and key
// [T, Hkv, D] rotated like NeoxRotaryEmbedding, value [T, Hkv, D] copied.
struct NeoxQKVRotaryEmbedding {
  int64_t num_heads = 0, num_kv_heads = 0, head_size = 0;
  OrtStatus* init(const OrtKernelInfo* info);
  OrtStatus* compute(OrtKernelContext* context) const;
};

}  // namespace attnexport
