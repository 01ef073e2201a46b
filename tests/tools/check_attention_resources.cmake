# The split attention kernel's resources on sm_90 (docs/performance.md):
# no instantiation spills, and every one keeps at least 6 CTAs of 128 threads
# per SM (the register-held kernel had 2-3 at GQA 4-8): a change that grows
# its registers or shared memory past that fails here, before any GPU run.
get_filename_component(nvcc_dir ${NVCC} DIRECTORY)
set(ENV{PATH} "${nvcc_dir}:$ENV{PATH}")
set(json ${WORK_DIR}/attention-resources.json)
execute_process(COMMAND ${PYTHON} ${SCRIPT} --arch 90 --threads 128 --filter "^decode_split_kernel" --json ${json}
                        ${KERNELS}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "kernel-resources failed (${rc}): ${err}")
endif()
file(READ ${json} doc)
string(JSON count LENGTH "${doc}" kernels)
if(count LESS 24)
  message(FATAL_ERROR "expected 24 split kernel instantiations (head_dim x dtype x group), got ${count}:\n${out}")
endif()
math(EXPR last "${count} - 1")
foreach(i RANGE ${last})
  string(JSON name GET "${doc}" kernels ${i} kernel)
  string(JSON spills GET "${doc}" kernels ${i} spill_store_bytes)
  string(JSON ctas GET "${doc}" kernels ${i} occupancy 0 ctas_per_sm)
  if(NOT spills EQUAL 0 OR ctas LESS 6)
    message(FATAL_ERROR "${name}: ${spills} bytes of spill stores, ${ctas} CTAs/SM at 128 threads "
                        "(want 0 and >= 6):\n${out}")
  endif()
endforeach()
