#!/usr/bin/env bash
# One GPU-machine call that checks the kernels: every bundled test binary with the GPU required,
# compute-sanitizer (memcheck, racecheck, synccheck) on small GPU cases, and optionally a timing of FA2
# forward tile configurations (scripts/gpu-bench.sh does the benchmark itself). Run from the repo
# root after scripts/gpu-bundle:
#
#   bash scripts/gpu-check.sh OUT_DIR [tile configs...]     e.g. ... $OUT 2,32,4 1,64,8
#
# Logs go to OUT_DIR (and all of them to OUT_DIR/logs.tgz); a short table is printed last.
# LADDER_ONLY=gpu_decode,gpu_decode_modifiers (test binaries' names without cargo's hash) limits
# the tests and the sanitizer runs to those binaries: on a cold machine every kernel variant a
# test launches is compiled first, and the whole set takes more than one call's 600 s.
set -uo pipefail
out=${1:?usage: bash scripts/gpu-check.sh OUT_DIR [m_tiles,bc,warps ...]}
shift
mkdir -p "$out"
export LADDER_KERNEL_CACHE=${LADDER_KERNEL_CACHE:-/tmp/ladder-kernel-cache}
ladder=.gpu/bin/ladder
summary=()

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv \
  | tee "$out/gpu.txt"

start=$SECONDS
# The compile checks (every variant through NVRTC and ptxas, the FA3 machine code) need no GPU and
# run in CI (.ci/kernels): skipped here, where they would take minutes of device time.
bash .gpu/run-tests --skip every_kernel_compiles_without_spills --skip machine_code \
  >"$out/tests.log" 2>&1
rc=$?
summary+=("tests (all binaries, GPU required)  rc=$rc  $((SECONDS - start)) s")
grep -E "^test result|FAILED|panicked|=== " "$out/tests.log" | tail -40

# The GPU test binaries built from crates/compare/tests/gpu.rs (the prefill rungs),
# gpu_decode.rs (FlashDecoding and FlashDecoding++: drawn shapes contiguous and paged, every head
# dim and memory layout, for every strategy and with forced fallbacks, and page tables pointing
# outside the cache, which must never be followed), gpu_decode_varlen.rs (packed new tokens),
# gpu_fp8.rs (FA3's FP8 path), gpu_varlen.rs (packed variable-length batches) and gpu_ring.rs
# (ring attention on simulated ranks: a second stream's copies beside the attention).
gpu_bin=$(ls .gpu/bin/gpu-* 2>/dev/null | head -1)
decode_bin=$(ls .gpu/bin/gpu_decode-* 2>/dev/null | head -1)
decode_varlen_bin=$(ls .gpu/bin/gpu_decode_varlen-* 2>/dev/null | head -1)
fp8_bin=$(ls .gpu/bin/gpu_fp8-* 2>/dev/null | head -1)
varlen_bin=$(ls .gpu/bin/gpu_varlen-* 2>/dev/null | head -1)
decode_mods_bin=$(ls .gpu/bin/gpu_decode_modifiers-* 2>/dev/null | head -1)
ring_bin=$(ls .gpu/bin/gpu_ring-* 2>/dev/null | head -1)
sanitize() {  # sanitize NAME BINARY TEST_FILTERS...
  local name=$1 bin=$2; shift 2
  local base; base=$(basename "$bin"); base=${base%-*}
  if [ -n "${LADDER_ONLY:-}" ] && [[ ",$LADDER_ONLY," != *",$base,"* ]]; then return; fi
  for tool in memcheck racecheck synccheck; do
    start=$SECONDS
    (cd crates/compare && LADDER_REQUIRE_GPU=1 LADDER_GPU_CASES=2 compute-sanitizer \
      --tool "$tool" --error-exitcode 9 "../../$bin" --test-threads 1 "$@") >"$out/$name-$tool.log" 2>&1
    rc=$?
    summary+=("compute-sanitizer $tool ($name)  rc=$rc  $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$name-$tool.log" | tail -1)  $((SECONDS - start)) s")
  done
}
if command -v compute-sanitizer >/dev/null; then
  if [ -n "$gpu_bin" ]; then
    sanitize gpu "$gpu_bin" \
      gpu_fa1_fp16 gpu_fa2_fp16 gpu_fa3_fp16 gpu_fa2_backward_fp16 gpu_fa2_deterministic_backward_fp16 \
      gpu_fa3_backward_fp16 gpu_fa3_deterministic_backward_fp16
  fi
  if [ -n "$decode_bin" ]; then
    sanitize decode "$decode_bin" gpu_decode_drawn gpu_decode_bad_page_tables gpu_decode_strided
  fi
  if [ -n "$decode_mods_bin" ]; then  # FlashDecoding with a window, a score modifier, sinks
    sanitize decode-modifiers "$decode_mods_bin" gpu_decode_modifiers_fp16 gpu_decode_bad_modifiers
  fi
  if [ -n "$decode_varlen_bin" ]; then  # packed new tokens
    sanitize decode-varlen "$decode_varlen_bin" gpu_decode_varlen_drawn gpu_decode_varlen_more
  fi
  if [ -n "$fp8_bin" ]; then  # FA3's FP8 path: the quantisation kernels and the e4m3 attention
    sanitize fp8 "$fp8_bin" gpu_fa3_fp8_fp16 gpu_fp8_rejects gpu_fp8_quantisation
  fi
  if [ -n "$varlen_bin" ]; then  # packed variable-length batches: FA2, FA3 (and FP8) forward, FA2 backward
    sanitize varlen "$varlen_bin" gpu_fa2_varlen_fp16 gpu_fa3_varlen_fp16 gpu_fa3_fp8_varlen \
      gpu_fp8_varlen_quantisation gpu_fa2_varlen_backward_fp16 gpu_fa2_varlen_deterministic
  fi
  if [ -n "$ring_bin" ]; then  # ring attention: gather, merge, finish, and the transfer stream
    sanitize ring "$ring_bin" gpu_ring_fp16 what_the_ring
  fi
else
  summary+=("compute-sanitizer: not run (no sanitizer on this machine)")
fi

for tiles in "$@"; do
  dir="$out/tiles-${tiles//,/-}"
  LADDER_FA2_TILES=$tiles "$ladder" bench --rung fa2 --direction fwd --d 64,128 --n 4096,16384 \
    --out "$dir" >"$dir.log" 2>&1
  summary+=("fa2 fwd tiles $tiles: $(grep -E '^fa2' "$dir/bench.csv" 2>/dev/null \
    | awk -F, '{printf "d%s n%s %s %.0f | ", $10, $8, ($4=="true"?"c":"nc"), $12}')")
done

printf '\n=== summary\n'
printf '%s\n' "${summary[@]}"
# Every log in one archive, for a caller that can bring back only a few files.
(cd "$out" && tar czf logs.tgz --exclude=logs.tgz -- *) && echo "logs: $out/logs.tgz"
