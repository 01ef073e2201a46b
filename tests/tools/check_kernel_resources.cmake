# scripts/kernel-resources: the occupancy arithmetic against hand-computed
# cases, then the ptxas figures of fixtures/kernel_resources_kernels.cu (a spilling
# kernel, a small one calling a non-inlined function), --filter, and a compile
# error reported with nvcc's message.
get_filename_component(nvcc_dir ${NVCC} DIRECTORY)
set(ENV{PATH} "${nvcc_dir}:$ENV{PATH}")

function(run_tool)
  execute_process(COMMAND ${PYTHON} ${SCRIPT} ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(rc ${rc} PARENT_SCOPE)
  set(out "${out}" PARENT_SCOPE)
  set(err "${err}" PARENT_SCOPE)
endfunction()

# ARCH REGS THREADS SMEM [BARRIERS] | expected. Registers per warp are rounded
# up to 256 and split over 4 sub-partitions of 16384: 142 regs -> 4608 per
# warp, 3 warps per sub-partition, 12 warps = 3 CTAs of 4 warps; 127 -> 4096,
# 4 CTAs (the 25% of the H100 profile); 170 -> 5632 (not 5440), 2 warps per
# sub-partition (not 3); 96 regs on 1-warp CTAs -> 5 per sub-partition = 20
# CTAs (not 65536 / 3072 = 21); 255 regs -> 8 warps, fewer than a 1024-thread
# CTA. 32 regs allow exactly 64 warps, as do 2048 threads. Shared memory:
# 50 KB + 1 KB reserved fits 4 times in 228 KB (sm_90), 3 times in 164 KB
# (sm_80); 57856 B fits 4 times but not with the 1 KB reserved; 45576 + 1024 B
# fits 5 times but not rounded up to 128 B; 227 KB is a block's most. 4
# barriers of the 64 allow 16 CTAs; a block has at most 1024 threads.
foreach(case "90 142 128 0|3 CTAs/SM, occupancy 18.8%, limit regs"
             "90 128 128 0|4 CTAs/SM, occupancy 25.0%, limit regs"
             "90 80 128 0|6 CTAs/SM, occupancy 37.5%, limit regs"
             "90 127 128 0|4 CTAs/SM, occupancy 25.0%, limit regs"
             "90 170 32 0|8 CTAs/SM, occupancy 12.5%, limit regs"
             "90 96 32 0|20 CTAs/SM, occupancy 31.2%, limit regs"
             "90 64 1024 0|1 CTAs/SM, occupancy 50.0%, limit regs"
             "90 255 1024 0|0 CTAs/SM, occupancy 0.0%, limit regs"
             "90 32 256 0|8 CTAs/SM, occupancy 100.0%, limit threads+regs"
             "90 16 32 0|32 CTAs/SM, occupancy 50.0%, limit ctas"
             "90 32 128 51200|4 CTAs/SM, occupancy 25.0%, limit smem"
             "80 32 128 51200|3 CTAs/SM, occupancy 18.8%, limit smem"
             "90 32 128 57856|3 CTAs/SM, occupancy 18.8%, limit smem"
             "90 32 64 45576|4 CTAs/SM, occupancy 12.5%, limit smem"
             "90 32 128 232448|1 CTAs/SM, occupancy 6.2%, limit smem"
             "90 32 128 232449|0 CTAs/SM, occupancy 0.0%, limit smem"
             "90 32 64 0 4|16 CTAs/SM, occupancy 50.0%, limit barriers"
             "90 1 2000 0|0 CTAs/SM, occupancy 0.0%, limit threads")
  string(REPLACE "|" ";" parts "${case}")
  list(GET parts 0 inputs)
  list(GET parts 1 expected)
  string(REPLACE " " ";" inputs "${inputs}")
  list(POP_FRONT inputs arch)
  run_tool(--arch ${arch} --occupancy ${inputs})
  if(NOT rc EQUAL 0 OR NOT out STREQUAL "sm_${arch}: ${expected}\n")
    message(FATAL_ERROR "--arch ${arch} --occupancy ${inputs}: expected '${expected}', got (${rc}) '${out}' ${err}")
  endif()
endforeach()

set(json ${WORK_DIR}/kernel-resources.json)
run_tool(--threads 128,256 --json ${json} ${FIXTURE})
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "kernel-resources failed on the fixture (${rc}): ${out}${err}")
endif()
foreach(expected "| `fixture::pressure_kernel` |" "| `fixture::scale_kernel<256>` |"
                 "64 bytes of __constant__ (cmem[3]")
  string(FIND "${out}" "${expected}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "kernel-resources output lacks '${expected}':\n${out}")
  endif()
endforeach()

file(READ ${json} doc)
string(JSON count LENGTH "${doc}" kernels)
if(NOT count EQUAL 2)
  message(FATAL_ERROR "expected 2 kernels (none for the non-inlined function), got ${count}:\n${doc}")
endif()
string(JSON constants GET "${doc}" module_constant_bytes)
string(JSON constant_count LENGTH "${constants}")
string(JSON constant_bytes MEMBER "${constants}" 0)
string(JSON constant_bytes GET "${constants}" ${constant_bytes})
if(NOT constant_count EQUAL 1 OR NOT constant_bytes EQUAL 64)
  message(FATAL_ERROR "expected one TU with 64 bytes of __constant__: ${constants}")
endif()
foreach(i 0 1)
  string(JSON name GET "${doc}" kernels ${i} kernel)
  foreach(field registers stack_frame_bytes spill_store_bytes spill_load_bytes static_smem_bytes barriers
                param_cmem_bytes)
    string(JSON ${field} GET "${doc}" kernels ${i} ${field})
  endforeach()
  string(JSON ctas_256 GET "${doc}" kernels ${i} occupancy 1 ctas_per_sm)
  string(JSON threads_256 GET "${doc}" kernels ${i} occupancy 1 threads)
  string(CONCAT facts "${name}: ${registers} regs, stack ${stack_frame_bytes}, "
                "spills ${spill_store_bytes}/${spill_load_bytes}, smem ${static_smem_bytes}, ${barriers} barriers, "
                "cmem[0] ${param_cmem_bytes}, ${ctas_256} CTAs @${threads_256}")
  # cmem[0] (the driver's part of bank 0 and the parameters) is read from the cubin.
  if(param_cmem_bytes EQUAL 0 OR NOT threads_256 EQUAL 256)
    message(FATAL_ERROR "${facts}")
  endif()
  if(name STREQUAL "fixture::pressure_kernel")
    # 32 registers at most; 8 CTAs of 256 fill the SM's 64 warps.
    if(registers GREATER 32 OR spill_store_bytes EQUAL 0 OR spill_load_bytes EQUAL 0 OR NOT ctas_256 EQUAL 8)
      message(FATAL_ERROR "pressure_kernel should spill under its 32-register cap: ${facts}")
    endif()
  elseif(name STREQUAL "fixture::scale_kernel<256>")
    # Its own stack frame (the call) and not pick_from_tile's properties, printed after it.
    if(NOT spill_store_bytes EQUAL 0 OR NOT static_smem_bytes EQUAL 1024 OR NOT barriers EQUAL 1
       OR stack_frame_bytes EQUAL 0)
      message(FATAL_ERROR "scale_kernel: ${facts}")
    endif()
  else()
    message(FATAL_ERROR "unexpected kernel ${facts}")
  endif()
endforeach()

run_tool(--filter pressure ${FIXTURE})
string(FIND "${out}" "scale_kernel" at)
if(NOT rc EQUAL 0 OR NOT at EQUAL -1 OR NOT out MATCHES "pressure_kernel")
  message(FATAL_ERROR "--filter pressure (${rc}):\n${out}${err}")
endif()

set(broken ${WORK_DIR}/kernel-resources-broken.cu)
file(WRITE ${broken} "__global__ void broken_kernel(int* p) { *p = undeclared_name; }\n")
run_tool(${broken})
if(rc EQUAL 0 OR NOT err MATCHES "compiling .*kernel-resources-broken.cu failed" OR NOT err MATCHES "undeclared_name")
  message(FATAL_ERROR "a compile error was not reported with nvcc's message (${rc}):\n${out}${err}")
endif()
