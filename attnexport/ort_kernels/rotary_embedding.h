#pragma once

#include <onnxruntime_c_api.h>

#include <cstdint>

#include "vector_math.h"

namespace attnexport {

// Lanes [i, i + 16) of a head's rotation, the halves' values low = x[i..], high = x[half + i..]
// already loaded: out_low = low * cos[i] - high * sin[i], out_high = high * cos[half + i] + low *
// sin[half + i] (`cos`, `sin`: the token's tables at i; `out_low`, `out_high`: the destination
// at i and half + i). The one place both kernels rotate (NeoxQKVRotaryEmbedding and the QKV
// projection that writes it, matmul_8bits.cc): the same operations, the same bits.
template <typename T>
inline void rotate16(f32x16 low, f32x16 high, const T* cos, const T* sin, int64_t half,
                     T* out_low, T* out_high) {
  store16_float(out_low, low * load16_float(cos) - high * load16_float(sin));
  store16_float(out_high, high * load16_float(cos + half) + low * load16_float(sin + half));
}

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
