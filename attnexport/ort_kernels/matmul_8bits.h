#pragma once

#include <onnxruntime_c_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernel_api.h"

namespace attnexport {

// Tile pairs of a fused node's work items: columns `c` and `c + stride` within each `period`
// columns (stride 0: none).
struct TilePairs {
  int64_t stride = 0, period = 0;
};

// attnexport.MatMul8Bits: a[..., K] float32 @ W -> [..., N] float32, W stored as onnxruntime's
// 8-bit MatMulNBits stores it: b [N, blocks, block_size] uint8 (K zero-padded to whole blocks),
// scales [N * blocks] float32 or float16, zero_points uint8 [N * blocks], float32 or float16
// [N * blocks] or one uint8 for every block;
// W[k, n] = (b[n, k] - zero_point[n, k / block_size]) * scale[...].
// The kernel rounds each row's blocks of activations to int16 (MatMulNBits' int8 path rounds
// them to 8 bits); the function body multiplies them as float32. With the attribute
// batch_invariant = 0, 8-bit blocks over 256 multiply calls of many rows as float32 activations
// by float32 panels of the dequantized weights (a row's numbers then depend on its call's row
// count); every other node's integer path is faster than the panels and takes those calls too.
struct MatMul8Bits {
  int64_t k = 0, n = 0, block_size = 0, batch_invariant = 1;
  // Calls of at least this many rows (a prefill's) round the activations to int8 steps, not
  // int16 (0: never): on AVX512_VNNI their products take vpdpbusd, 4 a lane an instruction.
  int64_t int8_from_rows = 0;
  int64_t bits = 8;  // of the weights: 8, or 4 for MatMul4Bits
  bool silu_and_mul = false;  // MatMul8BitsSiluAndMul, MatMul4BitsSiluAndMul
  bool qkv_rotary = false;    // MatMul8BitsQKVRotary, MatMul4BitsQKVRotary: their attributes
  int64_t num_heads = 0, num_kv_heads = 0, head_size = 0;
  // Copies made at kernel creation when the scales and zero points are initializers
  // (matmul_8bits.cc), else empty: the block parameters in the lanes' layout, in
  // float16 (half_lanes, with the tiles, where they are float16 values) or else float32
  // (lane_parameters); an initializer's weights as tiles of 16 columns side by side.
  std::vector<float> lane_parameters;
  // Float16 initializer scales and zero points (the lowering stores them so) as float32, made
  // at kernel creation: the scales, then the zero points, as far as each is float16.
  std::vector<float> float_parameters;
  std::vector<uint16_t> half_lanes;
  std::vector<uint8_t> tiles;
  // Inputs 1-3 (b, scales, zero points) when all three are initializers, read once at kernel
  // creation (their data is the session's, fixed): compute reads only input 0 then. (Reading
  // an input through the C API, its type, shape and data, costs a few allocations and calls: a
  // chain of 200 one-row [576 x 576] 4-bit nodes, 2 threads, 5.9-6.4 -> 5.7-6.1 us a node.)
  bool initializer_inputs = false;
  Tensor initializer_b, initializer_scales, initializer_zero_points;
  OrtStatus* init(const OrtKernelInfo* info);
  OrtStatus* compute(OrtKernelContext* context) const;
  // The tile pairs of the fused forms' work items (matmul_8bits.cc, tile_slot).
  TilePairs tile_pairs() const {
    if (silu_and_mul) return {n / 2, n};
    if (qkv_rotary) return {head_size / 2, head_size};
    return {};
  }
  std::string op_name() const {
    return std::string(bits == 4 ? "MatMul4Bits" : "MatMul8Bits") +
           (silu_and_mul ? "SiluAndMul" : qkv_rotary ? "QKVRotary" : "");
  }
};

// attnexport.MatMul4Bits: MatMul8Bits on 4-bit weights, MatMulNBits' 4-bit storage: b
// [N, blocks, block_size / 2] uint8, weight 2j of a block in byte j's low nibble and 2j + 1 in
// its high one; zero points float32 or float16 [N * blocks] (HQQ's), uint8 [N * blocks] (one a byte, not
// MatMulNBits' packed nibbles) or one uint8 for every block (8: symmetric).
struct MatMul4Bits : MatMul8Bits {
  MatMul4Bits() { bits = 4; }
};

// attnexport.MatMul8BitsSiluAndMul / MatMul4BitsSiluAndMul: SiluAndMul(MatMul8Bits(...)) ->
// [..., N / 2], the gate's columns [0, N / 2) of W, the up projection's [N / 2, N) (N a multiple
// of 32): each work item computes 16 columns of each half into a scratch and writes
// silu(gate) * up; the product of N columns is never stored. The same numbers as the two nodes.
struct MatMul8BitsSiluAndMul : MatMul8Bits {
  MatMul8BitsSiluAndMul() { silu_and_mul = true; }
};
struct MatMul4BitsSiluAndMul : MatMul8Bits {
  MatMul4BitsSiluAndMul() { bits = 4, silu_and_mul = true; }
};

// attnexport.MatMul8BitsQKVRotary / MatMul4BitsQKVRotary: NeoxQKVRotaryEmbedding(MatMul8Bits(a,
// b, scales, zero_points), cos, sin) -> query [T, H, D], key [T, Hkv, D], value [T, Hkv, D] (a
// [T, K]; cos, sin float32 [T, D]; N = (H + 2 Hkv) * D, D a multiple of 32): a work item
// computes lanes [16j, 16j + 16) of both halves of a query or key head into a scratch and
// writes them rotated, or 16 columns of a value head straight into `value`; the [T, N] product
// is never stored. The same numbers as the two nodes.
struct MatMul8BitsQKVRotary : MatMul8Bits {
  MatMul8BitsQKVRotary() { qkv_rotary = true; }
};
struct MatMul4BitsQKVRotary : MatMul8Bits {
  MatMul4BitsQKVRotary() { bits = 4, qkv_rotary = true; }
};

}  // namespace attnexport
