cmake_minimum_required(VERSION 3.25)
# Runs sparsekv-accuracy on a small synthetic Q/K/V trace, written to a
# directory and evaluated again with --trace, and checks the documented JSON
# (keys policy, budget_tokens, rel_error, mass_recall for the seven built-in
# policies at every budget) and the issues' Must-show orderings at each budget:
#   retroinfer < retroinfer_no_estimation (the estimation zone lowers the error)
#   quest, shadowkv, retroinfer < streaming (at equal budget)
#   oracle's mass recall >= the other page selections of the budget's size
#   (streaming, shadowkv), and its per-layer list has one row per layer
# plus dense == exact, --needle's recall (below) and bad arguments failing
# with a message.
set(trace ${WORK_DIR}/accuracy-trace)
set(budgets 128 256 512)
set(knobs --prompt 2048 --steps 16 --layers 4 --budgets 128,256,512)
file(REMOVE_RECURSE ${trace})
execute_process(COMMAND ${ACCURACY} --synthetic ${knobs} --write-trace ${trace} --json
                OUTPUT_VARIABLE json_synthetic RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "sparsekv-accuracy --synthetic exited with ${rc}: ${err}")
endif()
if(NOT EXISTS ${trace}/manifest.txt OR NOT EXISTS ${trace}/layer_003_q.f32)
  message(FATAL_ERROR "--write-trace did not write ${trace}")
endif()
execute_process(COMMAND ${ACCURACY} --trace ${trace} --budgets 128,256,512 --json
                OUTPUT_VARIABLE json RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "sparsekv-accuracy --trace exited with ${rc}: ${err}")
endif()
if(NOT json STREQUAL json_synthetic)
  message(FATAL_ERROR "the written trace evaluates differently:\n${json_synthetic}\nvs\n${json}")
endif()

set(policies dense streaming quest shadowkv retroinfer retroinfer_no_estimation oracle)
string(JSON count LENGTH "${json}")
if(NOT count EQUAL 21)
  message(FATAL_ERROR "expected 21 rows (7 policies x 3 budgets), got ${count}:\n${json}")
endif()
math(EXPR last "${count} - 1")
foreach(i RANGE ${last})
  string(JSON policy GET "${json}" ${i} policy)
  string(JSON budget GET "${json}" ${i} budget_tokens)
  string(JSON err GET "${json}" ${i} rel_error)
  string(JSON recall GET "${json}" ${i} mass_recall)
  if(NOT policy IN_LIST policies OR NOT budget IN_LIST budgets)
    message(FATAL_ERROR "unexpected row ${i}: ${policy} ${budget}")
  endif()
  if(DEFINED seen_${policy}_${budget})
    message(FATAL_ERROR "row ${i}: ${policy} at ${budget} twice")
  endif()
  set(seen_${policy}_${budget} 1)
  if(err LESS 0 OR recall LESS 0 OR recall GREATER 1)
    message(FATAL_ERROR "row ${i} out of range: rel_error ${err}, mass_recall ${recall}")
  endif()
  string(JSON layers LENGTH "${json}" ${i} mass_recall_by_layer_head)
  if(NOT layers EQUAL 4)
    message(FATAL_ERROR "row ${i}: mass_recall_by_layer_head has ${layers} layers, not 4")
  endif()
  set(error_${policy}_${budget} ${err})
  set(recall_${policy}_${budget} ${recall})
endforeach()

# CMake compares numbers as doubles in if(LESS); JSON gives plain decimals / exponents.
foreach(b IN LISTS budgets)
  if(error_dense_${b} GREATER 1e-5 OR recall_dense_${b} LESS 0.99999)
    message(FATAL_ERROR "dense at ${b}: rel_error ${error_dense_${b}}, mass_recall ${recall_dense_${b}} (want exact)")
  endif()
  if(NOT error_retroinfer_${b} LESS error_retroinfer_no_estimation_${b})
    message(FATAL_ERROR "budget ${b}: retroinfer rel_error ${error_retroinfer_${b}} is not below "
                        "retroinfer_no_estimation ${error_retroinfer_no_estimation_${b}}")
  endif()
  foreach(p streaming shadowkv)
    if(recall_oracle_${b} LESS recall_${p}_${b})
      message(FATAL_ERROR "budget ${b}: oracle mass_recall ${recall_oracle_${b}} is below ${p} ${recall_${p}_${b}}")
    endif()
  endforeach()
  foreach(p quest shadowkv retroinfer)
    if(NOT error_${p}_${b} LESS error_streaming_${b})
      message(FATAL_ERROR "budget ${b}: ${p} rel_error ${error_${p}_${b}} is not below streaming "
                          "${error_streaming_${b}}")
    endif()
  endforeach()
