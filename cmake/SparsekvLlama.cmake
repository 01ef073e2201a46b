# llama.cpp with sparsekv's attention hook (integrations/llama.cpp/attn-hook.patch)
# as the static library `llama`, built from the llama.cpp source that
# scripts/setup caches (cmake/SparsekvGgml.cmake). The cache is never written:
# configure copies its include/ and src/ to ${PROJECT_BINARY_DIR}/_deps/llama.cpp-patched
# and applies the patch there, again whenever the patch or the source changes.
#
# Sets SPARSEKV_HAS_LLAMA (ON/OFF) and, when ON, the target llama (EXCLUDE_FROM_ALL;
# links ggml and ggml-cpu) and SPARSEKV_LLAMA_EXT_INCLUDE, the folder holding the
# patched llama-ext.h alone (the hook's API), which llama also exports to its consumers.
option(SPARSEKV_LLAMA "Build the patched llama.cpp and the sparsekv llama.cpp integration" ON)

set(SPARSEKV_HAS_LLAMA OFF)
if(NOT SPARSEKV_LLAMA)
  message(STATUS "sparsekv: llama.cpp off (SPARSEKV_LLAMA=OFF)")
  return()
endif()
include(${CMAKE_CURRENT_LIST_DIR}/SparsekvGgml.cmake)
if(NOT SPARSEKV_HAS_GGML)
  message(STATUS "sparsekv: llama.cpp off (no ggml: its llama.cpp source is not there or SPARSEKV_WITH_GGML=OFF)")
  return()
endif()
if(TARGET llama)
  set(SPARSEKV_HAS_LLAMA ON)  # included twice
  return()
endif()

set(_skv_llama_patch "${PROJECT_SOURCE_DIR}/integrations/llama.cpp/attn-hook.patch")
set(_skv_llama_dir "${PROJECT_BINARY_DIR}/_deps/llama.cpp-patched")
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS
             "${_skv_llama_patch}" "${SPARSEKV_LLAMA_CPP_DIR}/.sparsekv-source")

# The stamp names the source (its checksum line from scripts/setup) and the patch (its hash).
file(SHA256 "${_skv_llama_patch}" _skv_patch_hash)
file(READ "${SPARSEKV_LLAMA_CPP_DIR}/.sparsekv-source" _skv_source_id)
set(_skv_stamp_text "${SPARSEKV_LLAMA_CPP_DIR}\n${_skv_source_id}\npatch ${_skv_patch_hash}\n")
set(_skv_stamp "${_skv_llama_dir}/.sparsekv-patched")
set(_skv_stamp_old "")
if(EXISTS "${_skv_stamp}")
  file(READ "${_skv_stamp}" _skv_stamp_old)
endif()
if(NOT _skv_stamp_old STREQUAL _skv_stamp_text)
  message(STATUS "sparsekv: patching llama.cpp into ${_skv_llama_dir}")
  find_program(SPARSEKV_PATCH_EXECUTABLE patch)
  if(NOT SPARSEKV_PATCH_EXECUTABLE)
    message(FATAL_ERROR "sparsekv: `patch` is needed to build llama.cpp (or configure with -DSPARSEKV_LLAMA=OFF)")
  endif()
  # Patch a fresh copy beside the tree, then move over only the files that differ,
  # so that a changed patch recompiles only what it touches.
  set(_skv_tmp "${_skv_llama_dir}.tmp")
  file(REMOVE_RECURSE "${_skv_tmp}")
  file(MAKE_DIRECTORY "${_skv_tmp}")
  file(COPY "${SPARSEKV_LLAMA_CPP_DIR}/include" "${SPARSEKV_LLAMA_CPP_DIR}/src" "${SPARSEKV_LLAMA_CPP_DIR}/common"
            "${SPARSEKV_LLAMA_CPP_DIR}/vendor" DESTINATION "${_skv_tmp}")
  foreach(_tool server completion perplexity batched-bench mtmd)
    file(COPY "${SPARSEKV_LLAMA_CPP_DIR}/tools/${_tool}" DESTINATION "${_skv_tmp}/tools")
  endforeach()
  file(COPY "${SPARSEKV_LLAMA_CPP_DIR}/tools/ui/CMakeLists.txt" "${SPARSEKV_LLAMA_CPP_DIR}/tools/ui/ui.h.in"
            "${SPARSEKV_LLAMA_CPP_DIR}/tools/ui/ui.cpp.in" DESTINATION "${_skv_tmp}/tools/ui")
  file(COPY "${SPARSEKV_LLAMA_CPP_DIR}/scripts/ui-assets.cmake" DESTINATION "${_skv_tmp}/scripts")
  execute_process(COMMAND "${SPARSEKV_PATCH_EXECUTABLE}" -p1 --forward --batch -i "${_skv_llama_patch}"
                  WORKING_DIRECTORY "${_skv_tmp}"
                  RESULT_VARIABLE _skv_rc OUTPUT_VARIABLE _skv_out ERROR_VARIABLE _skv_out)
  if(NOT _skv_rc EQUAL 0)
    file(REMOVE_RECURSE "${_skv_tmp}")
    message(FATAL_ERROR "sparsekv: ${_skv_llama_patch} does not apply to ${SPARSEKV_LLAMA_CPP_DIR} "
                        "(patch exit code ${_skv_rc}):\n${_skv_out}")
  endif()
  set(_skv_copied include src common vendor tools scripts)
  list(TRANSFORM _skv_copied APPEND "/*" OUTPUT_VARIABLE _skv_globs)
  list(TRANSFORM _skv_globs PREPEND "${_skv_tmp}/" OUTPUT_VARIABLE _skv_new_globs)
  list(TRANSFORM _skv_globs PREPEND "${_skv_llama_dir}/" OUTPUT_VARIABLE _skv_old_globs)
  file(GLOB_RECURSE _skv_new RELATIVE "${_skv_tmp}" ${_skv_new_globs})
  list(FILTER _skv_new EXCLUDE REGEX "\\.(orig|rej)$")
  file(GLOB_RECURSE _skv_old RELATIVE "${_skv_llama_dir}" ${_skv_old_globs})
  foreach(_f IN LISTS _skv_old)
    if(NOT _f IN_LIST _skv_new)
      file(REMOVE "${_skv_llama_dir}/${_f}")
    endif()
  endforeach()
  foreach(_f IN LISTS _skv_new)
    get_filename_component(_d "${_skv_llama_dir}/${_f}" DIRECTORY)
    file(MAKE_DIRECTORY "${_d}")
    file(COPY_FILE "${_skv_tmp}/${_f}" "${_skv_llama_dir}/${_f}" ONLY_IF_DIFFERENT)
  endforeach()
  file(REMOVE_RECURSE "${_skv_tmp}")
  file(WRITE "${_skv_stamp}" "${_skv_stamp_text}")
