# Strict JSON parser for client requests (common/util/json.c): a table of accepted and refused
# inputs, with the path of the refused value.
pd_add_test(NAME test_json SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_json.c LABELS unit TIMEOUT 60)
