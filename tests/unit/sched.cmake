pd_add_test(NAME test_sched SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sched.c LABELS unit TIMEOUT 900)
pd_add_test(NAME test_spec SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_spec.c LABELS unit TIMEOUT 600)
# The same program's greedy part on the GPU (label gpu; skipped without one): draft and
# n-gram, fixed and adaptive, preemption, with the model and the draft on cuda:0, equal to plain
# decoding up to the first near-tie.
add_test(NAME test_cuda_spec COMMAND test_spec cuda:0)
set_tests_properties(test_cuda_spec PROPERTIES LABELS gpu TIMEOUT 600 SKIP_RETURN_CODE 77)
