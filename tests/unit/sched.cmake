pd_add_test(NAME test_sched SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sched.c LABELS unit TIMEOUT 900)
pd_add_test(NAME test_spec SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_spec.c LABELS unit TIMEOUT 600)
