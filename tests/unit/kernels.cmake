# CPU backend: every op against a double-precision reference, for each kernel family the CPU
# can run (generic, avx2, avx512) and for 1 and 3 threads.
pd_add_test(NAME test_cpu_ops SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_cpu_ops.c LABELS unit TIMEOUT 300)
