#!/usr/bin/env bash
# One device call: GPU tests and the four sanitizers concurrently (correctness,
# not timed), then the timed steps one at a time until the deadline.
# usage: session.sh DEADLINE_S [PHASE_A_S]
here="$(cd "$(dirname "$0")" && pwd)"; cd "$here"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
deadline=$(( $(date +%s) + ${1:-470} )); phase_a=${2:-170}
L="${OUT:-/tmp/out}/logs"; mkdir -p "$L"
san="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
{ nvidia-smi; nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max,clocks.max.sm --format=csv; cat build-info; nproc; } >"$L/info.log" 2>&1
summary=()
t0=$(date +%s)
timeout $phase_a bin/sparsekv-gpu-tests --reporter compact --durations yes ${TESTS:-} >"$L/gpu-tests.log" 2>&1 & p_t=$!
declare -A p_s
for tool in ${SANITIZERS:-memcheck racecheck synccheck initcheck}; do
  timeout $phase_a "$san" --tool $tool --error-exitcode 9 bin/sparsekv-gpu-tests --reporter compact ${TESTS:-} >"$L/san-$tool.log" 2>&1 & p_s[$tool]=$!
done
wait $p_t; summary+=("gpu-tests rc=$? $(( $(date +%s)-t0 ))s: $(grep -E '^(Passed|Failed|All tests|test cases)' "$L/gpu-tests.log" | tail -n2 | tr '\n' ' ')")
for tool in "${!p_s[@]}"; do wait ${p_s[$tool]}; rc=$?
  summary+=("$tool rc=$rc: $(grep -oE 'ERROR SUMMARY: [0-9]+ error|\([0-9]+ errors' "$L/san-$tool.log" | tail -n1) $(grep -E '^(Passed|Failed|All tests|test cases)' "$L/san-$tool.log" | tail -n1)"); done
echo "phase A done at $(( $(date +%s)-t0 ))s"
step() { local name=$1 limit=$2; shift 2; local left=$(( deadline - $(date +%s) ))
  [ $left -gt 15 ] || { summary+=("$name: skipped (deadline)"); return; }
  [ $limit -lt $left ] || limit=$left
  local s=$(date +%s); timeout $limit "$@" >"$L/$name.log" 2>&1; local rc=$?
  summary+=("$name rc=$rc $(( $(date +%s)-s ))s"); }
for s in ${TIMED:-decode_loop bench-decode attention select lru gather save peer}; do case $s in
  decode_loop) step decode_loop 90 bin/decode_loop --backend cuda --policy quest,shadowkv --context 16384 --batch 8 --budget 2048 --steps 16 ;;
  bench-decode) step bench-decode 150 bin/sparsekv-bench-decode --benchmark_counters_tabular=true ${DECODE_FILTER:+--benchmark_filter=$DECODE_FILTER} ;;
  peer) step peer 60 python3 ../benchmarks/peer_attention.py --json "$L/peer.json" ;;
  *) step bench-$s 90 bin/sparsekv-bench-$s-cuda --benchmark_min_time=${BENCH_MIN_TIME:-0.1} --benchmark_counters_tabular=true ;;
esac; done
printf '%s\n' "${summary[@]}" | tee "$L/summary.txt"
echo "--- failures"; grep -hE 'FAILED|failed|Failed|error:|ERROR' "$L"/gpu-tests.log | head -40
for t in memcheck racecheck synccheck initcheck; do echo "--- $t"; grep -m6 -E '=========  *(Invalid|Race|Barrier|Uninitialized|Error|Program hit|.*error)' "$L/san-$t.log" 2>/dev/null; done
echo "--- decode_loop"; tail -n 12 "$L/decode_loop.log" 2>/dev/null
tar -C "$L/.." -czf "${OUT:-/tmp/out}/logs.tar.gz" logs
