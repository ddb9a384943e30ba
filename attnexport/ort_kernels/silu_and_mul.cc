// attnexport.SiluAndMul for onnxruntime's CPU execution provider: one pass instead of the split,
// sigmoid and two products of its function body (whose split copies both halves first).
//
// silu16 (vector_math.h) computes silu(gate) 16 lanes at a time.

#include "silu_and_mul.h"

#include "kernel_api.h"
#include "vector_math.h"

namespace attnexport {
namespace {

template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t first_row, int64_t end_row, int64_t d) {
  for (int64_t row = first_row; row < end_row; ++row) {
    const T* gate = x + row * 2 * d;
    const T* up = gate + d;
    T* dst = out + row * d;
    int64_t i = 0;
    for (; i + 16 <= d; i += 16)
      store16_float(dst + i, silu16(load16_float(gate + i)) * load16_float(up + i));
    if (i == d) continue;
    T gate_tail[16] = {}, up_tail[16] = {}, result[16];  // zero-filled past the row's end
    for (int64_t j = i; j < d; ++j) gate_tail[j - i] = gate[j], up_tail[j - i] = up[j];
    store16_float(result, silu16(load16_float(gate_tail)) * load16_float(up_tail));
    for (int64_t j = i; j < d; ++j) dst[j] = result[j - i];
  }
}

template <typename T>
OrtStatus* run(OrtKernelContext* context, const Tensor& x, Tensor& out) {
  const int64_t d = x.dims.back() / 2, rows = d ? x.numel() / (2 * d) : 0;
  const auto* xs = static_cast<const T*>(x.data);
  auto* dst = static_cast<T*>(out.data);
  return for_row_ranges(context, rows, 2 * d, [&](int64_t first, int64_t end) {
    silu_and_mul_rows(xs, dst, first, end, d);
  });
}

}  // namespace

OrtStatus* SiluAndMul::compute(OrtKernelContext* context) const {
  Tensor x;
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 0, &x));
  if (x.dims.size() < 2 || x.dims.back() % 2 != 0)
    return invalid("SiluAndMul: x: expected [..., num_tokens, 2 * d] (an even last dim), got " +
                   x.shape());
  if (element_size(x.type) == 0)
    return invalid("SiluAndMul: x: expected float32, float16 or bfloat16");
  Tensor out;
  std::vector<int64_t> out_dims = x.dims;
  out_dims.back() /= 2;
  ATTNEXPORT_RETURN_IF_ERROR(make_output(context, 0, out_dims, &out));
  return with_float_type(x.type, [&](auto tag) {
    return run<decltype(tag)>(context, x, out);
  });
}

}  // namespace attnexport