endif()

# The hook's API alone, so that consumers do not see llama.cpp's internal headers.
set(SPARSEKV_LLAMA_EXT_INCLUDE "${_skv_llama_dir}/ext")
file(MAKE_DIRECTORY "${SPARSEKV_LLAMA_EXT_INCLUDE}")
file(COPY_FILE "${_skv_llama_dir}/src/llama-ext.h" "${SPARSEKV_LLAMA_EXT_INCLUDE}/llama-ext.h" ONLY_IF_DIFFERENT)

# The sources of llama.cpp's src/CMakeLists.txt: its core list and models/*.cpp.
set(_skv_src "${_skv_llama_dir}/src")
file(READ "${_skv_src}/CMakeLists.txt" _skv_cmakelists)
if(NOT _skv_cmakelists MATCHES "set\\(LLAMA_CORE_SOURCES([^)]*)\\)")
  message(FATAL_ERROR "sparsekv: no LLAMA_CORE_SOURCES in ${_skv_src}/CMakeLists.txt")
endif()
string(REGEX REPLACE "[ \t\r\n]+" ";" _skv_core "${CMAKE_MATCH_1}")
list(FILTER _skv_core INCLUDE REGEX "\\.cpp$")
list(TRANSFORM _skv_core PREPEND "${_skv_src}/")
file(GLOB _skv_models "${_skv_src}/models/*.cpp")

# llama-version.h: the llama-cpp-python release the source came from.
set(LLAMA_VERSION "${SPARSEKV_LLAMA_CPP_VERSION}+sparsekv")
set(LLAMA_BUILD_COMMIT "unknown")
configure_file("${_skv_src}/llama-version.h.in" "${PROJECT_BINARY_DIR}/_deps/llama.cpp-build/llama-version.h" @ONLY)

add_library(llama STATIC EXCLUDE_FROM_ALL ${_skv_core} ${_skv_models})
# As llama.cpp builds it: C++17 ("don't bump"), the models in unity batches of 16;
# static, so neither LLAMA_SHARED nor LLAMA_BUILD. Its own code, its warnings off.
set_target_properties(llama PROPERTIES
  CXX_STANDARD 17 CXX_STANDARD_REQUIRED ON CXX_EXTENSIONS OFF
  UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE 16)
set_source_files_properties(${_skv_core} PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
target_include_directories(llama
  PUBLIC  "${_skv_llama_dir}/include" "${SPARSEKV_LLAMA_EXT_INCLUDE}"
  PRIVATE "${_skv_src}" "${PROJECT_BINARY_DIR}/_deps/llama.cpp-build")
target_compile_options(llama PRIVATE -w)
target_link_libraries(llama PUBLIC ggml ggml-cpu)

set(SPARSEKV_HAS_LLAMA ON)
message(STATUS "sparsekv: llama.cpp ${SPARSEKV_LLAMA_CPP_VERSION} with the attention hook (target llama)")

# llama.cpp's own programs (integrations/llama.cpp/programs/CMakeLists.txt), with --sparse-attn.
option(SPARSEKV_LLAMA_PROGRAMS "Build llama-server, llama-completion, llama-perplexity and llama-batched-bench" ON)
if(SPARSEKV_LLAMA_PROGRAMS)
  file(COPY_FILE "${PROJECT_SOURCE_DIR}/integrations/llama.cpp/programs/CMakeLists.txt"
       "${_skv_llama_dir}/CMakeLists.txt" ONLY_IF_DIFFERENT)
  set(SPARSEKV_LLAMA_PROGRAMS_OUTPUT "${CMAKE_RUNTIME_OUTPUT_DIRECTORY}")
  add_subdirectory("${_skv_llama_dir}" "${PROJECT_BINARY_DIR}/_deps/llama.cpp-programs" EXCLUDE_FROM_ALL)
endif()
