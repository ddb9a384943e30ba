// libattnexport_ort.so, the library sessions register: picks the kernels compiled for this CPU.
//
// scripts/build_ort_kernels.sh compiles the kernel sources twice, into
// libattnexport_ort_avx2.so (-mavx2 -mfma -mf16c) and libattnexport_ort_avx512.so (plus AVX-512
// F/BW/VL/DQ), each a complete kernel library with its own RegisterCustomOps. This file is
// compiled for the x86-64 baseline, so that it runs on any CPU: it asks cpuid which variant the
// CPU can execute, loads that one from beside itself and hands it the registration.
// Separate libraries, not one: each variant instantiates the same inline and template functions
// (the standard library's among them), which one library would merge into a single copy
// compiled for either ISA, and a library's static initializers run when it loads; a variant
// the CPU cannot execute is never loaded.
//
//   ATTNEXPORT_ISA=avx2|avx512   forces a variant (tests cover both paths on one machine); a
//                                variant the CPU cannot execute is an error, not a crash.

#include <dlfcn.h>
#include <onnxruntime_c_api.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace {

struct Variant {
  const char* name;
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
const Variant kVariants[] = {{"avx512", avx512_supported}, {"avx2", avx2_supported}};

// The variant library's path: this library's path with "_<isa>" before ".so", as the build
// names them (libattnexport_ort_avx2.so beside libattnexport_ort.so; base_avx2.so beside a
// copy built as base.so).
std::string variant_path(const Variant& variant) {
  Dl_info info{};
  std::string stem = "libattnexport_ort";
  if (dladdr(reinterpret_cast<void*>(&variant_path), &info) != 0 && info.dli_fname != nullptr) {
    stem = info.dli_fname;
    const std::string suffix = ".so";
    if (stem.size() > suffix.size() &&
        stem.compare(stem.size() - suffix.size(), suffix.size(), suffix) == 0)
      stem.resize(stem.size() - suffix.size());
  }
  return stem + "_" + variant.name + ".so";
}

// The variant to run, or nullptr with *error set (an unknown or unsupported ATTNEXPORT_ISA, a
// CPU without AVX2, a variant library that is missing).
const Variant* choose(std::string* error) {
  __builtin_cpu_init();
  const Variant* chosen = nullptr;
  const char* forced = std::getenv("ATTNEXPORT_ISA");
  if (forced != nullptr && *forced != '\0') {
    for (const Variant& variant : kVariants)
      if (std::strcmp(forced, variant.name) == 0) chosen = &variant;
    if (chosen == nullptr) {
      *error = std::string("ATTNEXPORT_ISA=") + forced + ": expected avx2 or avx512 (or unset)";
      return nullptr;
    }
    if (!chosen->supported()) {
      *error = std::string("ATTNEXPORT_ISA=") + forced + ": this CPU cannot run the " + forced +
               " kernels";
      return nullptr;
    }
  } else {
    for (const Variant& variant : kVariants)
      if (chosen == nullptr && variant.supported()) chosen = &variant;
    if (chosen == nullptr) {
      *error = "the attnexport kernels need an x86-64 CPU with AVX2, FMA and F16C";
      return nullptr;
    }
  }
  const std::string path = variant_path(*chosen);
  if (access(path.c_str(), R_OK) != 0) {
    *error = path + " is missing (an incomplete build or install)";
    return nullptr;
  }
  return chosen;
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
  const OrtApi* api = api_base->GetApi(1);
  std::string error;
  const Variant* variant = choose(&error);
  if (variant == nullptr) return api->CreateStatus(ORT_FAIL, error.c_str());
  // Never closed: the kernels must outlive every session that registered them. Loading it
  // again only counts a reference.
  void* library = dlopen(variant_path(*variant).c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) return api->CreateStatus(ORT_FAIL, dlerror());
  using RegisterFn = OrtStatus* (*)(OrtSessionOptions*, const OrtApiBase*);
  auto register_ops = reinterpret_cast<RegisterFn>(dlsym(library, "RegisterCustomOps"));
  if (register_ops == nullptr) return api->CreateStatus(ORT_FAIL, dlerror());
  return register_ops(options, api_base);
}
