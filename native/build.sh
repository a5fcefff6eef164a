#!/usr/bin/env bash
# Configure + build native/ (Release) into native/build/ and print the runner path.
#   build.sh --sanitize: the same sources with ASan + UBSan (LLMPIPE_SANITIZE=ON, RelWithDebInfo) into
#   native/build-asan/, for the fuzz tests; only the two runners; the Release build in native/build/ is
#   left alone.
# Needs: python with executorch, cmake >= 3.28 (pip install cmake), g++, and the
# Debian packages in native/apt-packages.txt.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD="${HERE}/build"
CONFIG=(-DCMAKE_BUILD_TYPE=Release)
TARGETS=()
if [ "${1:-}" = "--sanitize" ]; then
  BUILD="${HERE}/build-asan"
  CONFIG=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DLLMPIPE_SANITIZE=ON)
  TARGETS=(--target llm_runner llm_batched_runner)
elif [ $# -gt 0 ]; then
  echo "usage: build.sh [--sanitize]" >&2
  exit 2
fi
PY="${PYTHON:-python}"
JOBS="${JOBS:-2}"
ET_DIR="$("$PY" -c 'import executorch; print(executorch.__path__[0])')"
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
