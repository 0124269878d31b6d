#!/usr/bin/env bash
# The usual GPU checks in one device call (bench/DEVICE.md): each part under its own time
# limit, logs and JSON under $OUT (or ./out/device when OUT is unset), a summary at the end.
#   run(carry=[".whl"], command="bash bench/device_run.sh suite fold stream-quant")
#   run(carry=[".whl", ".comfyui-0.33-device"], command="bash bench/device_run.sh suite-033")
# Parts: suite (all tests on ComfyUI 0.3.75, ~3 min), suite-033 (all tests on ComfyUI
# 0.33.0, dynamic VRAM off), suite-033-dyn (the same with 0.33's dynamic VRAM started as
# its main.py does, RINGSWAP_DYNAMIC_VRAM=1), gpu-gguf / gpu-gguf-033-dyn (the GGUF GPU tests and the GGUF kernels' on 0.3.75 / 0.33 dynamic), gpu / gpu-033 / gpu-033-dyn (only the tests
# marked gpu, same three runtimes), dyn-bench (bench/probes/dynamic_vram.py on 0.33, ~6 min), fold (bench/probes/fold.py, ~1.5 min), kernels
# (bench/probes/fold_kernels.py, ~1 min), kernels-kq (its K-quant tiles with and without pairs), auto / auto-033-dyn / auto-fp8-033-dyn (bench/probes/auto_window.py, bf16 or
# scaled fp8, caps 24/16/12 GiB, ~6 min), stream-quant (bench/probes/stream.py, scaled fp8 + nvfp4, ~4 min),
# stream-bf16 (bench/probes/stream.py, bf16, ~5 min). A call may run 10 minutes: pick parts that fit
# (two suites at most). The -033 parts need .comfyui-0.33-device in carry. fold, kernels
# stream-fp8 (bench/probes/stream.py, scaled fp8 only, 32,760 tokens, ~3.5 min) and stream-* run on the ComfyUI that RINGSWAP_COMFY names (default 0.3.75).
# fold-gguf (bench/probes/fold.py on Q4_K and Q8_0 Wan-14B blocks, 7,800 tokens, with the kernel table; needs .comfyui-gguf).
# gguf-12h-lora (Q8_0, 12 GiB, halved link, cfg 1 and 5, a rank-64 LoRA: RingSwap Patch and ComfyUI-GGUF alone on 0.33 dynamic).
# gguf-q4k-8 (Q4_K, 8 GiB, full link, cfg 1, RingSwap Patch on 0.3.75 and 0.33 dynamic without and with a
# rank-64 LoRA: dense weights made on landing by the Q4_K kernel in both; ~9 min).
# gguf-12h-c1 (Q8_0, 12 GiB, halved link, cfg 1, RingSwap Patch on 0.33 dynamic without and with the LoRA, each
# with a next prompt planned by the first one's rates, folds included: the LoRA / no-LoRA ratio on one machine).
# compare-* (bench/compare.py, each cell in its own process on its own ComfyUI; need
# .comfyui-0.33-device in carry): compare-base (floor + ComfyUI resident, bf16, ~5 min),
# compare-24-peers / compare-24-rs / compare-12-peers / compare-12-rs (ComfyUI, diffusers /
# RingSwap at that cap, ~6 min each), compare-disk (home disk at 24 and 12, ~8 min),
# compare-fp8-base (~4 min), compare-fp8-24 (~7 min), compare-fp8-12 (the peers and Loaders at 12 GiB,
# ~6 min), compare-repeat (ComfyUI 0.33 dynamic VRAM at 7,800 tokens: resident, RingSwap Patch
# and Loader at 24 GiB, two rounds, with --rerun, ~7 min: cross-process spread against a miss); a cell that does not fit is listed
# "not run (budget)"; a compare part whose report has a target line reading MISSED ends rc=8.
# Join the parts' JSON here: python3 bench/compare.py --merge A B ... (exit 8 where a target is MISSED)
# compare:NAME:SECONDS:ARGS (ARGS comma-separated compare.py arguments, e.g.
# compare:a:300:--configs,comfy-0.33-dyn,--caps,0,24) for cells packed into one call.
# compare-cfg5-12h / compare-cfg1-12h (issue "fast where users are": cfg 5 / 1, 12 GiB, halved link,
# 7,800 tokens; ComfyUI resident, dynamic VRAM, 0.3.75 native and RingSwap; ~7 / ~4 min).
# ttfs-diag (issue 53: where the 0.33 Patch's first step goes: a 2-step prompt of the users' cell under
# bench/probes/trace_calls.py, its timeline in $OUT/rs-patch-0.33-dyn_12.txt, then bench/probes/held_copy.py
# on the same file; 5 files, ~4.5 min with the file's write); ttfs-trace (the traced prompt alone, without
# held_copy, which hung once: ~2 min warm, ~3 with the file's write).
# ttfs-gpu (issue 53: the users' cell as a 2-step prompt, RingSwap Patch and ComfyUI 0.33 dynamic VRAM, each
# under bench/probes/gpu_timeline.py: $OUT/CONFIG_gpu.txt, its streams' kernels and copies in 50 ms bins).
# pin-probe (issue 53: bench/probes/pin_contention.py on a 17 GB file in the page cache: page-locking by
# thread count beside a copy loop, reads into page-locked memory, then with the page tables filled first;
# ~1 min). held_copy in ttfs-diag hung once at its read-only registration of a fresh file (RESULTS.md).
# compare-ttfs-12h / compare-ttfs-12h-cold (issue 53: the users' cell, cfg 5, 12 GiB, halved link, 7,800
# tokens, a 20-step first prompt: TTFS and its wall; ComfyUI dynamic VRAM, RingSwap Patch on 0.33, the
# Loader as users get it (home=auto) and ComfyUI on 0.3.75, then the Loader with home=ram last (dropped
# where the budget ends); warm page cache / --cold; ~8 / ~9 min). The compare parts run 5-step
# prompts unless ARGS give --prompt-steps.
# compare-ttfs-stock (issue 53: the Patch on a stock MODEL against that MODEL's own TTFS, 0.3.75 and 0.33 with
# dynamic VRAM disabled, the users' cell with 5-step prompts; ~3.5-6 min).
# ttfs-ab (issue 53: the users' cell, 5-step prompt, RingSwap Patch on 0.33 dynamic VRAM, for each pack tree in
# RINGSWAP_AB_TREES, default "main ." (.before/NAME, "." this tree; carry .before), first one ComfyUI dynamic VRAM
# cell (it writes the model where the machine lacks it, ~70 s more, and leaves the file in the page cache), then
# RINGSWAP_AB_ROUNDS rounds (default 2), each in the other order, and where the first ComfyUI cell wrote the model
# a second, clean one last; ~45 s a cell warm).
# gpu-ab (the GPU tests, tests/engine and tests/comfyui, of each pack tree in RINGSWAP_AB_TREES, default ".", run in
# that tree with its pack in ComfyUI 0.33 dynamic VRAM: a branch's merge gate beside an A/B; ~3-5 min a tree).
# workflow-ab (issue 53: compare-workflow-12h's half-depth cell, RingSwap Patch on 0.33 dynamic VRAM, once per pack
# tree in RINGSWAP_AB_TREES as ttfs-ab takes them, after one ComfyUI dynamic VRAM cell that writes the two experts
# where the machine lacks them; ~2.5 min + ~1.5 min a tree; each compare part its own table, ratios by hand).
# compress-ttfs-ab (issue 53: compress=on TTFS against off, the users' cell with 5-step prompts, RingSwap Loader
# home=auto on 0.3.75, off then on per pack tree in RINGSWAP_AB_TREES (default "main ."); carry .whl-nvcomp and
# .before; the first cell writes the model where the machine lacks it; ~1 min a cell warm).
# compare-workflow-12h (issue 53, the workflow cell as users run it: Wan 2.2's two experts, a rank-64 LoRA on
# every block linear of each, 4 + 4 steps at cfg 1 as KSamplerAdvanced splits them, 32,760 tokens, 12 GiB, halved
# link; first and next prompt of ComfyUI alone and RingSwap on 0.33 dynamic VRAM (Patch, Loader home=auto) and
# 0.3.75 (Loader home=auto); HALF-DEPTH experts of 20 blocks (two 14.3 GB bf16 files, ~32 s to write) so the five
# cells fit one call: ~6.5 min by --dry-run, limit 540 s); compare-workflow-12h-full-033 / -full-075 (the same with
# the 40-block Wan-14B experts, 28.6 GB each, ComfyUI 0.33 dynamic VRAM in both as the first prompt's reference:
# ~7 min each; the two files need 57 GB of the disk, so run them on a machine without the 20-block files).
# compare-fp8-12h / compare-fp8-lora (scaled fp8, 12 GiB, halved link, cfg 1, without and with a
# rank-64 LoRA on every block linear through the stock LoRA loader; ~6 min each; merge the two).
# compare-compile (ComfyUI's TorchCompileModel, inductor: resident and RingSwap at 24 GiB, ~9 min).
# compare-smoke (floor, ComfyUI 0.33 dynamic, diffusers, RingSwap Patch on 0.33 at 24 GiB, 7,800 tokens).
# ram-32 (issue "runs on the RAM people have": home=ram with all RAM, then home=auto with a RAM ballast
# leaving 32 GB, at 24 and 12 GiB, bf16, 7,800 tokens, ~6 min), experts-64 / experts-fp8-32 (two experts,
# home=auto, 24 GiB, bf16 with 64 GB / scaled fp8 with 32 GB, two prompts: the second's switches, ~4 min
# each), ram-file (home=auto, bf16, 12 GiB, a ballast leaving 20 GB: the streamed blocks do not all fit
# in RAM, so part streams from the file, held against the disk's O_DIRECT rate; 4 readers, the Model Loader's default, ~4 min), read-probe (bench/probes/read_probe.py: RangeReader at 1-8 workers against the disk's O_DIRECT rate,
# 3 GB each, ~1 min with the file's write), cfg5-first (the cfg 5, 12 GiB,
# halved-link first prompt of RingSwap Patch on 0.3.75 with 8 steps, beside ComfyUI resident: the re-plan by
# measured rates, ~3.5 min).
# compress-12h (issue "fewer bytes, same bits": RingSwap Loader on 0.3.75, 12 GiB, halved link, cfg 1 and 5,
# compress off then on; needs nvCOMP: run(carry=[".whl-lean", ".whl-nvcomp"], command="RINGSWAP_WHEELS_DIR=.whl-lean
# bash bench/device_run.sh plane-probe compress-12h"); plane-probe (bench/probes/plane_probe.py: ratio and speed per format);
# compress-auto-12h (cfg 1 with compress=auto: the first prompt raw, the next coded by the measured rates),
# compress-c1-12h (the cfg 1 half of compress-12h), compress-image-12h (4,096 tokens, the image shape, off then on),
# compress-hide-24 (24 GiB, full link, cfg 5: copies hide; off, then home=auto with compress=auto: no cost),
# ref-24 (RingSwap Loader, home=ram, 24 GiB, all RAM) and compress-experts-48 (two bf16 experts, home=auto,
# compress=auto, a RAM ballast leaving 48 GB: both homes in RAM, coded; held to ref-24 within 1.02 x).
# gap / gap-033 (bench/probes/gap_profile.py: ComfyUI-resident vs WanModel alone, ~1.5 min each);
# gap-rs (0.3.75, 7,800 tokens, + RingSwap Patch at windows 29 and 10, the 24 / 12 GiB plans),
# gap-033-dyn (0.33 dynamic VRAM, 7,800 tokens, + window 29), ~2 min each.
# families / families-033-dyn (bench/probes/families.py: Qwen-Image 12 GiB + VACE-14B 16 GiB, ~5 min),
# vace-033-dyn (VACE-14B only, ~2.5 min). live-033 (bench/probes/live_overhead.py: a server's s/step
# with and without a browser following the live block map, ~2 min).
set -u
OUT="${OUT:-$(pwd)/out/device}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
summary=()
part() {   # part NAME SECONDS COMFY DYN COMMAND...   (COMFY: 0.3.75 or 0.33; DYN: 0, 1 or "")
  local name=$1 secs=$2 comfy=$3 dyn=$4; shift 4
  local t0=$SECONDS
  # a subshell per part: its own RINGSWAP_COMFY, setup and RINGSWAP_COMFYUI_DIR
  (
    export RINGSWAP_COMFY="$comfy"
    [ -z "$dyn" ] || export RINGSWAP_DYNAMIC_VRAM="$dyn"   # "": as the caller has it
    source scripts/device_setup.sh || { echo "[device_run] setup failed"; exit 97; }
    exec timeout "$secs" "$@"
  ) >"$OUT/$name.log" 2>&1
  local rc=$?
  local why=""
  [ $rc = 97 ] && why=" (setup failed, see its log)"
  [ $rc = 8 ] && why=" (a target MISSED: see its .md)"   # bench/compare.py's MISSED_EXIT
  summary+=("$name: rc=$rc in $((SECONDS - t0)) s$why")
}
pytest=(python3 -m pytest -q -p no:cacheprovider tests/comfyui)
gguf_gpu_tests=(python3 -m pytest -q -p no:cacheprovider -m gpu tests/comfyui/test_gguf.py tests/comfyui/test_lora_kernels.py -k "gguf or q8_0")
# the gpu parts: tests/engine and tests/comfyui in two sessions (each folder has its own conftest)
gpu_tests='python3 -m pytest -q -p no:cacheprovider -m gpu tests/engine; e=$?; python3 -m pytest -q -p no:cacheprovider -m gpu tests/comfyui; c=$?; exit $((e || c))'
compare() {   # compare NAME SECONDS ARGS...: bench/compare.py, its budget 25 s inside the part's limit;
  # 5-step prompts, as the limits were set for (a --prompt-steps in ARGS comes later and wins)
  local name=$1 secs=$2; shift 2
  part "compare_$name" "$secs" 0.3.75 "" python3 bench/compare.py --budget-s $((secs - 25)) \
    --json "$OUT/compare_$name.json" --md "$OUT/compare_$name.md" --prompt-steps 5 "$@"
}
bench_comfy="${RINGSWAP_COMFY:-0.3.75}"
users_file=/tmp/ringswap_bench/wan_bf16_l40_d5120.safetensors   # the users' cell's model, as compare.py writes it
users_cell=(--tokens 7800 --cfgs 5 --links halved)   # the users' cell (bf16, 12 GiB via each config's @12)
pack_dir() { [ "$1" = . ] || echo "$PWD/.before/$1"; }   # an A/B tree's pack: .before/NAME, "" for this tree
# the users' TTFS cell with a 20-step first prompt, warm or --cold: ComfyUI and RingSwap as users get them on
# both versions, the Loader with home=ram last (dropped where the budget ends)
ttfs_12h=("${users_cell[@]}" --prompt-steps 20 --configs comfy-0.33-dyn@12 rs-patch-0.33-dyn@12
          rs-auto-0.3.75@12 comfy-0.3.75@12 rs-loader-0.3.75@12)
