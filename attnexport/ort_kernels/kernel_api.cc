#include "kernel_api.h"

namespace attnexport {
namespace {
const OrtApi* g_api = nullptr;
}

const OrtApi& api() { return *g_api; }
void set_api(const OrtApi* api) { g_api = api; }

OrtStatus* invalid(const std::string& message) {
  return api().CreateStatus(ORT_INVALID_ARGUMENT, message.c_str());
}

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

std::string format_dims(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

std::string Tensor::shape() const { return format_dims(dims); }

size_t element_size(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
      return 4;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
      return 2;
    default:
      return 0;
  }
}

OrtStatus* check_cache_dtypes(const char* op, const Tensor& key_cache, const Tensor& value_cache,
                              const Tensor* key_scales, const Tensor* value_scales,
                              int key_scales_input) {
  const std::string node = std::string(op) + ": ";
  const ONNXTensorElementDataType type = key_cache.type;
  const bool int8 = type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
  if (element_size(type) == 0 && !int8)
    return invalid(node + "key_cache: expected float32, float16, bfloat16 or int8, got " +
                   type_name(type));
  if (value_cache.type != type)
    return invalid(node + "value_cache: expected the key_cache's dtype " + type_name(type) +
                   ", got " + type_name(value_cache.type));
  const Tensor* scales[2] = {key_scales, value_scales};
  const std::string names[2] = {
      "key_scale_cache (input " + std::to_string(key_scales_input) + ")",
      "value_scale_cache (input " + std::to_string(key_scales_input + 1) + ")"};
  if (!int8) {
    for (size_t i = 0; i < 2; ++i)
      if (scales[i] != nullptr)
        return invalid(node + names[i] + " is given with " + type_name(type) +
                       " caches; scale caches go with int8 caches only");
    return nullptr;
  }
  const std::vector<int64_t> scale_dims(key_cache.dims.begin(), key_cache.dims.begin() + 3);
  for (size_t i = 0; i < 2; ++i) {
    if (scales[i] == nullptr)
      return invalid(node + "int8 caches need " + names[i] +
                     ", the float32 scale of each slot and KV head");
  }
  for (size_t i = 0; i < 2; ++i) {
    const std::string name = names[i].substr(0, names[i].find(' '));
    if (scales[i]->dims != scale_dims)
      return invalid(node + name + ": expected [num_blocks, block_size, num_kv_heads] = " +
                     format_dims(scale_dims) + ", got " + scales[i]->shape());
    if (scales[i]->type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT)
      return invalid(node + name + ": expected float32, got " + type_name(scales[i]->type));
  }
  return nullptr;
}

const char* type_name(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
      return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16:
      return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16:
      return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8:
      return "int8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8:
      return "uint8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32:
      return "int32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64:
      return "int64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE:
      return "float64";
    default:
      return "an unsupported type";
  }
}

static OrtStatus* describe(const OrtValue* value, Tensor* out) {
  OrtTensorTypeAndShapeInfo* info = nullptr;
  ATTNEXPORT_RETURN_IF_ERROR(api().GetTensorTypeAndShape(value, &info));
  size_t rank = 0;
  OrtStatus* status = api().GetTensorElementType(info, &out->type);
  if (!status) status = api().GetDimensionsCount(info, &rank);
  if (!status) {
    out->dims.resize(rank);
    status = api().GetDimensions(info, out->dims.data(), rank);
  }
  api().ReleaseTensorTypeAndShapeInfo(info);
  return status;
}

// *out = `value`'s type, dims and data.
static OrtStatus* read_value(const OrtValue* value, Tensor* out) {
  ATTNEXPORT_RETURN_IF_ERROR(describe(value, out));
  // Inputs are only read; GetTensorMutableData is the one accessor that takes a const input.
  return api().GetTensorMutableData(const_cast<OrtValue*>(value), &out->data);
}

OrtStatus* read_input(OrtKernelContext* context, size_t index, Tensor* out) {
  const OrtValue* value = nullptr;
  ATTNEXPORT_RETURN_IF_ERROR(api().KernelContext_GetInput(context, index, &value));
  if (value == nullptr) return invalid("input " + std::to_string(index) + " is missing");
  return read_value(value, out);
}

OrtStatus* read_constant_input(const OrtKernelInfo* info, size_t index, Tensor* out,
                               bool* constant) {
  *out = Tensor{};
  int is_constant = 0;
  const OrtValue* value = nullptr;
  ATTNEXPORT_RETURN_IF_ERROR(
      api().KernelInfoGetConstantInput_tensor(info, index, &is_constant, &value));
  *constant = is_constant != 0 && value != nullptr;
  return *constant ? read_value(value, out) : nullptr;
}

OrtStatus* read_optional_input(OrtKernelContext* context, size_t index, Tensor* out, bool* present) {
  *out = Tensor{};
  *present = false;
  size_t count = 0;
  ATTNEXPORT_RETURN_IF_ERROR(api().KernelContext_GetInputCount(context, &count));
  if (index >= count) return nullptr;
  const OrtValue* value = nullptr;
  ATTNEXPORT_RETURN_IF_ERROR(api().KernelContext_GetInput(context, index, &value));
  if (value == nullptr) return nullptr;
  *present = true;
  return read_value(value, out);
}

OrtStatus* output_count(OrtKernelContext* context, size_t* count) {
  return api().KernelContext_GetOutputCount(context, count);
}

OrtStatus* make_output(OrtKernelContext* context, size_t index, const std::vector<int64_t>& dims,
                       Tensor* out) {
  OrtValue* value = nullptr;
  ATTNEXPORT_RETURN_IF_ERROR(
      api().KernelContext_GetOutput(context, index, dims.data(), dims.size(), &value));
  ATTNEXPORT_RETURN_IF_ERROR(describe(value, out));
  return api().GetTensorMutableData(value, &out->data);
}

OrtStatus* int_attribute(const OrtKernelInfo* info, const char* name, int64_t* out) {
  return api().KernelInfoGetAttribute_int64(info, name, out);
}

OrtStatus* float_attribute(const OrtKernelInfo* info, const char* name, float* out) {
  return api().KernelInfoGetAttribute_float(info, name, out);
}

}  // namespace attnexport
