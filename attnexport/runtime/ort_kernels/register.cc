// The library's entry point: registers the attnexport kernels with an onnxruntime session.
//
//   options.register_custom_ops_library(path)   (Python)
//
// Nodes of domain "attnexport" whose types match a kernel here run it; the others keep their
// standard-op function bodies (onnxruntime inlines a local function only when no kernel claims
// the node).

#include <onnxruntime_c_api.h>

#include <new>
#include <vector>

#include "kernel_api.h"
#include "paged_attention.h"
#include "reshape_and_cache.h"
#include "rotary_embedding.h"

namespace attnexport {
namespace {

constexpr ONNXTensorElementDataType kInt32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
// Any element type: the kernel checks (slot_mapping may be int32 or int64).
constexpr ONNXTensorElementDataType kAnyType = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;

// An OrtCustomOp for a kernel class K with init(info) and compute(context). Output i has the
// type and shape of input like_input[i] (for the graph's type inference; the kernel checks).
template <typename K>
struct Op : OrtCustomOp {
  const char* name;
  std::vector<ONNXTensorElementDataType> inputs;
  std::vector<size_t> like_input;

  Op(const char* op_name, std::vector<ONNXTensorElementDataType> input_types,
     std::vector<size_t> output_like_input)
      : OrtCustomOp{}, name(op_name), inputs(input_types), like_input(output_like_input) {
    version = kApiVersion;
    GetName = [](const OrtCustomOp* op) { return self(op)->name; };
    GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };  // CPU
    GetInputTypeCount = [](const OrtCustomOp* op) { return self(op)->inputs.size(); };
    GetInputType = [](const OrtCustomOp* op, size_t i) { return self(op)->inputs[i]; };
    GetOutputTypeCount = [](const OrtCustomOp* op) { return self(op)->like_input.size(); };
    GetOutputType = [](const OrtCustomOp*, size_t) { return kAnyType; };
    InferOutputShapeFn = [](const OrtCustomOp* op, OrtShapeInferContext* context) -> OrtStatus* {
      const auto& like = self(op)->like_input;
      for (size_t i = 0; i < like.size(); ++i) {
        OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context (releasing it
                                                    // is a double free in onnxruntime 1.31)
        ATTNEXPORT_RETURN_IF_ERROR(api().ShapeInferContext_GetInputTypeShape(context, like[i], &info));
        OrtStatus* status = api().ShapeInferContext_SetOutputTypeShape(context, i, info);
        ATTNEXPORT_RETURN_IF_ERROR(status);
      }
      return nullptr;
    };
    GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
    GetInputMemoryType = [](const OrtCustomOp*, size_t) { return OrtMemTypeDefault; };
    CreateKernelV2 = [](const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info,
                        void** kernel) -> OrtStatus* {
      auto* instance = new (std::nothrow) K();
      if (instance == nullptr) return api().CreateStatus(ORT_FAIL, "out of memory");
      if (OrtStatus* status = instance->init(info)) {
        delete instance;
        return status;
      }
      *kernel = instance;
      return nullptr;
    };
    KernelComputeV2 = [](void* kernel, OrtKernelContext* context) {
      return static_cast<const K*>(kernel)->compute(context);
    };
    KernelDestroy = [](void* kernel) { delete static_cast<K*>(kernel); };
    GetStartVersion = [](const OrtCustomOp*) { return 1; };
    GetEndVersion = [](const OrtCustomOp*) { return 1; };
  }

  static const Op* self(const OrtCustomOp* op) { return static_cast<const Op*>(op); }
};

// Float inputs take any type here (the kernels check: float32, float16, bfloat16), so that the
// schema onnxruntime derives from these accepts every model the function bodies accept.
Op<PagedAttention> paged_attention_op(
    "PagedAttention", {kAnyType, kAnyType, kAnyType, kInt32, kInt32, kInt32, kAnyType}, {0});
Op<ReshapeAndCache> reshape_and_cache_op(
    "ReshapeAndCache", {kAnyType, kAnyType, kAnyType, kAnyType, kAnyType}, {2, 3});
Op<NeoxRotaryEmbedding> rotary_embedding_op("NeoxRotaryEmbedding", {kAnyType, kAnyType, kAnyType}, {0});

}  // namespace
}  // namespace attnexport

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(
    OrtSessionOptions* options, const OrtApiBase* api_base) {
  using namespace attnexport;
  const OrtApi* ort = api_base->GetApi(kApiVersion);
  if (ort == nullptr)
    return api_base->GetApi(1)->CreateStatus(
        ORT_FAIL, "the attnexport kernels need onnxruntime >= 1.17 (C API version 17)");
  set_api(ort);
  // Never released: a domain must outlive every session that uses it (one per registration).
  OrtCustomOpDomain* domain = nullptr;
  ATTNEXPORT_RETURN_IF_ERROR(ort->CreateCustomOpDomain("attnexport", &domain));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &paged_attention_op));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &reshape_and_cache_op));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &rotary_embedding_op));
  return ort->AddCustomOpDomain(options, domain);
}
