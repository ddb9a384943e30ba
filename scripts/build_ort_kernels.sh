#!/usr/bin/env bash
# Builds attnexport/ort_kernels/libattnexport_ort.so, the native onnxruntime CPU kernels
# of the attnexport domain (make runs this; needs g++, and the header: see below).
#
# The kernels use only onnxruntime's C API, which is ABI-stable and reached at run time through
# the OrtApiBase that onnxruntime hands to RegisterCustomOps: nothing links against
# libonnxruntime, and the library works with any onnxruntime >= 1.17. PyPI wheels do not ship
# the C API header (onnxruntime_c_api.h). It comes from, in this order:
#   1. ORT_INCLUDE, a directory the user gives that holds it (an onnxruntime release's include/,
#      a system package's /usr/include/onnxruntime, ...);
#   2. build/ort-headers, unpacked by an earlier run;
#   3. Debian's libonnxruntime-dev, fetched with apt-get from the Debian release that has it.
#      apt runs on a state of its own under build/ (the system's sources and package state are
#      untouched), checks the archive's signature, and the .deb must match the pinned SHA-256.
#
#   ARCH_FLAGS   compiler target flags (default -march=native: build on the machine that runs it)
#   CXX          C++ compiler (default g++)
#   EXTRA_FLAGS  appended to the compiler flags (a test builds with -O0 for other CPUs)
#   ORT_INCLUDE  a directory holding onnxruntime_c_api.h (skips the download)
#   OUTPUT       the library to write (default attnexport/ort_kernels/libattnexport_ort.so)
set -euo pipefail
cd "$(dirname "$0")/.."

DEB_SUITE=trixie
DEB_PACKAGE=libonnxruntime-dev=1.21.0+dfsg-1
DEB_SHA256=14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08
HEADERS=build/ort-headers
SOURCES=attnexport/ort_kernels
OUTPUT=${OUTPUT:-$SOURCES/libattnexport_ort.so}

fetch_debian_headers() {
  if ! command -v apt-get >/dev/null; then
    echo "no onnxruntime_c_api.h: set ORT_INCLUDE to a directory holding it (apt-get, which" \
      "fetches Debian's libonnxruntime-dev otherwise, is not installed)" >&2
    exit 1
  fi
  local apt_dir=$PWD/build/apt
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$HEADERS"
  echo "deb http://deb.debian.org/debian $DEB_SUITE main" > "$apt_dir/sources.list"
  local options=(
    -o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache"
    -o Dir::State::Status=/dev/null -o APT::Sandbox::User=root -qq
  )
  apt-get "${options[@]}" update
  (cd "$HEADERS" && apt-get "${options[@]}" download "$DEB_PACKAGE")
  local deb=("$HEADERS"/libonnxruntime-dev_*.deb)
  echo "$DEB_SHA256  ${deb[0]}" | sha256sum -c --quiet -
  dpkg-deb -x "${deb[0]}" "$HEADERS"
}

INCLUDE=${ORT_INCLUDE:-$HEADERS/usr/include/onnxruntime}
if [ ! -f "$INCLUDE/onnxruntime_c_api.h" ]; then
  if [ -n "${ORT_INCLUDE:-}" ]; then
    echo "ORT_INCLUDE=$ORT_INCLUDE holds no onnxruntime_c_api.h" >&2
    exit 1
  fi
  fetch_debian_headers
fi

# -Wno-psabi: on a machine without AVX-512, g++ notes that returning a 16-float vector "changes
# the ABI"; every such function is inline and internal to this library, so no ABI is crossed
# (without the flag -Werror failed the build there).
"${CXX:-g++}" -std=c++17 -O3 ${ARCH_FLAGS:--march=native} -fPIC -shared -fvisibility=hidden \
  -Wall -Wextra -Werror -Wno-psabi ${EXTRA_FLAGS:-} -I "$INCLUDE" "$SOURCES"/*.cc -o "$OUTPUT.tmp"
mv "$OUTPUT.tmp" "$OUTPUT"
echo "built $OUTPUT"
