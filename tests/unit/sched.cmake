pd_add_test(NAME test_sched SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sched.c LABELS unit TIMEOUT 900)
