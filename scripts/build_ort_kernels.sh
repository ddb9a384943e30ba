#!/usr/bin/env bash
# Builds attnexport/ort_kernels/libattnexport_ort.so, the native onnxruntime CPU kernels of the
# attnexport domain. The package build (setup.py: `pip wheel .`, `python -m build`, `pip install
# .`) and `make` run it; it needs g++ and the onnxruntime C API header (see below).
#
# The kernels use only onnxruntime's C API, which is ABI-stable and reached at run time through
# the OrtApiBase that onnxruntime hands to RegisterCustomOps: nothing links against
# libonnxruntime, and the library works with any onnxruntime >= 1.17. PyPI wheels do not ship
# the C API header (onnxruntime_c_api.h). It comes from, in this order:
#   1. ORT_INCLUDE_DIR (or its older name ORT_INCLUDE), a directory the user gives that holds it:
#      an onnxruntime release's include/, a system package's /usr/include/onnxruntime (Fedora's
#      onnxruntime-devel, Arch's onnxruntime, Homebrew's onnxruntime, conda-forge's
#      onnxruntime-cpp), ...;
#   2. build/ort-headers, unpacked by an earlier run;
#   3. Debian's libonnxruntime-dev, fetched with apt-get download: from this system's own apt
#      sources when they have it (Debian >= 13, Ubuntu >= 24.10), else from the release that has
#      it (DEB_SUITE) on the Debian mirror this system's apt already uses. That apt runs on a
#      state of its own under build/ (the system's sources and package state are untouched),
#      checks the archive's signature, and the .deb must match the pinned SHA-256.
#
# One build for every x86-64 CPU with AVX2: the kernel sources are compiled twice, into
# libattnexport_ort_avx2.so (AVX2, FMA, F16C) and libattnexport_ort_avx512.so (plus AVX-512 F, BW,
# VL, DQ); libattnexport_ort.so, the library sessions register (isa_dispatch.cc, compiled for the
# x86-64 baseline), loads the one this CPU runs, chosen with cpuid (ATTNEXPORT_ISA=avx2 forces
# AVX2). Separate libraries, because one would merge the variants' copies of the same inline
# and template functions into one copy compiled for either ISA, and would run both variants'
# static initializers when it loads; see isa_dispatch.cc.
#
#   CXX          C++ compiler (default g++)
#   EXTRA_FLAGS  added to every compile (a test builds with -O0)
#   ARCH_FLAGS   development only, added to every compile, e.g. -mtune=native. The variants'
#                ISA flags come after both and switch off what is above their ISA (-march=native
#                cannot put AVX-512 into the AVX2 library or AVX into the dispatcher)
#   WERROR       1 (default): warnings are errors (make, the tests); the package build passes 0,
#                so that a newer compiler's new warning does not leave a wheel without kernels
#   OUTPUT       the library to write (default attnexport/ort_kernels/libattnexport_ort.so);
#                the variants are written beside it
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_SUITE=trixie
DEB_PACKAGE=libonnxruntime-dev
DEB_VERSION=1.21.0+dfsg-1
DEB_SHA256=14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08
HEADERS=build/ort-headers
SOURCES=attnexport/ort_kernels
OUTPUT=${OUTPUT:-$SOURCES/libattnexport_ort.so}
ORT_INCLUDE_DIR=${ORT_INCLUDE_DIR:-${ORT_INCLUDE:-}}

fail() {
  echo "build_ort_kernels.sh: $*" >&2
  exit 1
}

# unpack_deb: 0 when the pinned .deb was unpacked, 1 when there is none, 2 when the .deb there
# is another build (e.g. a distribution's own rebuild of the same version; removed).
unpack_deb() {
  local deb=("$HEADERS"/"$DEB_PACKAGE"_*.deb)
  [ -f "${deb[0]}" ] || return 1
  if ! echo "$DEB_SHA256  ${deb[0]}" | sha256sum -c --quiet - 2>/dev/null; then
    rm -f "${deb[0]}"
    return 2
  fi
  dpkg-deb -x "${deb[0]}" "$HEADERS"
}

