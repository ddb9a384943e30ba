// The library's exported entry points: picks the kernels compiled for this CPU.
//
// scripts/build_ort_kernels.sh compiles every other source file of this directory twice, into
// the namespaces attnexport_avx2 (-mavx2 -mfma -mf16c) and attnexport_avx512 (plus AVX-512
// F/BW/VL/DQ), each with its own RegisterCustomOps renamed attnexport_<isa>_RegisterCustomOps.
// This file is compiled for the x86-64 baseline, so that it runs on any CPU, asks cpuid which
// variant the CPU can execute, and hands the registration to that one. Nothing compiled for a
// wider ISA runs before that choice: the variants' static initializers (register.cc's op
// tables) are built with the AVX2 flags only.
//
//   ATTNEXPORT_ISA=avx2|avx512   forces a variant (tests cover both paths on one machine); a
//                                variant the CPU cannot execute is an error, not a crash.

#include <onnxruntime_c_api.h>

#include <cstdlib>
#include <cstring>
#include <string>

extern "C" OrtStatus* attnexport_avx2_RegisterCustomOps(OrtSessionOptions*, const OrtApiBase*);
extern "C" OrtStatus* attnexport_avx512_RegisterCustomOps(OrtSessionOptions*, const OrtApiBase*);

namespace {

using RegisterFn = OrtStatus* (*)(OrtSessionOptions*, const OrtApiBase*);

struct Variant {
  const char* name;
  RegisterFn register_ops;
  bool (*supported)();
};

bool avx2_supported() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}

bool avx512_supported() {
  return avx2_supported() && __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512dq");
}

// Widest first: the default is the first the CPU supports.
const Variant kVariants[] = {
    {"avx512", attnexport_avx512_RegisterCustomOps, avx512_supported},
    {"avx2", attnexport_avx2_RegisterCustomOps, avx2_supported},
};

// The variant to run, or nullptr with *error set (an unknown or unsupported ATTNEXPORT_ISA, or a
// CPU without AVX2).
const Variant* choose(std::string* error) {
  __builtin_cpu_init();
  const char* forced = std::getenv("ATTNEXPORT_ISA");
  if (forced != nullptr && *forced != '\0') {
    for (const Variant& variant : kVariants) {
      if (std::strcmp(forced, variant.name) != 0) continue;
      if (variant.supported()) return &variant;
      *error = std::string("ATTNEXPORT_ISA=") + forced + ": this CPU cannot run the " + forced +
               " kernels";
      return nullptr;
    }
    *error = std::string("ATTNEXPORT_ISA=") + forced + ": expected avx2 or avx512 (or unset)";
    return nullptr;
  }
  for (const Variant& variant : kVariants)
    if (variant.supported()) return &variant;
  *error = "the attnexport kernels need an x86-64 CPU with AVX2, FMA and F16C";
  return nullptr;
}

}  // namespace

// The instruction set the kernels run with here ("avx512" or "avx2"), or "unsupported: <why>".
// The Python loader reads it (ctypes) for `attnexport backends` and before registering.
extern "C" __attribute__((visibility("default"))) const char* AttnexportKernelIsa() {
  static thread_local std::string isa;  // read again per call: ATTNEXPORT_ISA may change
  std::string error;
  const Variant* variant = choose(&error);
  isa = variant != nullptr ? std::string(variant->name) : "unsupported: " + error;
  return isa.c_str();
}

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(
    OrtSessionOptions* options, const OrtApiBase* api_base) {
  std::string error;
  const Variant* variant = choose(&error);
  if (variant == nullptr) return api_base->GetApi(1)->CreateStatus(ORT_FAIL, error.c_str());
  return variant->register_ops(options, api_base);
}
