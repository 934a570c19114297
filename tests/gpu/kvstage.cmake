# KV staging between nodes on GPUs (label gpu; each exits 77, skipped, without a CUDA device, so
# they are always built):
#   test_cuda_kvstage  the CUDA kv_gather / kv_scatter / host_alloc against the CPU ops, and
#                      pd_kvstage pack / unpack of device caches against pd_kvpack on host copies
#   test_cluster_gpu   `pdctl cluster up` with GPU prefill and decode nodes on cuda:0 (and a CPU
#                      prefill -> GPU decode cluster): greedy text equals `pdctl generate
#                      --device cuda:0` (tests/integration/test_cluster_gpu.py)
if(TARGET pdnet)
  pd_add_test(NAME test_cuda_kvstage SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_kvstage.c
              LIBS pdnet LABELS gpu TIMEOUT 300)
endif()
find_package(Python3 COMPONENTS Interpreter)
if(Python3_Interpreter_FOUND AND TARGET pdctl AND TARGET pdclient AND TARGET pd-router
   AND TARGET pd-prefill AND TARGET pd-decode)
  add_test(NAME test_cluster_gpu
           COMMAND ${Python3_EXECUTABLE} ${PROJECT_SOURCE_DIR}/tests/integration/test_cluster_gpu.py
                   --pdctl $<TARGET_FILE:pdctl> --repo ${PROJECT_SOURCE_DIR})
  set_tests_properties(test_cluster_gpu PROPERTIES LABELS gpu TIMEOUT 480 SKIP_RETURN_CODE 77
                       RUN_SERIAL TRUE ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
  # --enforce-eager, --no-device-sampling, --profile-gpu (tests/integration/test_gpu_options.py)
  add_test(NAME test_gpu_options
           COMMAND ${Python3_EXECUTABLE} ${PROJECT_SOURCE_DIR}/tests/integration/test_gpu_options.py
                   --pdctl $<TARGET_FILE:pdctl> --repo ${PROJECT_SOURCE_DIR})
  set_tests_properties(test_gpu_options PROPERTIES LABELS gpu TIMEOUT 480 SKIP_RETURN_CODE 77
                       RUN_SERIAL TRUE ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
endif()