fetch_debian_headers() {
  command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null ||
    fail "no onnxruntime_c_api.h: set ORT_INCLUDE_DIR to a directory holding it (apt-get and" \
      "dpkg-deb, which fetch Debian's $DEB_PACKAGE otherwise, are not installed)"
  mkdir -p "$HEADERS"
  rm -f "$HEADERS"/"$DEB_PACKAGE"_*.deb
  # This system's own sources first (their lists may be stale or lack the package: quietly on).
  # A rebuild there (another SHA-256) falls through to Debian's own build below.
  (cd "$HEADERS" && apt-get -qq download "$DEB_PACKAGE=$DEB_VERSION" 2>/dev/null) || true
  unpack_deb && return 0
  local mirror
  mirror=$(apt-get indextargets --format '$(REPO_URI)' 'Origin: Debian' 'Identifier: Packages' \
    2>/dev/null | head -n 1)
  [ -n "$mirror" ] ||
    fail "no onnxruntime_c_api.h: set ORT_INCLUDE_DIR to a directory holding it (this system's" \
      "apt has no $DEB_PACKAGE $DEB_VERSION and no Debian mirror to fetch it from)"
  local apt_dir=$PWD/build/apt
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
  echo "deb $mirror $DEB_SUITE main" >"$apt_dir/sources.list"
  local options=(
    -o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache"
    -o Dir::State::Status=/dev/null -o APT::Sandbox::User=root -qq
  )
  apt-get "${options[@]}" update || fail "apt-get update of $mirror $DEB_SUITE failed" \
    "(set ORT_INCLUDE_DIR to a directory holding onnxruntime_c_api.h instead)"
  (cd "$HEADERS" && apt-get "${options[@]}" download "$DEB_PACKAGE=$DEB_VERSION") ||
    fail "apt-get download $DEB_PACKAGE=$DEB_VERSION from $mirror $DEB_SUITE failed"
  unpack_deb ||
    fail "$DEB_PACKAGE $DEB_VERSION from $mirror $DEB_SUITE: missing, or not the pinned build" \
      "(SHA-256 differs)"
}

# Before any download: what cannot build here fails first.
CXX=${CXX:-g++}
command -v "$CXX" >/dev/null || fail "no C++ compiler: $CXX is not installed (set CXX)"
[ "$(uname -m)" = x86_64 ] || fail "the kernels are x86-64 code; this machine is $(uname -m)"

if [ -n "$ORT_INCLUDE_DIR" ]; then
  INCLUDE=$ORT_INCLUDE_DIR
  [ -f "$INCLUDE/onnxruntime_c_api.h" ] ||
    fail "ORT_INCLUDE_DIR=$ORT_INCLUDE_DIR holds no onnxruntime_c_api.h"
else
  INCLUDE=$HEADERS/usr/include/onnxruntime
  [ -f "$INCLUDE/onnxruntime_c_api.h" ] || fetch_debian_headers
fi

# -Wno-psabi: compiled for AVX2, g++ notes that returning a 16-float vector "changes the ABI";
# every such function is inline and internal to this library, so no ABI is crossed.
FLAGS=(-std=c++17 -O3 -fPIC -fvisibility=hidden -Wall -Wextra -Wno-psabi -I "$INCLUDE")
[ "${WERROR:-1}" = 0 ] || FLAGS+=(-Werror)
AVX2=(-mavx2 -mfma -mf16c -mno-avx512f)
AVX512=(-mavx2 -mfma -mf16c -mavx512f -mavx512bw -mavx512vl -mavx512dq)
BASELINE=(-mno-avx)  # the dispatcher: it runs before anything knows the CPU has AVX
OBJECTS=$(mktemp -d)
trap 'rm -rf "$OBJECTS"' EXIT

# link OUTPUT EXPORTS OBJECTS...: libstdc++ and libgcc linked in, so that the libraries need only
# glibc (a wheel built here loads on other Linux distributions whatever their C++ runtime);
# the version script exports the entry points and nothing else.
link() {
  local output=$1 exports=$2
  shift 2
  echo "{ global: $exports; local: *; };" >"$OBJECTS/$(basename "$output").map"
  "$CXX" -shared -static-libstdc++ -static-libgcc -Wl,--gc-sections \
    -Wl,--version-script="$OBJECTS/$(basename "$output").map" "$@" -o "$output.tmp"
}

build_variant() {  # build_variant ISA FLAGS...
  local isa=$1 source
  shift
  mkdir -p "$OBJECTS/$isa"
  for source in "$SOURCES"/*.cc; do
    [ "$(basename "$source")" = isa_dispatch.cc ] && continue
    "$CXX" "${FLAGS[@]}" ${ARCH_FLAGS:-} ${EXTRA_FLAGS:-} "$@" -c "$source" \
      -o "$OBJECTS/$isa/$(basename "$source" .cc).o"
  done
  link "${OUTPUT%.so}_$isa.so" "RegisterCustomOps" "$OBJECTS/$isa"/*.o
}

build_variant avx2 "${AVX2[@]}" &
avx2_job=$!
build_variant avx512 "${AVX512[@]}"
wait "$avx2_job"
"$CXX" "${FLAGS[@]}" ${ARCH_FLAGS:-} ${EXTRA_FLAGS:-} "${BASELINE[@]}" -c "$SOURCES/isa_dispatch.cc" \
  -o "$OBJECTS/isa_dispatch.o"
link "$OUTPUT" "RegisterCustomOps; AttnexportKernelIsa" "$OBJECTS/isa_dispatch.o" -ldl
for isa in avx2 avx512; do
  mv "${OUTPUT%.so}_$isa.so.tmp" "${OUTPUT%.so}_$isa.so"
done
mv "$OUTPUT.tmp" "$OUTPUT"
echo "built $OUTPUT (and its variants ${OUTPUT%.so}_avx2.so, ${OUTPUT%.so}_avx512.so)"
