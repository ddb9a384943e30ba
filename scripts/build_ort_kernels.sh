#!/usr/bin/env bash
# Builds attnexport/ort_kernels/libattnexport_ort.so, the native onnxruntime CPU kernels
# of the attnexport domain (make runs this; needs g++ and network access the first time).
#
# The kernels use only onnxruntime's C API, which is ABI-stable and reached at run time through
# the OrtApiBase that onnxruntime hands to RegisterCustomOps: nothing links against
# libonnxruntime, and the library works with any onnxruntime >= 1.17. PyPI wheels do not ship
# the C API header; Debian's libonnxruntime-dev does, so its .deb (pinned by checksum) is
# unpacked into build/ort-headers once.
#
#   ARCH_FLAGS   compiler target flags (default -march=native: build on the machine that runs it)
#   CXX          C++ compiler (default g++)
#   EXTRA_FLAGS  appended to the compiler flags (a test builds with -O0 for other CPUs)
#   OUTPUT       the library to write (default attnexport/ort_kernels/libattnexport_ort.so)
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_URL=https://deb.debian.org/debian/pool/main/o/onnxruntime/libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb
DEB_SHA256=14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08
HEADERS=build/ort-headers
INCLUDE=$HEADERS/usr/include/onnxruntime
SOURCES=attnexport/ort_kernels
OUTPUT=${OUTPUT:-$SOURCES/libattnexport_ort.so}

if [ ! -f "$INCLUDE/onnxruntime_c_api.h" ]; then
  mkdir -p "$HEADERS"
  deb=$HEADERS/libonnxruntime-dev.deb
  curl -fsSL --retry 3 -o "$deb" "$DEB_URL"
  echo "$DEB_SHA256  $deb" | sha256sum -c --quiet -
  if command -v dpkg-deb >/dev/null; then
    dpkg-deb -x "$deb" "$HEADERS"
  else
    (cd "$HEADERS" && ar x libonnxruntime-dev.deb data.tar.xz && tar -xJf data.tar.xz ./usr/include)
  fi
fi

# -Wno-psabi: on a machine without AVX-512, g++ notes that returning a 16-float vector "changes
# the ABI"; every such function is inline and internal to this library, so no ABI is crossed
# (without the flag -Werror failed the build there).
"${CXX:-g++}" -std=c++17 -O3 ${ARCH_FLAGS:--march=native} -fPIC -shared -fvisibility=hidden \
  -Wall -Wextra -Werror -Wno-psabi ${EXTRA_FLAGS:-} -I "$INCLUDE" "$SOURCES"/*.cc -o "$OUTPUT.tmp"
mv "$OUTPUT.tmp" "$OUTPUT"
echo "built $OUTPUT"
