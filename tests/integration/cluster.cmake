# Cluster integration tests (label integration): real pd-router, pd-prefill and pd-decode
# processes on 127.0.0.1 with free ports, driven from Python (tests/integration/pdcluster.py).
# They install the pip packages they need (requests, openai, locust) when missing and exit 77
# (skipped) only when that installation fails. Every process is killed at the end.
if(TARGET pd-router AND TARGET pd-prefill AND TARGET pd-decode)
  find_program(PD_PYTHON3 python3)
  if(PD_PYTHON3)
    foreach(t cluster_api cluster_load cluster_faults router_resets cluster_device_fault
            router_big_prompts router_idle_flood cluster_openai cluster_unified cluster_spec)
      add_test(NAME test_${t}
               COMMAND ${PD_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/test_${t}.py --build ${CMAKE_BINARY_DIR})
      set_tests_properties(test_${t} PROPERTIES LABELS integration TIMEOUT 300
                           SKIP_RETURN_CODE 77 RUN_SERIAL TRUE)
    endforeach()
    # the load test again with decode nodes that take at most one KV message per turn of their
    # loop while sequences decode: the deferred pages must land all the same
    add_test(NAME test_cluster_load_kv_budget
             COMMAND ${PD_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/test_cluster_load.py
                     --build ${CMAKE_BINARY_DIR} --decode-arg=--kv-budget-ms=0.001)
    set_tests_properties(test_cluster_load_kv_budget PROPERTIES LABELS integration TIMEOUT 300
                         SKIP_RETURN_CODE 77 RUN_SERIAL TRUE)
  endif()
endif()
# Serving under load on one GPU with CUDA graphs (label gpu: run on a GPU machine; skipped where
# `pdctl devices` reports none). test_cluster_gpu_load_memcheck: its short form with the nodes
# under compute-sanitizer memcheck. test_cluster_device_fault_gpu: the device-fault test with
# the nodes on cuda:0.
if(TARGET pd-router AND TARGET pd-prefill AND TARGET pd-decode AND PD_PYTHON3)
  add_test(NAME test_cluster_gpu_load
           COMMAND ${PD_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/test_cluster_gpu_load.py
                   --build ${CMAKE_BINARY_DIR})
  set_tests_properties(test_cluster_gpu_load PROPERTIES LABELS gpu TIMEOUT 1200
                       SKIP_RETURN_CODE 77 RUN_SERIAL TRUE)
  add_test(NAME test_cluster_gpu_load_memcheck
           COMMAND ${PD_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/test_cluster_gpu_load.py
                   --build ${CMAKE_BINARY_DIR} --memcheck)
  set_tests_properties(test_cluster_gpu_load_memcheck PROPERTIES LABELS gpu TIMEOUT 1800
                       SKIP_RETURN_CODE 77 RUN_SERIAL TRUE)
  # a node's device failing for real (a trapping kernel) under load
  add_test(NAME test_cluster_device_fault_gpu
           COMMAND ${PD_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/test_cluster_device_fault.py
                   --build ${CMAKE_BINARY_DIR} --gpu)
  set_tests_properties(test_cluster_device_fault_gpu PROPERTIES LABELS gpu TIMEOUT 600
                       SKIP_RETURN_CODE 77 RUN_SERIAL TRUE)
endif()
