#!/usr/bin/env bash
# Configure + build native/ (Release) into native/build/ and print the runner path.
#   build.sh --sanitize: the same sources with ASan + UBSan (LLMPIPE_SANITIZE=ON, RelWithDebInfo) into
#   native/build-asan/, for the fuzz tests; only the two runners; the Release build in native/build/ is
#   left alone.
#   build.sh --target aarch64: every target cross-built for 64-bit ARM Linux into native/build-aarch64/
#   (toolchain native/cmake/aarch64-linux-gnu.cmake) against the aarch64 executorch wheel of the version
#   installed here, downloaded once and unpacked under ${XDG_CACHE_HOME:-~/.cache}/llm-pipeline/; run the
#   binaries under QEMU with `python -m pipeline native run --target aarch64 BINARY ARGS` (see README.md).
# Needs: python with executorch, cmake >= 3.28 (pip install cmake), g++, and the
# Debian packages in native/apt-packages.txt (and native/apt-packages-aarch64.txt to cross-build).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD="${HERE}/build"
CONFIG=(-DCMAKE_BUILD_TYPE=Release)
TARGETS=()
CROSS=""
if [ "${1:-}" = "--sanitize" ]; then
  BUILD="${HERE}/build-asan"
  CONFIG=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DLLMPIPE_SANITIZE=ON)
  TARGETS=(--target llm_runner llm_batched_runner)
elif [ "${1:-}" = "--target" ] && [ "${2:-}" = "aarch64" ] && [ $# -eq 2 ]; then
  CROSS=aarch64
  BUILD="${HERE}/build-aarch64"
  CONFIG=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_TOOLCHAIN_FILE="${HERE}/cmake/aarch64-linux-gnu.cmake")
elif [ $# -gt 0 ]; then
  echo "usage: build.sh [--sanitize | --target aarch64]" >&2
  exit 2
fi
PY="${PYTHON:-python}"
JOBS="${JOBS:-2}"
if [ -z "$CROSS" ]; then
  ET_DIR="$("$PY" -c 'import executorch; print(executorch.__path__[0])')"
else
  if ! command -v aarch64-linux-gnu-g++ >/dev/null 2>&1; then
    echo "error: aarch64-linux-gnu-g++ not found: apt-get install $(tr '\n' ' ' < "${HERE}/apt-packages-aarch64.txt")" \
         "after dpkg --add-architecture arm64 (setup.sh does both)" >&2
    exit 1
  fi
  # The aarch64 wheel of the executorch installed here (the same headers and runtime as the x86 build).
  ET_VERSION="$("$PY" -c 'import importlib.metadata as m; print(m.version("executorch"))')"
  ET_CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/llm-pipeline"
  ET_DIR="${ET_CACHE}/executorch-${ET_VERSION}-aarch64"
  if [ ! -f "${ET_DIR}/share/cmake/executorch-config.cmake" ]; then
    mkdir -p "$ET_CACHE"
    TMP="$(mktemp -d "${ET_CACHE}/.executorch-${ET_VERSION}-aarch64.XXXXXX")"
    trap 'rm -rf "$TMP"' EXIT
    echo "downloading the executorch ${ET_VERSION} aarch64 wheel for ${ET_DIR}" >&2
    "$PY" -m pip download -q "executorch==${ET_VERSION}" --platform manylinux_2_28_aarch64 \
      --only-binary=:all: --no-deps -d "${TMP}/wheel" >&2
    # only the C++ side: executorch/{lib,include,share} (14 of the wheel's 73 MB unpacked), the package root as ET_DIR
    "$PY" -c '
import sys, zipfile
from pathlib import Path
tmp = Path(sys.argv[1])
(whl,) = (tmp / "wheel").glob("executorch-*.whl")
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        parts = info.filename.split("/")
        if parts[0] == "executorch" and len(parts) > 2 and parts[1] in ("lib", "include", "share"):
            path = Path(z.extract(info, tmp / "unpack"))
            if info.external_attr >> 16 and not info.is_dir():
                path.chmod(info.external_attr >> 16 & 0o777)
' "$TMP"
    # rename(2) is atomic and refuses a non-empty target: if a concurrent build got there first, its copy stays
    if ! mv -T "${TMP}/unpack/executorch" "$ET_DIR" 2>/dev/null \
        && [ ! -f "${ET_DIR}/share/cmake/executorch-config.cmake" ]; then
      echo "error: ${ET_DIR} exists but holds no executorch package: remove it" >&2
      exit 1
    fi
    rm -rf "$TMP"
    trap - EXIT
  fi
fi
# Prefer the pip-installed CMake (>= 3.28) over an older system one.
if [ -z "${CMAKE:-}" ]; then
  CMAKE="$("$PY" -c 'import cmake, os; print(os.path.join(cmake.CMAKE_BIN_DIR, "cmake"))' 2>/dev/null || true)"
  [ -x "$CMAKE" ] || CMAKE=cmake
fi
GEN=()
if command -v ninja >/dev/null 2>&1; then GEN=(-G Ninja); fi
if [ ! -f "${BUILD}/CMakeCache.txt" ] || ! grep -qxF "CMAKE_PREFIX_PATH:UNINITIALIZED=${ET_DIR}" "${BUILD}/CMakeCache.txt"; then
  "$CMAKE" -S "$HERE" -B "$BUILD" "${GEN[@]}" "${CONFIG[@]}" \
    -DCMAKE_PREFIX_PATH="$ET_DIR" >&2
fi
"$CMAKE" --build "$BUILD" -j "$JOBS" "${TARGETS[@]}" >&2
echo "${BUILD}/llm_runner"
