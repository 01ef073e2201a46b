# scripts/gpu-check-session's exit status, with stand-ins for nvidia-smi and a
# bundle's benchmark: 2 without a GPU (nothing runs), 0 when every step that
# ran exited 0, 1 when one failed or was unknown.
set(dir ${WORK_DIR}/gpu-session)
file(REMOVE_RECURSE ${dir})
file(MAKE_DIRECTORY ${dir}/bundle/bin ${dir}/gpu ${dir}/no-gpu ${dir}/out)
file(COPY ${SCRIPT} DESTINATION ${dir}/bundle)
get_filename_component(script_name ${SCRIPT} NAME)
set(session ${dir}/bundle/${script_name})
file(WRITE ${dir}/gpu/nvidia-smi "#!/bin/sh\necho 'GPU 0: stand-in'\n")
file(WRITE ${dir}/no-gpu/nvidia-smi "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
file(WRITE ${dir}/bundle/bin/sparsekv-bench-select-cuda "#!/bin/sh\necho \"$@\"\nexit \${SELECT_EXIT:-0}\n")
file(CHMOD ${dir}/gpu/nvidia-smi ${dir}/no-gpu/nvidia-smi ${dir}/bundle/bin/sparsekv-bench-select-cuda
     PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE)

# NAME PATH_DIR TIMED SELECT_EXIT EXPECTED_RC
function(expect name path_dir timed select_exit expected)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env "PATH=${path_dir}:$ENV{PATH}" "OUT=${dir}/out"
                          "TIMED=${timed}" "SELECT_EXIT=${select_exit}" ${BASH} ${session} 60 0
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL expected)
    message(FATAL_ERROR "${name}: session exited ${rc}, expected ${expected}\n${out}${err}")
  endif()
endfunction()

expect("no GPU" ${dir}/no-gpu "select" 0 2)
if(EXISTS ${dir}/out/logs/bench-select.log)
  message(FATAL_ERROR "no GPU: the session ran a step")
endif()
expect("a step passes" ${dir}/gpu "select=rows:256/" 0 0)
file(READ ${dir}/out/logs/bench-select.log log)
if(NOT log MATCHES "--benchmark_filter=rows:256/")
  message(FATAL_ERROR "the step's filter did not reach the benchmark: ${log}")
endif()
expect("a step fails" ${dir}/gpu "select" 3 1)
expect("an unknown step" ${dir}/gpu "select bogus" 0 1)
