# Cluster integration tests (label integration): real pd-router, pd-prefill and pd-decode
# processes on 127.0.0.1 with free ports, driven from Python (tests/integration/pdcluster.py).
# They install the pip packages they need (requests, openai, locust) when missing and exit 77
# (skipped) only when that installation fails. Every process is killed at the end.
if(TARGET pd-router AND TARGET pd-prefill AND TARGET pd-decode)
  find_program(PD_PYTHON3 python3)
  if(PD_PYTHON3)
    foreach(t cluster_api cluster_load cluster_faults router_resets router_big_prompts
            router_idle_flood)
      add_test(NAME test_${t}
               COMMAND ${PD_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/test_${t}.py --build ${CMAKE_BINARY_DIR})
      set_tests_properties(test_${t} PROPERTIES LABELS integration TIMEOUT 300
                           SKIP_RETURN_CODE 77 RUN_SERIAL TRUE)
    endforeach()
    # the load test again with decode nodes that take at most one KV message per turn of their
    # loop while sequences decode: the deferred pages must land all the same
    add_test(NAME test_cluster_load_kv_budget
             COMMAND ${PD_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/test_cluster_load.py
                     --build ${CMAKE_BINARY_DIR})
    set_tests_properties(test_cluster_load_kv_budget PROPERTIES LABELS integration TIMEOUT 300
                         SKIP_RETURN_CODE 77 RUN_SERIAL TRUE
                         ENVIRONMENT PD_DECODE_KV_BUDGET_MS=0.001)
  endif()
endif()
