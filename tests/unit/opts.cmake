# The options table and secrets from flags, files or the environment (common/util/opts.c).
pd_add_test(NAME test_opts SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_opts.c LABELS unit TIMEOUT 60)
