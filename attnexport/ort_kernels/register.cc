// The library's entry point: registers the attnexport kernels with an onnxruntime session.
//
//   options.register_custom_ops_library(path)   (Python)
//
// Nodes of domain "attnexport" whose types match a kernel here run it; the others keep their
// standard-op function bodies (onnxruntime inlines a local function only when no kernel claims
// the node).

#include <onnxruntime_c_api.h>

#include <atomic>
#include <cstdint>
#include <new>
#include <string>
#include <vector>

#include "add_block_offsets.h"
#include "fused_add_rms_norm.h"
#include "kernel_api.h"
#include "matmul_8bits.h"
#include "packed_matmul.h"
#include "paged_attention.h"
#include "reshape_and_cache.h"
#include "rotary_embedding.h"
#include "silu_and_mul.h"

namespace attnexport {
namespace {

constexpr ONNXTensorElementDataType kInt32 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
// Any element type: the kernel checks (slot_mapping may be int32 or int64).
constexpr ONNXTensorElementDataType kAnyType = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;

// Sets output `index` to a tensor of `type` with `dims`; a dim < 0 is the symbol of that axis.
// A dim < 0 without a symbol (an input dim onnxruntime knows nothing of) gets a symbol of its
// own: onnxruntime 1.32 records an unnamed -1 as the fixed size -1, which its constant folding
// then bakes into the Shape of everything downstream (a tiny PhiMoE export failed to load, its
// router's ConstantOfShape of a negative shape).
OrtStatus* set_output_shape(OrtShapeInferContext* context, size_t index,
                            ONNXTensorElementDataType type, const std::vector<int64_t>& dims,
                            const std::vector<std::string>& symbols) {
  static std::atomic<int64_t> unnamed{0};
  std::vector<std::string> named(symbols);
  for (size_t i = 0; i < dims.size() && i < named.size(); ++i)
    if (dims[i] < 0 && named[i].empty()) named[i] = "attnexport_unknown_" + std::to_string(unnamed++);
  std::vector<const char*> names;
  for (const std::string& symbol : named) names.push_back(symbol.c_str());
  OrtTensorTypeAndShapeInfo* info = nullptr;
  ATTNEXPORT_RETURN_IF_ERROR(api().CreateTensorTypeAndShapeInfo(&info));
  OrtStatus* status = api().SetTensorElementType(info, type);
  if (status == nullptr) status = api().SetDimensions(info, dims.data(), dims.size());
  if (status == nullptr) status = api().SetSymbolicDimensions(info, names.data(), names.size());
  if (status == nullptr) status = api().ShapeInferContext_SetOutputTypeShape(context, index, info);
  api().ReleaseTensorTypeAndShapeInfo(info);
  return status;
}

// The element type, dims and symbols of input `index` (a symbol is "" for a fixed dim).
OrtStatus* input_shape(OrtShapeInferContext* context, size_t index, ONNXTensorElementDataType* type,
                       std::vector<int64_t>* dims, std::vector<std::string>* symbols) {
  OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context (releasing it is a double
                                              // free in onnxruntime 1.31)
  ATTNEXPORT_RETURN_IF_ERROR(api().ShapeInferContext_GetInputTypeShape(context, index, &info));
  size_t rank = 0;
  ATTNEXPORT_RETURN_IF_ERROR(api().GetTensorElementType(info, type));
  ATTNEXPORT_RETURN_IF_ERROR(api().GetDimensionsCount(info, &rank));
  dims->resize(rank);
  std::vector<const char*> names(rank);
  ATTNEXPORT_RETURN_IF_ERROR(api().GetDimensions(info, dims->data(), rank));
  ATTNEXPORT_RETURN_IF_ERROR(api().GetSymbolicDimensions(info, names.data(), rank));
  symbols->assign(names.begin(), names.end());
  return nullptr;
}

OrtStatus* int_attribute(OrtShapeInferContext* context, const char* name, int64_t* value) {
  const OrtOpAttr* attribute = nullptr;
  ATTNEXPORT_RETURN_IF_ERROR(api().ShapeInferContext_GetAttribute(context, name, &attribute));
  size_t size = 0;
  return api().ReadOpAttr(attribute, ORT_OP_ATTR_INT, value, sizeof *value, &size);
}

// NeoxQKVRotaryEmbedding: qkv [T, W] -> [T, num_heads, head_size], [T, num_kv_heads, head_size] x 2
// (MatMul8BitsQKVRotary / MatMul4BitsQKVRotary: a [T, K] -> the same).
OrtStatus* infer_qkv_heads(OrtShapeInferContext* context) {
  ONNXTensorElementDataType type;
  std::vector<int64_t> dims;
  std::vector<std::string> symbols;
  ATTNEXPORT_RETURN_IF_ERROR(input_shape(context, 0, &type, &dims, &symbols));
  int64_t heads = 0, kv_heads = 0, head_size = 0;
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(context, "num_heads", &heads));
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(context, "num_kv_heads", &kv_heads));
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(context, "head_size", &head_size));
  const int64_t tokens = dims.empty() ? -1 : dims[0];
  const std::string token_symbol = symbols.empty() ? "" : symbols[0];
  const int64_t counts[3] = {heads, kv_heads, kv_heads};
  for (size_t i = 0; i < 3; ++i)
    ATTNEXPORT_RETURN_IF_ERROR(set_output_shape(context, i, type, {tokens, counts[i], head_size},
                                                {token_symbol, "", ""}));
  return nullptr;
}

