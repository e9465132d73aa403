#!/usr/bin/env bash
# The benchmark of issue 3 on the GPU machine, in one command: the ladder's GPU rungs
# (`ladder bench`), then PyTorch SDPA and the Triton tutorial kernel on the same shapes
# (scripts/peers.py), then the charts of both and the side-by-side table, printed last.
#
# Run from the repo root after scripts/gpu-bundle (which puts the binary in .gpu/bin/):
#
#   bash scripts/gpu-bench.sh OUT_DIR [flags...]
#
# e.g. bash scripts/gpu-bench.sh bench-results --quick
# Flags go to both tools, so use the ones they share: --quick, --d, --n, --causal, --direction,
# --dtype, --repeats, --warmup, --tokens, --hidden, --case-budget-s, and for --direction decode
# --batch, --heads-kv, and --splits, --new-tokens, --page-size (ladder only; peers.py ignores
# them). `--direction decode` alone gives the decode table of issue 10 in one run: the five
# reference shapes with 1 and 4 new tokens, contiguous and in pages of 16 and 64 (ours), one new
# token for the peers, and the batch × L × GQA sweep. LADDER=path overrides the
# binary. OUT_DIR gets bench.csv, bench.json, peers.csv, meta.json and one SVG chart per
# (direction, dtype, d, mask). The default sweep takes a few minutes on an H200.
set -uo pipefail

out=${1:?usage: bash scripts/gpu-bench.sh OUT_DIR [flags...]}
shift
ladder=${LADDER:-.gpu/bin/ladder}
if [ ! -x "$ladder" ]; then
  echo "gpu-bench: $ladder not found; build it first (scripts/gpu-bundle)" >&2
  exit 2
fi
mkdir -p "$out"
start=$SECONDS
status=0

echo "=== ladder bench (GPU rungs)"
"$ladder" bench --out "$out" "$@"
rc=$?
if [ $rc -eq 2 ]; then
  exit 2 # no GPU, or a bad flag: nothing to compare
fi
[ $rc -eq 0 ] || status=$rc

echo "=== peers (PyTorch SDPA backends, Triton tutorial kernel)"
python3 scripts/peers.py --out "$out" "$@" || status=1

echo "=== side by side ($((SECONDS - start)) s so far)"
"$ladder" bench --charts-only --out "$out" || status=1

echo "gpu-bench: done in $((SECONDS - start)) s, results in $out (exit $status)"
exit $status
