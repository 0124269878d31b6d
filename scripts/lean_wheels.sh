#!/usr/bin/env bash
# .whl-lean/: .whl without the wheels only some device runs need (comfy-angle + PyOpenGL for 0.33's
# GLSL nodes, diffusers for compare.py's peer cells), about 24 MiB, so that .whl-nvcomp (nvCOMP,
# scripts/prepare_nvcomp_wheels.sh) travels beside it under the 64 MiB cap:
#   run(carry=[".whl-lean", ".whl-nvcomp"], command="RINGSWAP_WHEELS_DIR=.whl-lean bash bench/device_run.sh ...")
# .whl-033/: .whl-lean without ComfyUI 0.3.75 (its comfyui/ horde wheel), about 16 MiB, for the parts
# that run on 0.33 only (gpu-033-dyn, suite-033-dyn) with nvCOMP and the 0.33 tree in one call:
#   run(carry=[".whl-033", ".whl-nvcomp", ".comfyui-0.33-device"], command="RINGSWAP_WHEELS_DIR=.whl-033 ...")
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .whl/comfyui ] || { echo "[lean] no .whl: run scripts/prepare_device_wheels.sh first" >&2; exit 1; }
rm -rf .whl-lean
cp -al .whl .whl-lean
rm -f .whl-lean/comfy_angle-*.whl .whl-lean/pyopengl-*.whl .whl-lean/diffusers-*.whl
rm -rf .whl-033
mkdir .whl-033
cp -al .whl-lean/*.whl .whl-033/
du -sh .whl-lean .whl-033
