# scripts/bench-compare on two small Google Benchmark JSON runs: the shared
# row's ratio and counters, and the rows only one run has, are reported.
set(before ${WORK_DIR}/bench-compare-before.json)
set(after ${WORK_DIR}/bench-compare-after.json)
file(WRITE ${before} [[{"context": {"host_name": "h"}, "benchmarks": [
  {"name": "BM_A/batch:8/manual_time", "run_type": "iteration", "real_time": 100.0, "time_unit": "us", "over_hbm": 0.25},
  {"name": "BM_A/batch:64/manual_time", "run_type": "iteration", "real_time": 400.0, "time_unit": "us", "over_hbm": 0.4},
  {"name": "BM_A/batch:64/manual_time_mean", "run_type": "aggregate", "real_time": 1.0, "time_unit": "us"}]}]])
file(WRITE ${after} [[{"context": {"host_name": "h"}, "benchmarks": [
  {"name": "BM_A/batch:8/manual_time", "run_type": "iteration", "real_time": 80.0, "time_unit": "us", "over_hbm": 0.3125},
  {"name": "BM_A/batch:1/manual_time", "run_type": "iteration", "real_time": 20.0, "time_unit": "us", "over_hbm": 0.1}]}]])
execute_process(COMMAND ${PYTHON} ${SCRIPT} ${before} ${after}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "bench-compare failed (${rc}): ${err}")
endif()
foreach(expected "| BM_A/batch:8/manual_time | 100 | 80 | 0.800 | 0.25 -> 0.3125 |"
                 "Only before: BM_A/batch:64/manual_time" "Only after: BM_A/batch:1/manual_time")
  string(FIND "${out}" "${expected}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "bench-compare output lacks '${expected}':\n${out}")
  endif()
endforeach()
string(FIND "${out}" "_mean" at)
if(NOT at EQUAL -1)
  message(FATAL_ERROR "bench-compare reported an aggregate row:\n${out}")
endif()
execute_process(COMMAND ${PYTHON} ${SCRIPT} ${before} ${WORK_DIR}/no-such.json
                RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "cannot read")
  message(FATAL_ERROR "bench-compare accepted a missing file (${rc}): ${err}")
endif()
