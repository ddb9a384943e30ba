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

OrtStatus* read_input(OrtKernelContext* context, size_t index, Tensor* out) {
  const OrtValue* value = nullptr;
  ATTNEXPORT_RETURN_IF_ERROR(api().KernelContext_GetInput(context, index, &value));
  if (value == nullptr) return invalid("input " + std::to_string(index) + " is missing");
  ATTNEXPORT_RETURN_IF_ERROR(describe(value, out));
  // Inputs are only read; GetTensorMutableData is the one accessor that takes a const input.
  return api().GetTensorMutableData(const_cast<OrtValue*>(value), &out->data);
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
  ATTNEXPORT_RETURN_IF_ERROR(describe(value, out));
  return api().GetTensorMutableData(const_cast<OrtValue*>(value), &out->data);
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