endforeach()

# --needle follows prompt tokens by content: Dense attends all of a needle;
# StreamingLLM, which attends its sinks and its recent window, attends the
# first tokens and never a needle in the middle; the needle's dense mass is
# the trace's, the same in every row; the per-step list has one entry per
# step measured (--from-step).
foreach(spec "1000:1016;0" "0:4;1")
  list(GET spec 0 needle)
  list(GET spec 1 want_streaming)
  execute_process(COMMAND ${ACCURACY} --trace ${trace} --budgets 128 --policies dense,streaming,oracle --needle ${needle}
                          --from-step 4 --json
                  OUTPUT_VARIABLE json RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "sparsekv-accuracy --needle ${needle} exited with ${rc}: ${err}")
  endif()
  foreach(i 0 1 2)
    string(JSON policy GET "${json}" ${i} policy)
    string(JSON needle_recall_${policy} GET "${json}" ${i} needle_recall)
    string(JSON needle_mass_${policy} GET "${json}" ${i} needle_mass)
    string(JSON steps LENGTH "${json}" ${i} needle_recall_by_step)
    string(JSON layers LENGTH "${json}" ${i} needle_recall_by_layer_head)
    if(NOT steps EQUAL 12 OR NOT layers EQUAL 4)
      message(FATAL_ERROR "--needle ${needle}, ${policy}: ${steps} steps (want 12) and ${layers} layers (want 4)")
    endif()
  endforeach()
  if(needle_recall_dense LESS 0.99999 OR NOT needle_mass_dense GREATER 0)
    message(FATAL_ERROR "--needle ${needle}: dense needle_recall ${needle_recall_dense}, mass ${needle_mass_dense}")
  endif()
  if((want_streaming EQUAL 0 AND needle_recall_streaming GREATER 0) OR
     (want_streaming EQUAL 1 AND needle_recall_streaming LESS 0.99999))
    message(FATAL_ERROR "--needle ${needle}: streaming needle_recall ${needle_recall_streaming}, want ${want_streaming}")
  endif()
  if(NOT needle_mass_oracle EQUAL needle_mass_dense OR NOT needle_mass_streaming EQUAL needle_mass_dense)
    message(FATAL_ERROR "--needle ${needle}: the dense needle mass differs between rows: dense ${needle_mass_dense}, "
                        "streaming ${needle_mass_streaming}, oracle ${needle_mass_oracle}")
  endif()
endforeach()

# Text output names every policy.
execute_process(COMMAND ${ACCURACY} --synthetic --prompt 256 --steps 4 --layers 1 --budgets 64 --policies dense,streaming
                OUTPUT_VARIABLE text RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR NOT text MATCHES "streaming" OR NOT text MATCHES "rel error")
  message(FATAL_ERROR "text output failed (rc ${rc}):\n${text}")
endif()

foreach(bad "--trace;${WORK_DIR}/missing-trace" "--synthetic;--budgets;0" "--synthetic;--budgets;128,,256"
            "--synthetic;--policies;nope" "--synthetic;--segment-topics;99" "--prompt;64" "--bogus"
            "--synthetic;--trace;${trace}" "--trace;${trace};--needle;1000" "--trace;${trace};--needle;9:3"
            "--trace;${trace};--needle;0:2049" "--trace;${trace};--needle;a:b" "--trace;${trace};--from-step;16")
  execute_process(COMMAND ${ACCURACY} ${bad} RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
  if(NOT rc EQUAL 2 OR NOT err MATCHES "sparsekv-accuracy:")
    message(FATAL_ERROR "'${bad}' should fail with exit 2 and a message, got rc=${rc}: ${err}")
  endif()
endforeach()
