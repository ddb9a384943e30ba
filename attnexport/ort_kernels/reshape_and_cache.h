#pragma once

#include <onnxruntime_c_api.h>

#include <cstdint>

namespace attnexport {

// attnexport.ReshapeAndCache: writes key/value [T, Hkv, D] at slot_mapping [T] (int32 or
// int64; negative = padding, skipped) into the caches and returns them as its two outputs; with
// int8 caches also the scale caches [num_blocks, block_size, Hkv] (inputs 5, 6; outputs 2, 3).
struct ReshapeAndCache {
  int64_t block_size = 0;

  OrtStatus* init(const OrtKernelInfo* info);
  OrtStatus* compute(OrtKernelContext* context) const;
};

}  // namespace attnexport
