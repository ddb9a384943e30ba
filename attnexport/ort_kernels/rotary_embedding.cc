// attnexport.NeoxRotaryEmbedding for onnxruntime's CPU execution provider: one pass over x instead
// of the ~7 nodes (slices, negation, concatenation, products, sum) of its function body.
//
// With h = D / 2, head row x of token t becomes
//   out[i]     = x[i]     * cos[t, i]     - x[i + h] * sin[t, i]
//   out[i + h] = x[i + h] * cos[t, i + h] + x[i]     * sin[t, i + h]      (i < h).
// Math in float32 (the compiler may fuse a product into the sum: an FMA rounds once).

#include "rotary_embedding.h"

#include <cstring>
#include <string>
#include <vector>

#include "kernel_api.h"
#include "vector_math.h"

namespace attnexport {
namespace {

// Rotates heads [0, heads) of tokens [first_token, end_token): head h of token t is read at
// x + t * x_token_stride + h * head_size and written at out + (t * heads + h) * head_size.
template <typename T>
void rotate_heads(const T* x, int64_t x_token_stride, const T* cos, const T* sin, T* out,
                  int64_t first_token, int64_t end_token, int64_t heads, int64_t head_size) {
  const int64_t half = head_size / 2;
  // 16 lanes at a time where a half is whole vectors (every zoo model's head size; the loop
  // below, which g++ 12 left scalar, ran at a third of FusedAddRMSNorm's bytes a second on a
  // prefill of SmolLM2).
  const int64_t vectors = half % 16 == 0 ? half : 0;
  for (int64_t token = first_token; token < end_token; ++token) {
    const T* c = cos + token * head_size;
    const T* s = sin + token * head_size;
    for (int64_t head = 0; head < heads; ++head) {
      const T* in = x + token * x_token_stride + head * head_size;
      T* dst = out + (token * heads + head) * head_size;
      for (int64_t i = 0; i < vectors; i += 16)
        rotate16(load16_float(in + i), load16_float(in + i + half), c + i, s + i, half, dst + i,
                 dst + i + half);
      for (int64_t i = vectors; i < half; ++i) {
        const float low = to_float(in[i]), high = to_float(in[i + half]);
        const float low_cos = low * to_float(c[i]), high_sin = high * to_float(s[i]);
        const float high_cos = high * to_float(c[i + half]), low_sin = low * to_float(s[i + half]);
        dst[i] = from_float<T>(low_cos - high_sin);
        dst[i + half] = from_float<T>(high_cos + low_sin);
      }
    }
  }
}

template <typename T>
OrtStatus* rotate(OrtKernelContext* context, const Tensor& x, const Tensor& cos, const Tensor& sin,
                  Tensor& out) {
  const int64_t tokens = x.dims[0], heads = x.dims[1], head_size = x.dims[2];
  const auto* xs = static_cast<const T*>(x.data);
  const auto* cs = static_cast<const T*>(cos.data);
  const auto* ss = static_cast<const T*>(sin.data);
  auto* dst = static_cast<T*>(out.data);
  return for_row_ranges(context, tokens, heads * head_size, [&](int64_t first, int64_t end) {
    rotate_heads(xs, heads * head_size, cs, ss, dst, first, end, heads, head_size);
  });
}

// Query and key heads rotated out of the fused rows, value heads copied.
template <typename T>
OrtStatus* split_rotate(OrtKernelContext* context, const Tensor& qkv, const Tensor& cos,
                        const Tensor& sin, Tensor* outs, int64_t heads, int64_t kv_heads) {
  const int64_t tokens = qkv.dims[0], head_size = cos.dims[1], width = qkv.dims[1];
  const auto* xs = static_cast<const T*>(qkv.data);
  const auto* cs = static_cast<const T*>(cos.data);
  const auto* ss = static_cast<const T*>(sin.data);
  auto* query = static_cast<T*>(outs[0].data);
  auto* key = static_cast<T*>(outs[1].data);
  auto* value = static_cast<T*>(outs[2].data);
  const int64_t kv_width = kv_heads * head_size;
  return for_row_ranges(context, tokens, width, [&](int64_t first, int64_t end) {
    rotate_heads(xs, width, cs, ss, query, first, end, heads, head_size);
    rotate_heads(xs + heads * head_size, width, cs, ss, key, first, end, kv_heads, head_size);
    for (int64_t token = first; token < end; ++token)
      std::memcpy(value + token * kv_width, xs + token * width + width - kv_width,
                  kv_width * sizeof(T));
  });
}

// Reads the rows to rotate (input 0) and the cos, sin tables (inputs 1, 2).
OrtStatus* read_inputs(OrtKernelContext* context, Tensor* x, Tensor* cos, Tensor* sin) {
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 0, x));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 1, cos));
  return read_input(context, 2, sin);
}