// SiluAndMul: [T, 2d] -> [T, d] (a symbolic last dim S becomes the symbol "S/2").
OrtStatus* infer_halved_last_dim(OrtShapeInferContext* context) {
  ONNXTensorElementDataType type;
  std::vector<int64_t> dims;
  std::vector<std::string> symbols;
  ATTNEXPORT_RETURN_IF_ERROR(input_shape(context, 0, &type, &dims, &symbols));
  if (!dims.empty() && dims.back() > 0) {
    dims.back() /= 2;
  } else if (!dims.empty()) {
    symbols.back() += "/2";
  }
  return set_output_shape(context, 0, type, dims, symbols);
}

// a [..., K] -> [..., N / divisor] (the attribute N), a's type.
OrtStatus* infer_columns(OrtShapeInferContext* context, int64_t divisor) {
  ONNXTensorElementDataType type;
  std::vector<int64_t> dims;
  std::vector<std::string> symbols;
  ATTNEXPORT_RETURN_IF_ERROR(input_shape(context, 0, &type, &dims, &symbols));
  int64_t n = 0;
  ATTNEXPORT_RETURN_IF_ERROR(int_attribute(context, "N", &n));
  if (!dims.empty()) dims.back() = n / divisor, symbols.back() = "";
  return set_output_shape(context, 0, type, dims, symbols);
}
// MatMul8Bits, MatMul4Bits, PackedMatMul, LosslessMatMul{4,8}Bits: [..., N].
OrtStatus* infer_n_columns(OrtShapeInferContext* context) { return infer_columns(context, 1); }
// PackedMatMulSiluAndMul, MatMul8BitsSiluAndMul, MatMul4BitsSiluAndMul,
// LosslessMatMul{4,8}BitsSiluAndMul: [..., N / 2].
OrtStatus* infer_half_n_columns(OrtShapeInferContext* context) { return infer_columns(context, 2); }

// AddBlockOffsets: the shape and type of y (input 0), its unnamed dims given symbols (an input's
// dims copied as they are keep an unnamed -1, which the Slice of a batch-invariance row after
// the node then read as the fixed size -1: onnxruntime 1.32 aborted in its shape inference).
OrtStatus* infer_like_first_input(OrtShapeInferContext* context) {
  ONNXTensorElementDataType type;
  std::vector<int64_t> dims;
  std::vector<std::string> symbols;
  ATTNEXPORT_RETURN_IF_ERROR(input_shape(context, 0, &type, &dims, &symbols));
  return set_output_shape(context, 0, type, dims, symbols);
}

