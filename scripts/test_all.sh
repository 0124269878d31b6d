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
# The runtimes run side by side where there are two cores or more (most of a suite waits on one
# core or on a server process); RINGSWAP_TEST_SERIAL=1 runs them one after another. Each has its
# own log, printed whole when it ends, and its own pytest temporary folder.
lanes=$([ "${RINGSWAP_TEST_SERIAL:-0}" = 1 ] || [ "$(nproc 2>/dev/null || echo 1)" -lt 2 ] && echo 1 || echo "${#runs[@]}")
logs=$(mktemp -d)
suite() {   # suite INDEX: one runtime's tests/comfyui, its log in $logs/INDEX.log and exit code in INDEX.rc
  local i=$1 name dir dyn; shift
  IFS='|' read -r name dir dyn <<<"${runs[$i]}"
  RINGSWAP_COMFYUI_DIR="$dir" RINGSWAP_DYNAMIC_VRAM="$dyn" "$PY" -m pytest -q -p no:cacheprovider \
    --basetemp="$logs/tmp$i" "$@" tests/comfyui >"$logs/$i.log" 2>&1
  echo $? >"$logs/$i.rc"
}
t0=$SECONDS
for i in "${!runs[@]}"; do
  if [ "$lanes" = 1 ]; then suite "$i" "$@"; else suite "$i" "$@" & fi
done
wait
for i in "${!runs[@]}"; do
  IFS='|' read -r name dir dyn <<<"${runs[$i]}"
  echo "[test] ===== ComfyUI $name ($dir)"
  cat "$logs/$i.log"
  code=$(cat "$logs/$i.rc")
  [ "$code" -eq 0 ] || rc=1
  summary+=("ComfyUI $name: $(grep -E '[0-9]+ (passed|failed)' "$logs/$i.log" | tail -1) (exit $code)")
done
summary+=("ComfyUI suites: $((SECONDS - t0)) s, $([ "$lanes" = 1 ] && echo "one after another" || echo "side by side")")
rm -rf "$logs"
echo "[test] ===== summary"
printf '[test] %s\n' "${summary[@]}"
exit $rc
