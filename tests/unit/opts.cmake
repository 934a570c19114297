# The options table (common/util/opts.c): command line, environment, --config file.
pd_add_test(NAME test_opts SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_opts.c LABELS unit TIMEOUT 60)
