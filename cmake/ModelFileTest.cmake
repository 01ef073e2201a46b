# sparsekv_add_model_file_test(NAME TARGET [test properties...]): a ctest entry
# running TARGET's [model-file] tests, reported as skipped (exit 77) when the
# SmolLM2 file is not where scripts/setup puts it.
function(sparsekv_add_model_file_test name target)
  set(runner ${CMAKE_CURRENT_BINARY_DIR}/run-${name}.sh)
  file(WRITE ${runner} [=[
#!/bin/sh
# $1: a test binary with [model-file] tests.
f="${SPARSEKV_MODEL_DIR:-$HOME/.cache/sparsekv/models}/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$f" ]; then
  echo "SKIPPED: model file $f not found (run scripts/setup, or set SPARSEKV_MODEL_DIR)"
  exit 77
fi
exec "$1" "[model-file]"
]=])
  add_test(NAME ${name} COMMAND sh ${runner} $<TARGET_FILE:${target}>)
  set_tests_properties(${name} PROPERTIES LABELS "model" SKIP_RETURN_CODE 77 ${ARGN})
endfunction()
