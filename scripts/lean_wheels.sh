#!/usr/bin/env bash
# .whl-lean/: .whl without the wheels only some device runs need (comfy-angle + PyOpenGL for 0.33's
# GLSL nodes, diffusers for compare.py's peer cells), about 24 MiB, so that .whl-nvcomp (nvCOMP,
# scripts/prepare_nvcomp_wheels.sh) travels beside it under the 64 MiB cap:
#   run(carry=[".whl-lean", ".whl-nvcomp"], command="RINGSWAP_WHEELS_DIR=.whl-lean bash bench/device_run.sh ...")
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .whl/comfyui ] || { echo "[lean] no .whl: run scripts/prepare_device_wheels.sh first" >&2; exit 1; }
rm -rf .whl-lean
cp -al .whl .whl-lean
rm -f .whl-lean/comfy_angle-*.whl .whl-lean/pyopengl-*.whl .whl-lean/diffusers-*.whl
du -sh .whl-lean
