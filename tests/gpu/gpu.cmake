# CUDA backend tests (label gpu). Each exits 77 (skipped) where pd_cuda_device_count() is 0: in a
# build without CUDA and on machines without a GPU (CI), so they are always built.
pd_add_test(NAME test_cuda_ops SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_ops.c
            LABELS gpu TIMEOUT 600)
pd_add_test(NAME test_cuda_golden SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_golden.c
            LABELS gpu TIMEOUT 600 ARGS pycoder-12m)
foreach(model pycoder-draft-2m pycoder-qwen2-4m tiny-random-llama31)
  add_test(NAME test_cuda_golden_${model} COMMAND test_cuda_golden ${model})
  set_tests_properties(test_cuda_golden_${model} PROPERTIES LABELS gpu TIMEOUT 600
                       SKIP_RETURN_CODE 77)
endforeach()
# Device sampling (be->ops.sample) against the CPU sampler.
pd_add_test(NAME test_cuda_sample SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_sample.c
            LABELS gpu TIMEOUT 600)
# Decode graphs recorded and replayed as a decode node's batch grows and shrinks (every bucket,
# tables of 8 to 128 blocks), each step against an eager engine; `short` for compute-sanitizer.
pd_add_test(NAME test_cuda_graph_shapes SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cuda_graph_shapes.c
            LABELS gpu TIMEOUT 900)