// ReshapeAndCache: each cache output (and scale cache output, with int8 caches) has its
// input's type and shape: outputs 0, 1 like inputs 2, 3; outputs 2, 3 like inputs 5, 6 where the
// node has them.
OrtStatus* infer_cache_outputs(OrtShapeInferContext* context) {
  size_t inputs = 0;
  ATTNEXPORT_RETURN_IF_ERROR(api().ShapeInferContext_GetInputCount(context, &inputs));
  const size_t like[4] = {2, 3, 5, 6};
  for (size_t i = 0; i < 4 && like[i] < inputs; ++i) {
    OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context
    ATTNEXPORT_RETURN_IF_ERROR(api().ShapeInferContext_GetInputTypeShape(context, like[i], &info));
    if (info == nullptr) continue;  // an input left out by the empty name
    ATTNEXPORT_RETURN_IF_ERROR(api().ShapeInferContext_SetOutputTypeShape(context, i, info));
  }
  return nullptr;
}

using InferFn = OrtStatus* (*)(OrtShapeInferContext*);

// An OrtCustomOp for a kernel class K with init(info) and compute(context). Output i has the
// type and shape of input like_input[i], unless `infer` computes the outputs (for the graph's
// type inference; the kernel checks).
template <typename K>
struct Op : OrtCustomOp {
  const char* name;
  std::vector<ONNXTensorElementDataType> inputs;
  std::vector<size_t> like_input;
  InferFn infer;
  size_t required_inputs, required_outputs;  // the rest are INPUT_OUTPUT_OPTIONAL

