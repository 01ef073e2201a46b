#!/usr/bin/env bash
# Second device call: the fixed tests, sanitizers on the paths that failed or
# never ran under them, then the benchmarks the first call had no time for.
here="$(cd "$(dirname "$0")" && pwd)"; cd "$here"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
deadline=$(( $(date +%s) + ${1:-330} )); phase_a=${2:-130}
L="${OUT:-/tmp/out}/logs"; mkdir -p "$L"
san="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
summary=(); t0=$(date +%s)
T=bin/sparsekv-gpu-tests
timeout $phase_a $T --reporter compact --durations yes >"$L/gpu-tests.log" 2>&1 & p1=$!
timeout $phase_a "$san" --tool initcheck --error-exitcode 9 $T --reporter compact "[attention],[device-decode]" >"$L/san-initcheck.log" 2>&1 & p2=$!
timeout $phase_a "$san" --tool memcheck --error-exitcode 9 $T --reporter compact "[device-decode],[backend],[append]" >"$L/san-memcheck.log" 2>&1 & p3=$!
timeout $phase_a "$san" --tool racecheck --error-exitcode 9 $T --reporter compact "[append],[device-decode]" >"$L/san-racecheck.log" 2>&1 & p4=$!
n=1; for p in $p1 $p2 $p3 $p4; do wait $p; rc=$?; f=$(echo gpu-tests san-initcheck san-memcheck san-racecheck | cut -d' ' -f$n)
  summary+=("$f rc=$rc: $(grep -oE 'ERROR SUMMARY: [0-9]+ error|\([0-9]+ errors' "$L/$f.log" | tail -n1) $(grep -E '^(Passed|Failed|All tests)' "$L/$f.log" | tail -n1)"); n=$((n+1)); done
echo "phase A done at $(( $(date +%s)-t0 ))s"
step() { local name=$1 limit=$2; shift 2; local left=$(( deadline - $(date +%s) ))
  [ $left -gt 15 ] || { summary+=("$name: skipped (deadline)"); return; }
  [ $limit -lt $left ] || limit=$left
  local s=$(date +%s); timeout $limit "$@" >"$L/$name.log" 2>&1; local rc=$?
  summary+=("$name rc=$rc $(( $(date +%s)-s ))s"); }
step bench-select 60 bin/sparsekv-bench-select-cuda --benchmark_min_time=0.05 --benchmark_counters_tabular=true --benchmark_filter='rows:256/'
step bench-lru 30 bin/sparsekv-bench-lru-cuda --benchmark_min_time=0.1 --benchmark_counters_tabular=true
step bench-attention 40 bin/sparsekv-bench-attention-cuda --benchmark_min_time=0.1 --benchmark_counters_tabular=true --benchmark_filter='head_dim:64'
step peer 60 python3 ../benchmarks/peer_attention.py --json "$L/peer.json"
step bench-select-small 40 bin/sparsekv-bench-select-cuda --benchmark_min_time=0.05 --benchmark_counters_tabular=true --benchmark_filter='rows:(8|64)/'
step bench-gather 60 bin/sparsekv-bench-gather-cuda --benchmark_min_time=0.05 --benchmark_counters_tabular=true
printf '%s\n' "${summary[@]}" | tee "$L/summary.txt"
echo "--- test failures"; grep -hE 'failed|FAILED' "$L"/gpu-tests.log | cut -c1-400 | head -30
for t in initcheck memcheck racecheck; do echo "--- $t"; grep -m8 -E '^=========  *(Invalid|Race|Barrier|Uninitialized|Error|Program hit|.*[Ee]rror)|^=========     at' "$L/san-$t.log"; grep -hE 'failed' "$L/san-$t.log" | cut -c1-300 | head -5; done
tar -C "$L/.." -czf "${OUT:-/tmp/out}/logs.tar.gz" logs
