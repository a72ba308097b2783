#!/usr/bin/env bash
# NCCL settings for tensor parallelism on two GPUs (the nvidia-h200-x2 kind), in one device call:
#   1. `tp-bench --allreduce-only --ranks 2` per setting (seconds each): all-reduce times at Llama-3.1-8B's
#      decode (1 x 4096) and prefill (2048 x 4096) sizes and 8 KB to 64 MB, one CSV per setting;
#   2. the setting with the fastest prefill-size all-reduce and the one with the fastest decode-size
#      all-reduce (the runner-up by prefill when both are the same one);
#   3. the full 8B `tp-bench --ranks 1,2 --steps 16 --reps 3` with each of the two (as
#      benches/results/h200-x2/tensor-parallel.md was measured); FULL_DEFAULT=1 adds NCCL's defaults.
# Usage: app/benches/tp_nccl_sweep.sh [tp-bench binary, default target/release/tp-bench]
#        SKIP_FULL=1 stops after step 2; FULL="--nccl-max-ctas 32|--nccl-proto LL128" runs step 3 only,
#        for those settings (separated by |).
# Needs NCCL (NCCL_LIBRARY or LD_LIBRARY_PATH, as tests/tp.rs says); NCCL_NVLS_ENABLE stays 0 (tp-bench
# refuses anything else). NCCL_PROTO / NCCL_ALGO are per process: every setting is its own invocation.
# Results: $BENCH_RESULTS_DIR (default benches/results/nccl-sweep): the CSV/MD files tp-bench writes,
# named by setting, and sweep.tsv (setting, decode us, prefill us, 64 MB bus GB/s).
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/tp-bench}
export BENCH_RESULTS_DIR=${BENCH_RESULTS_DIR:-benches/results/nccl-sweep}
mkdir -p "$BENCH_RESULTS_DIR"
summary=$BENCH_RESULTS_DIR/sweep.tsv
settings=(
  ""
  "--nccl-proto LL" "--nccl-proto LL128" "--nccl-proto Simple"
  "--nccl-algo Ring" "--nccl-algo Tree"
  "--nccl-max-ctas 8" "--nccl-max-ctas 16" "--nccl-max-ctas 32" "--nccl-max-ctas 64"
  "--nccl-min-ctas 4 --nccl-max-ctas 4" "--nccl-min-ctas 8 --nccl-max-ctas 8"
  "--nccl-min-ctas 16 --nccl-max-ctas 16" "--nccl-min-ctas 24 --nccl-max-ctas 24"
  "--nccl-min-ctas 32 --nccl-max-ctas 32" "--nccl-min-ctas 32 --nccl-max-ctas 64"
  "--nccl-cga-cluster-size 0" "--nccl-cga-cluster-size 2"
  "--nccl-proto Simple --nccl-min-ctas 32 --nccl-max-ctas 32"
  "--nccl-proto LL128 --nccl-min-ctas 32 --nccl-max-ctas 32"
  "--nccl-proto LL128 --nccl-min-ctas 16 --nccl-max-ctas 16"
  "--nccl-proto LL --nccl-min-ctas 16 --nccl-max-ctas 16"
)

if [[ -z ${FULL:-} ]]; then
  printf 'setting\tdecode_us\tprefill_us\tbusbw_64MB_gbps\n' >"$summary"
  for s in "${settings[@]}"; do
    echo "=== all-reduces: ${s:-NCCL defaults}"
    # $s unquoted on purpose: a setting is several flags.
    log=$(timeout 120 "$bin" --allreduce-only --ranks 2 $s 2>&1)
    rc=$?
    echo "$log"
    csv=$(sed -n 's/^wrote \(.*\.csv\)$/\1/p' <<<"$log")
    if [[ $rc -ne 0 || -z $csv ]]; then
      echo "=== failed ($rc): ${s:-NCCL defaults}"
      continue
    fi
    # Columns: ranks, what, elements, bytes, us, algbw_gbps, busbw_gbps, ...
    awk -F, -v s="${s:-default}" '$2=="decode"{d=$5} $2=="prefill"{p=$5} $2=="sweep"&&$4==67108864{b=$7}
      END{printf "%s\t%s\t%s\t%s\n", s, d, p, b}' "$csv" >>"$summary"
  done
  echo "=== sweep (fastest prefill-size all-reduce first)"
  table() { if command -v column >/dev/null; then column -t -s$'\t'; else cat; fi; }
  (head -1 "$summary"; tail -n +2 "$summary" | sort -t$'\t' -k3,3g) | table
  best_prefill=$(tail -n +2 "$summary" | sort -t$'\t' -k3,3g | head -1 | cut -f1)
  best_decode=$(tail -n +2 "$summary" | sort -t$'\t' -k2,2g | head -1 | cut -f1)
  if [[ $best_decode == "$best_prefill" ]]; then
    best_decode=$(tail -n +2 "$summary" | sort -t$'\t' -k3,3g | sed -n 2p | cut -f1)
  fi
  FULL="$best_prefill|$best_decode"
  [[ ${FULL_DEFAULT:-0} == 1 ]] && FULL="default|$FULL"
  echo "=== best by prefill size: $best_prefill; by decode size (or runner-up): $best_decode"
  [[ ${SKIP_FULL:-0} == 1 ]] && exit 0
fi

IFS='|' read -r -a full <<<"$FULL"
for s in "${full[@]}"; do
  [[ $s == default ]] && s=""
  echo "=== Llama-3.1-8B, ranks 1,2: ${s:-NCCL defaults}"
  timeout 900 "$bin" --ranks 1,2 --steps 16 --reps 3 $s || echo "=== failed ($?): ${s:-NCCL defaults}"
done
