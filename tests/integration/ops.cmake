# Operations tests (label integration): pdctl cluster / client / bench against real processes
# on 127.0.0.1, and the deploy/ files (compose, Kubernetes, Dockerfiles, bundle.sh). Python 3
# drives them (standard library; test_deploy_files.py also PyYAML and kubernetes-validate from
# tests/integration/requirements.txt, and fails without them). Each test bounds every wait and
# stops every process it started.
find_package(Python3 COMPONENTS Interpreter)
if(NOT Python3_Interpreter_FOUND)
  message(STATUS "pdserve: Python 3 not found: the pdctl and deploy integration tests are skipped")
  return()
endif()

# Sanitizer builds run several times slower: give the processes more time.
set(_pd_ops_slow 1)
if(PD_SANITIZE)
  set(_pd_ops_slow 3)
endif()

function(pd_add_py_test name script timeout)
  add_test(NAME ${name}
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/${script} ${ARGN})
  set_tests_properties(${name} PROPERTIES LABELS integration TIMEOUT ${timeout}
                       SKIP_RETURN_CODE 77 ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
endfunction()

pd_add_py_test(test_deploy_files test_deploy_files.py 120
               --repo ${PROJECT_SOURCE_DIR} --bin-dir ${PROJECT_BINARY_DIR})
pd_add_py_test(test_deploy_bundle test_deploy_bundle.py 120
               --repo ${PROJECT_SOURCE_DIR} --bin-dir ${PROJECT_BINARY_DIR})

if(TARGET pdctl AND TARGET pd-router)
  # The CPU image built (classic builder, base images from debootstrap) and the compose cluster
  # run with host networking on 127.0.0.1: chat requests, a killed decode container restarted.
  # Label docker (not in the sanitizer run); skipped only where no Docker daemon can start.
  pd_add_py_test(test_deploy_docker test_deploy_docker.py 2400
                 --repo ${PROJECT_SOURCE_DIR} --pdctl $<TARGET_FILE:pdctl>)
  set_tests_properties(test_deploy_docker PROPERTIES LABELS docker RUN_SERIAL TRUE)
endif()

if(TARGET pdctl)
  # pdctl perplexity against the quantization tools' own perplexities (tests/data/quant).
  pd_add_py_test(test_pdctl_perplexity test_pdctl_perplexity.py 600
                 --pdctl $<TARGET_FILE:pdctl> --repo ${PROJECT_SOURCE_DIR})
  # pdctl quantize: FP8 and 4-bit compressed-tensors checkpoints, value by value and perplexity.
  pd_add_py_test(test_pdctl_quantize test_pdctl_quantize.py 600
                 --pdctl $<TARGET_FILE:pdctl> --repo ${PROJECT_SOURCE_DIR})
endif()

if(TARGET pdctl AND TARGET pdclient AND TARGET pd-router AND TARGET pd-prefill AND TARGET pd-decode)
  foreach(t cluster client bench)
    pd_add_py_test(test_pdctl_${t} test_pdctl_${t}.py 240
                   --pdctl $<TARGET_FILE:pdctl> --repo ${PROJECT_SOURCE_DIR} --slow ${_pd_ops_slow})
  endforeach()
  # The supervisor: processes killed and restarted, the router back on its ports, a node given
  # up on, `cluster restart`, and `down` leaving nothing behind.
  pd_add_py_test(test_pdctl_supervise test_pdctl_supervise.py 300
                 --pdctl $<TARGET_FILE:pdctl> --repo ${PROJECT_SOURCE_DIR} --slow ${_pd_ops_slow})
  set_tests_properties(test_pdctl_supervise PROPERTIES RUN_SERIAL TRUE)
  # Decode nodes whose device fails (--fail-device-after) exit 3, are restarted and counted again.
  pd_add_py_test(test_pdctl_device_fault test_pdctl_device_fault.py 300
                 --pdctl $<TARGET_FILE:pdctl> --repo ${PROJECT_SOURCE_DIR} --slow ${_pd_ops_slow})
  set_tests_properties(test_pdctl_device_fault PROPERTIES RUN_SERIAL TRUE)
  # A default cluster against strangers: no joining, no displacing, no KV port, no secret in
  # ps, cluster.json, logs or environments; --insecure runs and warns.
  pd_add_py_test(test_cluster_security test_cluster_security.py 300
                 --pdctl $<TARGET_FILE:pdctl> --repo ${PROJECT_SOURCE_DIR} --slow ${_pd_ops_slow})
  set_tests_properties(test_cluster_security PROPERTIES RUN_SERIAL TRUE)
  # Each starts its own cluster: several at once would only fight over the two cores.
  set_tests_properties(test_pdctl_cluster test_pdctl_client test_pdctl_bench test_pdctl_supervise
                       test_pdctl_device_fault test_cluster_security
                       PROPERTIES RESOURCE_LOCK pdctl_cluster)
endif()
