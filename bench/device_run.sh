#!/usr/bin/env bash
# The usual GPU checks in one device call (bench/DEVICE.md): each part under its own time
# limit, logs and JSON under $OUT (or ./out/device when OUT is unset), a summary at the end.
#   run(carry=[".whl"], command="bash bench/device_run.sh suite fold stream-quant")
# Parts: suite (all tests, ~3 min), fold (bench/fold.py, ~1.5 min), kernels
# (bench/fold_kernels.py, ~1 min), stream-quant (stream.py, scaled fp8 + nvfp4, ~4 min),
# stream-bf16 (stream.py, bf16, ~5 min). A call may run 10 minutes: pick parts that fit.
set -u
OUT="${OUT:-$(pwd)/out/device}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source scripts/device_setup.sh >/dev/null || exit 1
summary=()
part() {   # part NAME SECONDS COMMAND...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$name: rc=$rc in $((SECONDS - t0)) s")
}
for p in "$@"; do
  case $p in
    suite) part suite 260 python3 -m pytest -q -p no:cacheprovider tests ;;
    fold) part fold 150 python3 bench/fold.py ;;
    kernels) part kernels 120 python3 bench/fold_kernels.py ;;
    stream-quant) part stream_quant 330 python3 bench/stream.py --formats scaled_fp8 nvfp4 --odirect-gb 0 \
                    --budget-s 300 --json "$OUT/stream_quant.json" ;;
    stream-bf16) part stream_bf16 420 python3 bench/stream.py --formats bf16 --odirect-gb 0 \
                   --budget-s 390 --json "$OUT/stream_bf16.json" ;;
    *) echo "unknown part: $p (suite fold kernels stream-quant stream-bf16)"; exit 2 ;;
  esac
done
for f in "$OUT"/*.log; do
  echo "== $(basename "$f")"
  grep -E "passed|failed|FAILED|^\| |PASS|FAIL|BEST|ms per" "$f" | tail -25
done
printf '%s\n' "${summary[@]}"
