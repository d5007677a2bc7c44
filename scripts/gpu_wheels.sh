#!/usr/bin/env bash
# The wheels the device machine lacks for serving (phase 4 of scripts/gpu_check.py): downloaded here into
# .gpu-wheels/ (git-ignored), carried to the device (`carry: [".gpu-wheels"]`), installed there by the check with
# `pip install --no-index --no-deps`. Python 3.12, x86-64 manylinux, no dependencies resolved: each needed one
# is named (the machine already has grpcio, protobuf, numpy, pyyaml, requests, tqdm). `--dry-run`: print the
# command only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
PACKAGES=(
  pyzmq==27.3.0 msgspec==0.23.0 orjson==3.13.0 llguidance==1.9.1 supervisor==4.3.0 interegular==0.3.3
  gguf==0.19.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
  googleapis-common-protos==1.76.0
)
PLATFORMS=()
for n in 2_39 2_35 2_34 2_31 2_28 2_27 2_26 2_24 2_17 2_5; do PLATFORMS+=(--platform "manylinux_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
CMD=("$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  "${PLATFORMS[@]}" -d .gpu-wheels "${PACKAGES[@]}")
if [[ "${1:-}" == "--dry-run" ]]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
mkdir -p .gpu-wheels
"${CMD[@]}"
du -sh .gpu-wheels
