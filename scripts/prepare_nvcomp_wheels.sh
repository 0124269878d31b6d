#!/usr/bin/env bash
# nvCOMP's Python wheels for the offline GPU machine (Python 3.12, torch cu130), into .whl-nvcomp/
# (git-ignored, about 34 MB: carry it without .whl and the 0.33 tree, whose sum passes the
# 64 MiB cap; engine tests and bench/plane_probe.py need neither). Needs PyPI once; then offline.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl-nvcomp
mkdir -p "$dest"
if ls "$dest"/nvidia_nvcomp_cu13-*.whl "$dest"/nvidia_libnvcomp_cu13-*.whl >/dev/null 2>&1; then
    echo "[nvcomp] $dest already holds the wheels"
else
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 -d "$dest" nvidia-nvcomp-cu13==6.0.0.12 nvidia-libnvcomp-cu13==6.0.0.12
fi
du -sh "$dest"
echo "[nvcomp] on the device: pip install --no-deps --no-index --target /tmp/nvc $dest/*.whl; export PYTHONPATH=/tmp/nvc:\$PYTHONPATH"