  Op(const char* op_name, std::vector<ONNXTensorElementDataType> input_types,
     std::vector<size_t> output_like_input, InferFn infer_outputs = nullptr,
     size_t required_input_count = SIZE_MAX, size_t required_output_count = SIZE_MAX)
      : OrtCustomOp{},
        name(op_name),
        inputs(input_types),
        like_input(output_like_input),
        infer(infer_outputs),
        required_inputs(required_input_count),
        required_outputs(required_output_count) {
    version = kApiVersion;
    GetName = [](const OrtCustomOp* op) { return self(op)->name; };
    GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };  // CPU
    GetInputTypeCount = [](const OrtCustomOp* op) { return self(op)->inputs.size(); };
    GetInputType = [](const OrtCustomOp* op, size_t i) { return self(op)->inputs[i]; };
    GetOutputTypeCount = [](const OrtCustomOp* op) { return self(op)->like_input.size(); };
    GetOutputType = [](const OrtCustomOp*, size_t) { return kAnyType; };
    InferOutputShapeFn = [](const OrtCustomOp* op, OrtShapeInferContext* context) -> OrtStatus* {
      if (self(op)->infer != nullptr) return self(op)->infer(context);
      const auto& like = self(op)->like_input;
      for (size_t i = 0; i < like.size(); ++i) {
        OrtTensorTypeAndShapeInfo* info = nullptr;  // owned by the context
        ATTNEXPORT_RETURN_IF_ERROR(api().ShapeInferContext_GetInputTypeShape(context, like[i], &info));
        ATTNEXPORT_RETURN_IF_ERROR(api().ShapeInferContext_SetOutputTypeShape(context, i, info));
      }
      return nullptr;
    };
    GetInputCharacteristic = [](const OrtCustomOp* op, size_t i) {
      return i < self(op)->required_inputs ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
    };
    GetOutputCharacteristic = [](const OrtCustomOp* op, size_t i) {
      return i < self(op)->required_outputs ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
    };
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

// Float inputs take any type here (the kernels check: float32, float16, bfloat16, int8 caches),
// so that the schema onnxruntime derives from these accepts every model the function bodies
// accept. The scale caches of int8 caches are optional trailing inputs (and outputs); the
// attention sinks an optional input after them.
Op<PagedAttention> paged_attention_op(
    "PagedAttention",
    {kAnyType, kAnyType, kAnyType, kInt32, kInt32, kInt32, kAnyType, kAnyType, kAnyType, kAnyType},
    {0}, nullptr, 7);
Op<ReshapeAndCache> reshape_and_cache_op(
    "ReshapeAndCache", {kAnyType, kAnyType, kAnyType, kAnyType, kAnyType, kAnyType, kAnyType},
    {2, 3, 5, 6}, infer_cache_outputs, 5, 2);
Op<NeoxRotaryEmbedding> rotary_embedding_op("NeoxRotaryEmbedding", {kAnyType, kAnyType, kAnyType}, {0});
Op<NeoxQKVRotaryEmbedding> qkv_rotary_embedding_op("NeoxQKVRotaryEmbedding",
                                                     {kAnyType, kAnyType, kAnyType}, {0, 0, 0},
                                                     infer_qkv_heads);
Op<SiluAndMul> silu_and_mul_op("SiluAndMul", {kAnyType}, {0}, infer_halved_last_dim);
Op<FusedAddRMSNorm> fused_add_rms_norm_op("FusedAddRMSNorm", {kAnyType, kAnyType, kAnyType}, {0, 0});
Op<MatMul8Bits> matmul_8bits_op("MatMul8Bits", {kAnyType, kAnyType, kAnyType, kAnyType}, {0},
                                infer_n_columns);
Op<MatMul4Bits> matmul_4bits_op("MatMul4Bits", {kAnyType, kAnyType, kAnyType, kAnyType}, {0},
                                infer_n_columns);
Op<MatMul8BitsSiluAndMul> matmul_8bits_silu_op("MatMul8BitsSiluAndMul",
                                               {kAnyType, kAnyType, kAnyType, kAnyType}, {0},
                                               infer_half_n_columns);
Op<MatMul4BitsSiluAndMul> matmul_4bits_silu_op("MatMul4BitsSiluAndMul",
                                               {kAnyType, kAnyType, kAnyType, kAnyType}, {0},
                                               infer_half_n_columns);
Op<MatMul8BitsQKVRotary> matmul_8bits_qkv_op("MatMul8BitsQKVRotary",
                                             {kAnyType, kAnyType, kAnyType, kAnyType, kAnyType,
                                              kAnyType},
                                             {0, 0, 0}, infer_qkv_heads);
Op<MatMul4BitsQKVRotary> matmul_4bits_qkv_op("MatMul4BitsQKVRotary",
                                             {kAnyType, kAnyType, kAnyType, kAnyType, kAnyType,
                                              kAnyType},
                                             {0, 0, 0}, infer_qkv_heads);
Op<PackedMatMul> packed_matmul_op("PackedMatMul", {kAnyType, kAnyType}, {0}, infer_n_columns);
Op<PackedMatMulSiluAndMul> packed_matmul_silu_op("PackedMatMulSiluAndMul", {kAnyType, kAnyType},
                                                 {0}, infer_half_n_columns);
Op<LosslessMatMul4Bits> lossless_4bits_op("LosslessMatMul4Bits", {kAnyType, kAnyType, kAnyType},
                                          {0}, infer_n_columns);
Op<LosslessMatMul8Bits> lossless_8bits_op("LosslessMatMul8Bits", {kAnyType, kAnyType, kAnyType},
                                          {0}, infer_n_columns);
Op<LosslessMatMul4BitsSiluAndMul> lossless_4bits_silu_op("LosslessMatMul4BitsSiluAndMul",
                                                         {kAnyType, kAnyType, kAnyType}, {0},
                                                         infer_half_n_columns);
Op<LosslessMatMul8BitsSiluAndMul> lossless_8bits_silu_op("LosslessMatMul8BitsSiluAndMul",
                                                         {kAnyType, kAnyType, kAnyType}, {0},
                                                         infer_half_n_columns);
Op<AddBlockOffsets> add_block_offsets_op("AddBlockOffsets", {kAnyType, kAnyType, kAnyType, kAnyType},
                                         {0}, infer_like_first_input);

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
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &qkv_rotary_embedding_op));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &silu_and_mul_op));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &fused_add_rms_norm_op));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &matmul_8bits_op));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &matmul_4bits_op));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &matmul_8bits_silu_op));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &matmul_4bits_silu_op));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &matmul_8bits_qkv_op));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &matmul_4bits_qkv_op));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &add_block_offsets_op));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &packed_matmul_op));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &packed_matmul_silu_op));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &lossless_4bits_op));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &lossless_8bits_op));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &lossless_4bits_silu_op));
  ATTNEXPORT_RETURN_IF_ERROR(ort->CustomOpDomain_Add(domain, &lossless_8bits_silu_op));
  return ort->AddCustomOpDomain(options, domain);
}
