#!/usr/bin/env bash
# `make test`: the engine's and the benchmark report's tests once without ComfyUI
# (tests/engine, bench/tests), then the ComfyUI suite (tests/comfyui) once per supported ComfyUI: 0.3.75 (.comfyui/), 0.33
# (.comfyui-0.33/) as it starts on a machine without dynamic VRAM, and 0.33 with its
# dynamic-VRAM start copied as far as a CPU allows (RINGSWAP_DYNAMIC_VRAM=1, tests/comfyui/conftest.py).
# Without the 0.33 tree (a clone without ../shared) that half is skipped with one line;
# in CI (CI=true) that is a failure. Extra arguments go to pytest. Every run passes -rfEs (pytest's
# default -rfE plus -rs: why each test skipped), and the closing summary gives per runtime the
# passed, failed and skipped counts and the skip reasons with their counts.
# `source scripts/test_all.sh` only defines the two parsing functions below (to try them by hand).

# pytest_counts LOG: pytest's closing line in LOG as "P passed, F failed, S skipped[, N errors,
# N xfailed, N xpassed, N deselected] in T" (the three always, the others where not 0).
pytest_counts() {
  sed 's/\x1b\[[0-9;]*m//g' "$1" | awk '
    { t = $0; gsub(/^[= ]+|[= ]+$/, "", t) }
    t ~ /^([0-9]+ [a-z ]+(, [0-9]+ [a-z ]+)*|no tests ran) in [0-9.]+s( \([0-9:]+\))?$/ { last = t }
    END {
      if (last == "") { print "no pytest summary line (crashed or killed?)"; exit }
      body = last; sub(/ in [0-9.]+s.*$/, "", body); took = substr(last, length(body) + 2)
      n = split(body, items, ", ")
      for (i = 1; i <= n; i++) {   # "3 passed", "1 error", "2 errors", "4 warnings", ...
        w = items[i]; sub(/^[0-9]+ /, "", w); sub(/^errors$/, "error", w)
        c[w] += items[i] + 0
      }
      split("passed failed skipped error xfailed xpassed deselected", names, " ")
      out = ""
      for (i = 1; i <= 7; i++) {
        w = names[i]
        if (i > 3 && !c[w]) continue
        out = out (out == "" ? "" : ", ") (c[w] + 0) " " (w == "error" && c[w] != 1 ? "errors" : w)
      }
      print out " " took
    }'
}

# skip_reasons LOG: the reasons of pytest -rs "SKIPPED [N] path:line: reason" lines in LOG, the
# counts summed over places, most first: 60 x "needs CUDA"; 3 x "..." (or "none").
skip_reasons() {
  sed 's/\x1b\[[0-9;]*m//g' "$1" | awk '
    /^SKIPPED \[[0-9]+\] [^ ]+: / {
      n = $2; gsub(/[^0-9]/, "", n)
      r = $0; sub(/^SKIPPED \[[0-9]+\] [^ ]+: /, "", r)
      if (!(r in c)) order[++k] = r
      c[r] += n
    }
    END {
      for (i = 2; i <= k; i++)   # most first; equal counts keep the order pytest printed them in
        for (j = i; j > 1 && c[order[j]] > c[order[j - 1]]; j--) { t = order[j]; order[j] = order[j - 1]; order[j - 1] = t }
      out = ""
      for (i = 1; i <= k; i++) out = out (i > 1 ? "; " : "") c[order[i]] " x \"" order[i] "\""
      print (k ? out : "none")
    }'
}

[[ "${BASH_SOURCE[0]}" != "$0" ]] && return 0   # sourced: the functions only

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
env -u RINGSWAP_COMFYUI_DIR "$PY" -m pytest -q -p no:cacheprovider -rfEs "$@" tests/engine bench/tests 2>&1 | tee "$out"
code=${PIPESTATUS[0]}
[ "$code" -eq 0 ] || rc=1
summary+=("without ComfyUI: $(pytest_counts "$out") (exit $code)" "without ComfyUI skips: $(skip_reasons "$out")")
rm -f "$out"
# The runtimes run side by side where there are two cores or more (most of a suite waits on one
# core or on a server process); RINGSWAP_TEST_SERIAL=1 runs them one after another. Each has its
# own log, printed whole when it ends, and its own pytest temporary folder.
lanes=$([ "${RINGSWAP_TEST_SERIAL:-0}" = 1 ] || [ "$(nproc 2>/dev/null || echo 1)" -lt 2 ] && echo 1 || echo "${#runs[@]}")
logs=$(mktemp -d)
suite() {   # suite INDEX: one runtime's tests/comfyui, its log in $logs/INDEX.log and exit code in INDEX.rc
  local i=$1 name dir dyn; shift
  IFS='|' read -r name dir dyn <<<"${runs[$i]}"
  RINGSWAP_COMFYUI_DIR="$dir" RINGSWAP_DYNAMIC_VRAM="$dyn" "$PY" -m pytest -q -p no:cacheprovider -rfEs \
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
  summary+=("ComfyUI $name: $(pytest_counts "$logs/$i.log") (exit $code)"
            "ComfyUI $name skips: $(skip_reasons "$logs/$i.log")")
done
summary+=("ComfyUI suites: $((SECONDS - t0)) s, $([ "$lanes" = 1 ] && echo "one after another" || echo "side by side")")
rm -rf "$logs"
echo "[test] ===== summary"
printf '[test] %s\n' "${summary[@]}"
exit $rc
