// attnexport.NeoxRotaryEmbedding for onnxruntime's CPU execution provider: one pass over x instead
// of the ~7 nodes (slices, negation, concatenation, products, sum) of its function body.
//
// With h = D / 2, head row x of token t becomes
//   out[i]     = x[i]     * cos[t, i]     - x[i + h] * sin[t, i]
//   out[i + h] = x[i + h] * cos[t, i + h] + x[i]     * sin[t, i + h]      (i < h).
// Math in float32 (the compiler may fuse a product into the sum: an FMA rounds once).

#include "rotary_embedding.h"

#include <string>
#include <vector>

#include "kernel_api.h"
#include "vector_math.h"

namespace attnexport {
namespace {

template <typename T>
void rotate_rows(const T* x, const T* cos, const T* sin, T* out, int64_t first_row, int64_t end_row,
                 int64_t heads, int64_t head_size) {
  const int64_t half = head_size / 2;
  for (int64_t row = first_row; row < end_row; ++row) {
    const int64_t token = row / heads;
    const T* c = cos + token * head_size;
    const T* s = sin + token * head_size;
    const T* in = x + row * head_size;
    T* dst = out + row * head_size;
    for (int64_t i = 0; i < half; ++i) {
      const float low = to_float(in[i]), high = to_float(in[i + half]);
      const float low_cos = low * to_float(c[i]), high_sin = high * to_float(s[i]);
      const float high_cos = high * to_float(c[i + half]), low_sin = low * to_float(s[i + half]);
      dst[i] = from_float<T>(low_cos - high_sin);
      dst[i + half] = from_float<T>(high_cos + low_sin);
    }
  }
}

template <typename T>
OrtStatus* run(OrtKernelContext* context, const Tensor& x, const Tensor& cos, const Tensor& sin,
               Tensor& out) {
  const int64_t rows = x.dims[0] * x.dims[1];
  const int64_t heads = x.dims[1], head_size = x.dims[2];
  const auto* xs = static_cast<const T*>(x.data);
  const auto* cs = static_cast<const T*>(cos.data);
  const auto* ss = static_cast<const T*>(sin.data);
  auto* dst = static_cast<T*>(out.data);
  return for_row_ranges(context, rows, head_size, [&](int64_t first, int64_t end) {
    rotate_rows(xs, cs, ss, dst, first, end, heads, head_size);
  });
}

}  // namespace

OrtStatus* NeoxRotaryEmbedding::compute(OrtKernelContext* context) const {
  Tensor x, cos, sin;
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 0, &x));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 1, &cos));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 2, &sin));
  if (x.dims.size() != 3 || x.dims[2] % 2 != 0)
    return invalid("NeoxRotaryEmbedding: x: expected [num_tokens, num_heads, head_size] with an even "
                   "head_size, got " + x.shape());
  const std::vector<int64_t> table_dims{x.dims[0], x.dims[2]};
  if (cos.dims != table_dims || sin.dims != table_dims)
    return invalid("NeoxRotaryEmbedding: cos, sin: expected " + format_dims(table_dims) +
                   " ([num_tokens, head_size] of x), got " + cos.shape() + " and " + sin.shape());
  if (element_size(x.type) == 0 || cos.type != x.type || sin.type != x.type)
    return invalid("NeoxRotaryEmbedding: x, cos and sin must share one float32, float16 or bfloat16 "
                   "dtype");
  Tensor out;
  ATTNEXPORT_RETURN_IF_ERROR(make_output(context, 0, x.dims, &out));
  switch (x.type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
      return run<Half>(context, x, cos, sin, out);
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
      return run<BFloat16>(context, x, cos, sin, out);
    default:
      return run<float>(context, x, cos, sin, out);
  }
}

}  // namespace attnexport
