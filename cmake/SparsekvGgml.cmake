# ggml's CPU backend, built from the llama.cpp source that scripts/setup
# caches (the PyPI sdist llama-cpp-python==0.3.36, vendor/llama.cpp, checked
# by SHA-256), for sparsekv-bench-host's ggml_flash_attn_ext column. Nothing
# is downloaded here: without the cache SPARSEKV_HAS_GGML is OFF and the
# benchmark builds without that column.
#
# What is built: ggml-base and ggml-cpu, static, native ISA, no OpenMP (ggml's
# own thread pool, which the benchmark creates with the thread count it
# measures), no llamafile sgemm or weight repacking (matrix-product paths
# flash attention does not take) unless SPARSEKV_LLAMA (cmake/SparsekvLlama.cmake)
# builds llama.cpp, whose matrix products need them for its normal CPU speed.
# EXCLUDE_FROM_ALL: only the targets linking it build it, and its install rules
# are not part of sparsekv's.
#
# Sets SPARSEKV_HAS_GGML (ON/OFF) and, when ON, the targets ggml and ggml-cpu.
set(SPARSEKV_LLAMA_CPP_VERSION 0.3.36)
if(DEFINED ENV{SPARSEKV_LLAMA_CPP_DIR})
  set(_sparsekv_llama_cpp_default "$ENV{SPARSEKV_LLAMA_CPP_DIR}")
else()
  set(_sparsekv_llama_cpp_default "$ENV{HOME}/.cache/sparsekv/llama.cpp-${SPARSEKV_LLAMA_CPP_VERSION}")
endif()
set(SPARSEKV_LLAMA_CPP_DIR "${_sparsekv_llama_cpp_default}" CACHE PATH
    "llama.cpp source tree extracted by scripts/setup (ggml/ inside it)")
option(SPARSEKV_WITH_GGML "Build ggml's CPU backend from SPARSEKV_LLAMA_CPP_DIR when it is there" ON)

set(SPARSEKV_HAS_GGML OFF)
if(NOT SPARSEKV_WITH_GGML)
  message(STATUS "sparsekv: ggml off (SPARSEKV_WITH_GGML=OFF)")
elseif(TARGET ggml-cpu)
  set(SPARSEKV_HAS_GGML ON)  # included twice, or the parent project brought its own
elseif(NOT EXISTS "${SPARSEKV_LLAMA_CPP_DIR}/.sparsekv-source"
       OR NOT EXISTS "${SPARSEKV_LLAMA_CPP_DIR}/ggml/CMakeLists.txt")
  message(STATUS "sparsekv: no llama.cpp source at ${SPARSEKV_LLAMA_CPP_DIR} (scripts/setup fetches it); "
                 "sparsekv-bench-host builds without its ggml column")
else()
  block(SCOPE_FOR VARIABLES)
    # Normal variables override ggml's option() defaults (CMP0077).
    set(BUILD_SHARED_LIBS OFF)
    set(GGML_STATIC OFF)  # ON would also link libc statically
    set(GGML_BACKEND_DL OFF)
    set(GGML_CPU ON)
    set(GGML_NATIVE ON)
    set(GGML_OPENMP OFF)
    if(SPARSEKV_LLAMA)
      set(GGML_LLAMAFILE ON)
      set(GGML_CPU_REPACK ON)
    else()
      set(GGML_LLAMAFILE OFF)
      set(GGML_CPU_REPACK OFF)
    endif()
    set(GGML_BLAS OFF)
    set(GGML_CUDA OFF)
    set(GGML_VULKAN OFF)
    set(GGML_METAL OFF)
    set(GGML_BUILD_TESTS OFF)
    set(GGML_BUILD_EXAMPLES OFF)
    set(GGML_ALL_WARNINGS OFF)
    # ggml's own ccache switch sets a global launch rule; use ours for C too.
    set(GGML_CCACHE OFF)
    if(SPARSEKV_CCACHE)
      set(CMAKE_C_COMPILER_LAUNCHER ${SPARSEKV_CCACHE})
    endif()
    add_subdirectory("${SPARSEKV_LLAMA_CPP_DIR}/ggml" "${PROJECT_BINARY_DIR}/_deps/ggml" EXCLUDE_FROM_ALL)
  endblock()
  # -march=native turns ggml's AMX matrix kernels on wherever the CPU lists
  # AMX. They load their tile configuration from a local struct, as this
  # probe does; a compiler that drops the struct's stores (GCC 12 does:
  # ldtilecfg is not taken to read it) leaves an invalid configuration, and
  # the first tile load faults (SIGILL in every quantized matrix product).
  # Where the probe does not run, ggml is built without AMX.
  if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64" AND NOT CMAKE_CROSSCOMPILING)
    include(CheckCSourceRuns)
    set(CMAKE_REQUIRED_FLAGS "-march=native -O2")
    check_c_source_runs([=[
      #include <immintrin.h>
      #include <string.h>
      #include <sys/syscall.h>
      #include <unistd.h>
      static char data[16 * 64];
      int main(void) {
      #if defined(__AMX_TILE__) && defined(__AMX_INT8__)
        unsigned char config[64];
        if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 1;
        memset(config, 0, sizeof config);
        config[0] = 1;   /* palette */
        config[16] = 64; /* tile 0: 64 bytes a row */
        config[48] = 16; /* 16 rows */
        _tile_loadconfig(config);
        _tile_loadd(0, data, 64);
        _tile_release();
      #endif
        return 0;
      }]=] SPARSEKV_NATIVE_AMX_RUNS)
    unset(CMAKE_REQUIRED_FLAGS)
    if(NOT SPARSEKV_NATIVE_AMX_RUNS)
      message(STATUS "sparsekv: AMX tile loads fault with this compiler and CPU: ggml built without AMX")
      target_compile_options(ggml-cpu PRIVATE -mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
    endif()
  endif()
  set(SPARSEKV_HAS_GGML ON)
  message(STATUS "sparsekv: ggml CPU backend from ${SPARSEKV_LLAMA_CPP_DIR}")
endif()