// The cos, sin tables of node `op` are `table_dims` (described by `layout`) and share the float
// dtype of the rows to rotate, `x` (its input name `x_name`).
OrtStatus* check_tables(const char* op, const char* x_name, const Tensor& x, const Tensor& cos,
                        const Tensor& sin, const std::vector<int64_t>& table_dims,
                        const char* layout) {
  const std::string node = std::string(op) + ": ";
  if (cos.dims != table_dims || sin.dims != table_dims)
    return invalid(node + "cos, sin: expected " + format_dims(table_dims) + " (" + layout +
                   "), got " + cos.shape() + " and " + sin.shape());
  if (element_size(x.type) == 0 || cos.type != x.type || sin.type != x.type)
    return invalid(node + x_name + ", cos and sin must share one float32, float16 or bfloat16 "
                   "dtype");
  return nullptr;
}

}  // namespace

OrtStatus* NeoxRotaryEmbedding::compute(OrtKernelContext* context) const {
  Tensor x, cos, sin;
  ATTNEXPORT_RETURN_IF_ERROR(read_inputs(context, &x, &cos, &sin));
  if (x.dims.size() != 3 || x.dims[2] % 2 != 0)
    return invalid("NeoxRotaryEmbedding: x: expected [num_tokens, num_heads, head_size] with an even "
                   "head_size, got " + x.shape());
  ATTNEXPORT_RETURN_IF_ERROR(check_tables("NeoxRotaryEmbedding", "x", x, cos, sin,
                                          {x.dims[0], x.dims[2]}, "[num_tokens, head_size] of x"));
  Tensor out;
  ATTNEXPORT_RETURN_IF_ERROR(make_output(context, 0, x.dims, &out));
  return with_float_type(x.type, [&](auto tag) {
    return rotate<decltype(tag)>(context, x, cos, sin, out);
  });
}

OrtStatus* NeoxQKVRotaryEmbedding::init(const OrtKernelInfo* info) {
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "num_heads", &num_heads));
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "num_kv_heads", &num_kv_heads));
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(info, "head_size", &head_size));
  if (num_heads < 1 || num_kv_heads < 1 || head_size < 2 || head_size % 2 != 0)
    return invalid("NeoxQKVRotaryEmbedding: expected positive num_heads and num_kv_heads and an "
                   "even head_size");
  return nullptr;
}

OrtStatus* NeoxQKVRotaryEmbedding::compute(OrtKernelContext* context) const {
  Tensor qkv, cos, sin;
  ATTNEXPORT_RETURN_IF_ERROR(read_inputs(context, &qkv, &cos, &sin));
  const int64_t width = (num_heads + 2 * num_kv_heads) * head_size;
  if (qkv.dims.size() != 2 || qkv.dims[1] != width)
    return invalid("NeoxQKVRotaryEmbedding: qkv: expected [num_tokens, " + std::to_string(width) +
                   "] ((num_heads + 2 * num_kv_heads) * head_size), got " + qkv.shape());
  ATTNEXPORT_RETURN_IF_ERROR(check_tables("NeoxQKVRotaryEmbedding", "qkv", qkv, cos, sin,
                                          {qkv.dims[0], head_size}, "[num_tokens, head_size]"));
  Tensor outs[3];
  const int64_t counts[3] = {num_heads, num_kv_heads, num_kv_heads};
  for (size_t i = 0; i < 3; ++i)
    ATTNEXPORT_RETURN_IF_ERROR(make_output(context, i, {qkv.dims[0], counts[i], head_size}, &outs[i]));
  return with_float_type(qkv.type, [&](auto tag) {
    return split_rotate<decltype(tag)>(context, qkv, cos, sin, outs, num_heads, num_kv_heads);
  });
}

}  // namespace attnexport
