// attnexport.FusedAddRMSNorm for onnxruntime's CPU execution provider: one node instead of an Add
// and a SimplifiedLayerNormalization, each row read once for the sum and once for the scaling.
//
// Per row: t = T(x + residual) is written to residual_out; s = sqrt(mean(t^2) + epsilon);
// output = T(weight * T(t / s)): the same roundings as the torch op (a division, not a product
// by 1 / s, so that float32 rows match it to the summation order of the mean).

#include "fused_add_rms_norm.h"

#include <cmath>
#include <vector>

#include "kernel_api.h"
#include "vector_math.h"

namespace attnexport {
namespace {

// total[0:n] <- T(x + residual); returns the sum of the squares of the rounded values.
template <typename T>
float add_rows(const T* x, const T* residual, T* total, int64_t n) {
  Accumulator16 squares;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    store16_float(total + i, load16_float(x + i) + load16_float(residual + i));
    const f32x16 t = load16_float(total + i);
    squares.add_product(t, t);
  }
  float sum = horizontal_sum(squares.value());
  for (; i < n; ++i) {
    total[i] = from_float<T>(to_float(x[i]) + to_float(residual[i]));
    const float t = to_float(total[i]);
    sum += t * t;
  }
  return sum;
}

template <typename T>
void norm_rows(const T* x, const T* residual, const T* weight, T* out, T* total, int64_t first_row,
               int64_t end_row, int64_t hidden, float epsilon) {
  for (int64_t row = first_row; row < end_row; ++row) {
    const int64_t offset = row * hidden;
    const float sum_squares = add_rows(x + offset, residual + offset, total + offset, hidden);
    const float scale = std::sqrt(sum_squares / static_cast<float>(hidden) + epsilon);
    const T* t = total + offset;
    T* dst = out + offset;
    int64_t i = 0;
    if constexpr (std::is_same_v<T, float>) {  // (the loop below is not vectorized)
      const f32x16 scales = splat16(scale);
      for (; i + 16 <= hidden; i += 16) store16(dst + i, load16(weight + i) * (load16(t + i) / scales));
    }
    for (; i < hidden; ++i)
      dst[i] = from_float<T>(to_float(weight[i]) * to_float(from_float<T>(to_float(t[i]) / scale)));
  }
}

template <typename T>
OrtStatus* run(OrtKernelContext* context, const Tensor& x, const Tensor& residual,
               const Tensor& weight, Tensor& out, Tensor& total, float epsilon) {
  const int64_t hidden = x.dims.back(), rows = hidden ? x.numel() / hidden : 0;
  const auto* xs = static_cast<const T*>(x.data);
  const auto* rs = static_cast<const T*>(residual.data);
  const auto* ws = static_cast<const T*>(weight.data);
  auto* outs = static_cast<T*>(out.data);
  auto* totals = static_cast<T*>(total.data);
  return for_row_ranges(context, rows, hidden, [&](int64_t first, int64_t end) {
    norm_rows(xs, rs, ws, outs, totals, first, end, hidden, epsilon);
  });
}

}  // namespace

OrtStatus* FusedAddRMSNorm::init(const OrtKernelInfo* info) {
  return float_attribute(info, "epsilon", &epsilon);
}

OrtStatus* FusedAddRMSNorm::compute(OrtKernelContext* context) const {
  Tensor x, residual, weight;
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 0, &x));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 1, &residual));
  ATTNEXPORT_RETURN_IF_ERROR(read_input(context, 2, &weight));
  if (x.dims.size() < 2)
    return invalid("FusedAddRMSNorm: x: expected [..., num_tokens, hidden], got " + x.shape());
  if (residual.dims != x.dims)
    return invalid("FusedAddRMSNorm: residual: expected " + x.shape() + " (the shape of x), got " +
                   residual.shape());
  const std::vector<int64_t> weight_dims{x.dims.back()};
  if (weight.dims != weight_dims)
    return invalid("FusedAddRMSNorm: weight: expected " + format_dims(weight_dims) +
                   " ([hidden] of x), got " + weight.shape());
  if (element_size(x.type) == 0 || residual.type != x.type || weight.type != x.type)
    return invalid("FusedAddRMSNorm: x, residual and weight must share one float32, float16 or "
                   "bfloat16 dtype");
  Tensor out, total;
  ATTNEXPORT_RETURN_IF_ERROR(make_output(context, 0, x.dims, &out));
  ATTNEXPORT_RETURN_IF_ERROR(make_output(context, 1, x.dims, &total));
  return with_float_type(x.type, [&](auto tag) {
    return run<decltype(tag)>(context, x, residual, weight, out, total, epsilon);
  });
}

}  // namespace attnexport