for p in "$@"; do
  case $p in
    suite) part suite 260 0.3.75 0 "${pytest[@]}" ;;
    suite-033) part suite_033 270 0.33 0 "${pytest[@]}" ;;
    suite-033-dyn) part suite_033_dyn 290 0.33 1 "${pytest[@]}" ;;
    gpu) part gpu 260 0.3.75 0 bash -c "$gpu_tests" ;;
    gpu-033) part gpu_033 150 0.33 0 bash -c "$gpu_tests" ;;
    gpu-033-dyn) part gpu_033_dyn 300 0.33 1 bash -c "$gpu_tests" ;;
    gpu-gguf) part gpu_gguf 200 0.3.75 0 "${gguf_gpu_tests[@]}" ;;
    gpu-gguf-033-dyn) part gpu_gguf_033_dyn 200 0.33 1 "${gguf_gpu_tests[@]}" ;;
    dyn-bench) part dyn_bench 470 0.33 "" python3 bench/probes/dynamic_vram.py --config-timeout-s 140 --json "$OUT/dynamic_vram.json" ;;
    auto-033-dyn) part auto_033_dyn 420 0.33 1 python3 bench/probes/auto_window.py --format bf16 --json "$OUT/auto_bf16_033dyn.json" ;;
    auto-fp8-033-dyn) part auto_fp8_033_dyn 330 0.33 1 python3 bench/probes/auto_window.py --format scaled_fp8 \
                        --cap-timeout-s 150 --json "$OUT/auto_fp8_033dyn.json" ;;
    auto) part auto 420 0.3.75 0 python3 bench/probes/auto_window.py --format bf16 --json "$OUT/auto_bf16.json" ;;
    fold) part fold 150 "$bench_comfy" "" python3 bench/probes/fold.py ;;
    fold-gguf) part fold_gguf 200 0.3.75 0 python3 bench/probes/fold.py --formats gguf_q4_k gguf_q8_0 --tokens 7800 --steps 6 --profile ;;
    kernels) part kernels 200 "$bench_comfy" "" python3 bench/probes/fold_kernels.py ;;
    kernels-kq) part kernels_kq 150 0.3.75 0 python3 bench/probes/fold_kernels.py --kinds q4_k q5_k q6_k ;;
    stream-quant) part stream_quant 330 "$bench_comfy" "" python3 bench/probes/stream.py --formats scaled_fp8 nvfp4 \
                    --odirect-gb 0 --budget-s 300 --json "$OUT/stream_quant.json" ;;
    stream-fp8) part stream_fp8 240 "$bench_comfy" "" python3 bench/probes/stream.py --formats scaled_fp8 --tokens 32760 \
                  --odirect-gb 0 --budget-s 210 --json "$OUT/stream_fp8.json" ;;
    stream-bf16) part stream_bf16 420 "$bench_comfy" "" python3 bench/probes/stream.py --formats bf16 --odirect-gb 0 \
                   --budget-s 390 --json "$OUT/stream_bf16.json" ;;
    compare-base) compare base 400 --groups base ;;
    ttfs-diag|ttfs-trace) export RINGSWAP_BENCH_TRACE="$OUT"   # the 0.33 Patch's TTFS traced, then page-locking's rates
      compare ttfs_diag 170 "${users_cell[@]}" --prompt-steps 2 --configs rs-patch-0.33-dyn@12
      unset RINGSWAP_BENCH_TRACE
      [ "$p" = ttfs-trace ] || part held_copy 150 0.3.75 0 python3 -u bench/probes/held_copy.py "$users_file" ;;
    ttfs-gpu) export RINGSWAP_BENCH_GPU="$OUT"   # the users' cell's first steps on the GPU, the Patch and ComfyUI
      compare ttfs_gpu 240 --tokens 7800 --cfgs 5 --links halved --prompt-steps 2 \
        --configs rs-patch-0.33-dyn@12 comfy-0.33-dyn@12
      unset RINGSWAP_BENCH_GPU ;;
    pin-probe) head -c 17000000000 /dev/zero >/tmp/pin_probe.bin
      part pin_probe 150 0.3.75 0 bash -c "python3 -u bench/probes/pin_contention.py /tmp/pin_probe.bin &&
        python3 -u bench/probes/pin_contention.py /tmp/pin_probe.bin --populate"
      rm -f /tmp/pin_probe.bin ;;
    compare:*) IFS=: read -r _ name secs args <<<"$p"; compare "$name" "$secs" ${args//,/ } ;;
    compare-24-peers) compare 24_peers 420 --groups peers --caps 24 ;;
    compare-24-rs) compare 24_rs 420 --groups ringswap --caps 24 ;;
    compare-12-peers) compare 12_peers 420 --groups peers --caps 12 ;;
    compare-12-rs) compare 12_rs 420 --groups ringswap --caps 12 ;;
    compare-disk) compare disk 480 --groups disk --caps 24 12 ;;
    compare-fp8-base) compare fp8_base 300 --formats scaled_fp8 --groups base ;;
    compare-fp8-24) compare fp8_24 540 --formats scaled_fp8 --groups peers ringswap --caps 24 ;;
    compare-fp8-12) compare fp8_12 480 --formats scaled_fp8 --configs rs-loader-0.3.75 rs-loader-0.33-dyn diffusers comfy-0.3.75 comfy-0.33-dyn comfy-0.33 --caps 12 ;;
    compare-repeat) compare repeat 560 --tokens 7800 --repeat 2 --rerun --configs comfy-0.33-dyn@0 rs-patch-0.33-dyn@24 rs-loader-0.33-dyn@24 ;;
    families) part families 330 0.3.75 0 python3 bench/probes/families.py --json "$OUT/families_075.json" ;;
    families-033-dyn) part families_033_dyn 330 0.33 1 python3 bench/probes/families.py --json "$OUT/families_033dyn.json" ;;
    vace-033-dyn) part vace_033_dyn 200 0.33 1 python3 bench/probes/families.py --families wan_vace_14b \
                    --json "$OUT/vace_033dyn.json" ;;
    compare-cfg5-12h) compare cfg5_12h 470 --tokens 7800 --cfgs 5 --links halved --caps 12 --configs comfy-0.33-dyn@0 \
                        rs-patch-0.33-dyn comfy-0.33-dyn rs-loader-0.33-dyn comfy-0.3.75@0 rs-patch-0.3.75 comfy-0.3.75 ;;
    ttfs-ab) trees=(${RINGSWAP_AB_TREES:-main .})   # the users' cell per tree (.before/NAME; "." this tree)
      secs=120; [ -e "$users_file" ] || secs=200
      compare ab_comfy $secs "${users_cell[@]}" --configs comfy-0.33-dyn@12   # first: it may write the model
      for round in $(seq 1 "${RINGSWAP_AB_ROUNDS:-2}"); do
        [ $round -gt 1 ] && trees=($(printf '%s\n' "${trees[@]}" | tac))   # each round in the other order
        for t in "${trees[@]}"; do
          RINGSWAP_PACK_DIR="$(pack_dir "$t")" compare "ab_${t//./here}_$round" 125 "${users_cell[@]}" --configs rs-patch-0.33-dyn@12
        done
      done
      # a ComfyUI cell that wrote the model read its file just written: one more, clean, at the end
      [ $secs = 200 ] && compare ab_comfy_again 120 "${users_cell[@]}" --configs comfy-0.33-dyn@12 ;;
    gpu-ab) for t in ${RINGSWAP_AB_TREES:-.}; do   # each tree's own GPU tests, its pack in ComfyUI (0.33 dynamic VRAM)
        pack="$(pack_dir "$t")"
        RINGSWAP_PACK_DIR="$pack" part "gpu_ab_${t//./here}" 300 0.33 1 bash -c "cd '${pack:-.}' && $gpu_tests"
      done ;;
    workflow-ab) trees=(${RINGSWAP_AB_TREES:-main .})   # the workflow cell per tree (.before/NAME; "." this tree)
      wf=(--workflow --layers 20 --prompt-steps 8)
      compare wf_comfy 175 "${wf[@]}" --configs comfy-0.33-dyn@12
      for t in "${trees[@]}"; do
        RINGSWAP_PACK_DIR="$(pack_dir "$t")" compare "wf_${t//./here}" 125 "${wf[@]}" --configs rs-patch-0.33-dyn@12
      done ;;
    compress-ttfs-ab) for t in ${RINGSWAP_AB_TREES:-main .}; do   # compress on against off, per tree
        for mode in off on; do
          RINGSWAP_PACK_DIR="$(pack_dir "$t")" compare "cttfs_${t//./here}_$mode" 150 "${users_cell[@]}" \
            --configs rs-auto-0.3.75@12 --compress $mode
        done
      done ;;
    compare-ttfs-stock) compare ttfs_stock 420 --tokens 7800 --cfgs 5 --links halved \
                          --configs comfy-0.3.75@12 rs-patch-0.3.75@12 comfy-0.33@12 rs-patch-0.33@12 ;;
    compare-ttfs-12h) compare ttfs_12h 500 "${ttfs_12h[@]}" ;;
    compare-ttfs-12h-cold) compare ttfs_12h_cold 540 "${ttfs_12h[@]}" --cold ;;
    compare-cfg1-12h) compare cfg1_12h 230 --tokens 7800 --cfgs 1 --links halved --caps 12 --rerun --rerun-steps 3 \
                        --configs comfy-0.33-dyn@0 rs-patch-0.33-dyn comfy-0.33-dyn ;;
    compare-workflow-12h) compare workflow_12h 540 --workflow --layers 20 --prompt-steps 8 --configs comfy-0.33-dyn@12 \
                            rs-patch-0.33-dyn@12 rs-auto-0.33-dyn@12 comfy-0.3.75@12 rs-auto-0.3.75@12 ;;
    compare-workflow-12h-full-033) compare workflow_12h_full_033 540 --workflow --prompt-steps 8 --configs \
                                     comfy-0.33-dyn@12 rs-patch-0.33-dyn@12 rs-auto-0.33-dyn@12 ;;
    compare-workflow-12h-full-075) compare workflow_12h_full_075 540 --workflow --prompt-steps 8 --configs \
                                     comfy-0.33-dyn@12 comfy-0.3.75@12 rs-auto-0.3.75@12 ;;
    compare-fp8-12h) compare fp8_12h 420 --formats scaled_fp8 --tokens 7800 --cfgs 1 --links halved --caps 12 \
                       --configs rs-loader-0.33-dyn comfy-0.33-dyn rs-loader-0.3.75 comfy-0.3.75 ;;
    compare-fp8-lora) compare fp8_lora 420 --formats scaled_fp8 --tokens 7800 --cfgs 1 --links halved --caps 12 \
                        --lora-rank 64 --configs rs-loader-0.33-dyn comfy-0.33-dyn rs-loader-0.3.75 comfy-0.3.75 ;;
    compare-compile) compare compile 560 --tokens 7800 --caps 24 --compile inductor \
                       --configs comfy-0.3.75@0 rs-patch-0.3.75 comfy-0.33-dyn@0 rs-patch-0.33-dyn ;;
    compare-smoke) compare smoke 300 --configs floor diffusers rs-patch-0.33-dyn --caps 24 --tokens 7800 ;;
    ram-32) compare ram_ref 200 --tokens 7800 --configs rs-loader-0.3.75 --caps 24 12
            compare ram_32 200 --tokens 7800 --configs rs-auto-0.3.75 --caps 24 12 --rams 32 ;;
    experts-64) compare experts_64 560 --tokens 7800 --configs rs-auto-0.3.75@24 --rams 64 --experts 2 ;;
    experts-fp8-32) compare experts_fp8_32 280 --formats scaled_fp8 --tokens 7800 --configs rs-auto-0.3.75@24 \
                      --rams 32 --experts 2 ;;
    ram-file) compare ram_file 240 --tokens 7800 --configs rs-auto-0.3.75@12 --rams 20 --workers 4 ;;
    experts-64-cfg5) compare experts_64_cfg5 560 --tokens 7800 --cfgs 5 --configs rs-auto-0.3.75@24 --rams 64 --experts 2 ;;
    experts-fp8-32-cfg5) compare experts_fp8_32_cfg5 400 --formats scaled_fp8 --tokens 7800 --cfgs 5 \
                           --configs rs-auto-0.3.75@24 --rams 32 --experts 2 ;;
    ram-32-cfg5) compare ram_32_cfg5 400 --tokens 7800 --cfgs 5 --configs rs-auto-0.3.75 --caps 24 12 --rams 32 ;;
    gguf-8) compare gguf_8 560 --formats gguf_q4_k --tokens 7800 --configs comfy-0.3.75@0 comfy-0.3.75@8 \
              rs-patch-0.3.75@8 comfy-0.33-dyn@8 rs-patch-0.33-dyn@8 rs-loader-0.3.75@8 ;;
    gguf-8-lora) compare gguf_8_lora 560 --formats gguf_q4_k --tokens 7800 --lora-rank 64 --configs \
                   comfy-0.3.75@0 comfy-0.3.75@8 rs-patch-0.3.75@8 comfy-0.33-dyn@8 rs-patch-0.33-dyn@8 ;;
    gguf-12h) compare gguf_12h 560 --formats gguf_q8_0 --tokens 7800 --cfgs 1 5 --links halved --configs \
                comfy-0.33-dyn@12 rs-patch-0.33-dyn@12 ;;
    gguf-12h-lora) compare gguf_12h_lora 560 --formats gguf_q8_0 --tokens 7800 --cfgs 1 5 --links halved \
                     --lora-rank 64 --configs rs-patch-0.33-dyn@12 comfy-0.33-dyn@12 ;;
    gguf-q4k-8) compare gguf_q4k_8 300 --formats gguf_q4_k --tokens 7800 --configs rs-patch-0.3.75@8 rs-patch-0.33-dyn@8
                compare gguf_q4k_8_lora 260 --formats gguf_q4_k --tokens 7800 --lora-rank 64 --configs \
                  rs-patch-0.3.75@8 rs-patch-0.33-dyn@8 ;;
    gguf-12h-c1) compare gguf_12h_c1 290 --formats gguf_q8_0 --tokens 7800 --cfgs 1 --links halved --rerun \
                   --rerun-steps 3 --configs rs-patch-0.33-dyn@12
                 compare gguf_12h_c1_lora 250 --formats gguf_q8_0 --tokens 7800 --cfgs 1 --links halved --rerun \
                   --rerun-steps 3 --lora-rank 64 --configs rs-patch-0.33-dyn@12 ;;
    compress-12h) compare compress_off_12h 270 --tokens 7800 --cfgs 1 5 --links halved --caps 12 --configs rs-loader-0.3.75
                  compare compress_on_12h 300 --tokens 7800 --cfgs 1 5 --links halved --caps 12 --configs rs-loader-0.3.75 \
                    --compress on ;;
    compress-c1-12h) compare compress_off_c1 170 --tokens 7800 --cfgs 1 --links halved --caps 12 --configs rs-loader-0.3.75
                     compare compress_on_c1 200 --tokens 7800 --cfgs 1 --links halved --caps 12 --configs rs-loader-0.3.75 \
                       --compress on ;;
    compress-image-12h) compare compress_off_img 150 --tokens 4096 --cfgs 1 --links halved --caps 12 --configs rs-loader-0.3.75
                        compare compress_on_img 170 --tokens 4096 --cfgs 1 --links halved --caps 12 --configs rs-loader-0.3.75 \
                          --compress on ;;
    compress-auto-12h) compare compress_auto_c1 230 --tokens 7800 --cfgs 1 --links halved --caps 12 --configs rs-loader-0.3.75 \
                         --compress auto --rerun --rerun-steps 4 ;;
    compress-hide-24) compare compress_off_24 170 --tokens 7800 --cfgs 5 --caps 24 --configs rs-auto-0.3.75
                      compare compress_auto_24 170 --tokens 7800 --cfgs 5 --caps 24 --configs rs-auto-0.3.75 --compress auto ;;
    ref-24) compare ref_24 200 --tokens 7800 --configs rs-loader-0.3.75@24 ;;
    compress-experts-48) compare experts_48_compress 500 --tokens 7800 --configs rs-auto-0.3.75@24 --rams 48 \
                           --experts 2 --compress auto ;;
    plane-probe) part plane_probe 150 0.3.75 0 python3 bench/probes/plane_probe.py --json "$OUT/plane_probe.json" ;;
    read-probe) part read_probe 120 0.3.75 0 python3 bench/probes/read_probe.py --gb 3 --workers 1 4 8 --json "$OUT/read_probe.json" ;;
    cfg5-first) compare cfg5_first 230 --tokens 7800 --cfgs 5 --links halved --caps 12 --prompt-steps 9 \
                  --configs comfy-0.3.75@0 rs-patch-0.3.75 ;;
    live-033) part live_033 150 0.33 "" python3 bench/probes/live_overhead.py --json "$OUT/live_033.json" ;;
    gap) part gap 300 0.3.75 0 python3 bench/probes/gap_profile.py --json "$OUT/gap.json" ;;
    gap-033) part gap_033 300 0.33 0 python3 bench/probes/gap_profile.py --json "$OUT/gap_033.json" ;;
    gap-rs) part gap_rs 240 0.3.75 0 python3 bench/probes/gap_profile.py --tokens 7800 --windows 29 10 --json "$OUT/gap_rs.json" ;;
    gap-033-dyn) part gap_033_dyn 240 0.33 1 python3 bench/probes/gap_profile.py --tokens 7800 --windows 29 --json "$OUT/gap_033_dyn.json" ;;
    *) echo "unknown part: $p (suite suite-033 suite-033-dyn gpu gpu-033 gpu-033-dyn gpu-gguf gpu-gguf-033-dyn gguf-12h-lora gguf-q4k-8 gguf-12h-c1 dyn-bench auto auto-033-dyn auto-fp8-033-dyn fold fold-gguf kernels kernels-kq stream-quant stream-fp8 stream-bf16 compare-base compare-24-peers compare-24-rs compare-12-peers compare-12-rs compare-disk compare-fp8-base compare-fp8-24 compare-fp8-12 compare-repeat compare-cfg5-12h compare-ttfs-12h compare-ttfs-12h-cold compare-ttfs-stock ttfs-ab gpu-ab workflow-ab compress-ttfs-ab ttfs-diag ttfs-trace ttfs-gpu compare-workflow-12h compare-workflow-12h-full-033 compare-workflow-12h-full-075 compare-cfg1-12h compare-fp8-12h compare-fp8-lora compare-compile compare-smoke ram-32 experts-64 experts-fp8-32 cfg5-first families families-033-dyn vace-033-dyn live-033 gap gap-033 gap-rs gap-033-dyn compress-12h compress-auto-12h compress-c1-12h compress-image-12h compress-hide-24 ref-24 compress-experts-48 plane-probe read-probe compare:NAME:SECONDS:ARGS)"; exit 2 ;;
  esac
done
for f in "$OUT"/*.log; do
  echo "== $(basename "$f")"
  grep -E "device_setup|passed|failed|FAILED|^\| |PASS|FAIL|BEST|ms per" "$f" | tail -25
done
printf '%s\n' "${summary[@]}"
