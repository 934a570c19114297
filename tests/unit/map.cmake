# The program's hash map (pd/map.h, in pdbase).
pd_add_test(NAME test_map SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_map.c LABELS unit TIMEOUT 60)
