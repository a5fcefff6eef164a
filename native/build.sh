#!/usr/bin/env bash
# Configure + build native/ (Release) into native/build/ and print the runner path.
# Needs: python with executorch, cmake >= 3.28 (pip install cmake), g++, and the
# Debian packages in native/apt-packages.txt.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD="${HERE}/build"
PY="${PYTHON:-python}"
JOBS="${JOBS:-2}"
ET_DIR="$("$PY" -c 'import executorch; print(executorch.__path__[0])')"
CMAKE="${CMAKE:-cmake}"
GEN=()
if command -v ninja >/dev/null 2>&1; then GEN=(-G Ninja); fi
if [ ! -f "${BUILD}/CMakeCache.txt" ]; then
  "$CMAKE" -S "$HERE" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$ET_DIR" >&2
fi
"$CMAKE" --build "$BUILD" -j "$JOBS" >&2
echo "${BUILD}/llm_runner"
