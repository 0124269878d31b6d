#!/usr/bin/env bash
# `make test`: the engine's and the benchmark report's tests once without ComfyUI
# (tests/engine, bench/tests), then the ComfyUI suite (tests/comfyui) once per supported ComfyUI: 0.3.75 (.comfyui/), 0.33
# (.comfyui-0.33/) as it starts on a machine without dynamic VRAM, and 0.33 with its
# dynamic-VRAM start copied as far as a CPU allows (RINGSWAP_DYNAMIC_VRAM=1, tests/comfyui/conftest.py).
# Without the 0.33 tree (a clone without ../shared) that half is skipped with one line;
# in CI (CI=true) that is a failure. Extra arguments go to pytest.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
PY="$root/.venv/bin/python"
C075="${RINGSWAP_COMFYUI_DIR:-$root/.comfyui}"
C033="$root/.comfyui-0.33"
runs=("0.3.75|$C075|0")
if [ -f "$C033/main.py" ]; then
  runs+=("0.33.0|$C033|0" "0.33.0 dynamic VRAM|$C033|1")
elif [ "${CI:-}" = true ]; then
  echo "[test] ComfyUI 0.33 is missing ($C033; ../shared/comfyui/ absent?): CI must test it" >&2
  exit 1
else
  echo "[test] ComfyUI 0.33 not set up ($C033 missing, no ../shared/comfyui/): testing 0.3.75 only"
fi
summary=()
rc=0
echo "[test] ===== without ComfyUI (tests/engine, bench/tests)"
out=$(mktemp)
env -u RINGSWAP_COMFYUI_DIR "$PY" -m pytest -q -p no:cacheprovider "$@" tests/engine bench/tests 2>&1 | tee "$out"
code=${PIPESTATUS[0]}
[ "$code" -eq 0 ] || rc=1
summary+=("without ComfyUI: $(grep -E '[0-9]+ (passed|failed)' "$out" | tail -1) (exit $code)")
rm -f "$out"
for r in "${runs[@]}"; do
  IFS='|' read -r name dir dyn <<<"$r"
  echo "[test] ===== ComfyUI $name ($dir)"
  out=$(mktemp)
  RINGSWAP_COMFYUI_DIR="$dir" RINGSWAP_DYNAMIC_VRAM="$dyn" "$PY" -m pytest -q -p no:cacheprovider "$@" tests/comfyui 2>&1 | tee "$out"
  code=${PIPESTATUS[0]}
  [ "$code" -eq 0 ] || rc=1
  summary+=("ComfyUI $name: $(grep -E '[0-9]+ (passed|failed)' "$out" | tail -1) (exit $code)")
  rm -f "$out"
done
echo "[test] ===== summary"
printf '[test] %s\n' "${summary[@]}"
exit $rc
