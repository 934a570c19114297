# The options table (common/util/opts.c): command line, environment, --config file.
pd_add_test(NAME test_opts SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_opts.c LABELS unit TIMEOUT 60)
# Failure reports (kernels/base.c): PD_ASSERT and fatal signals print a backtrace.
pd_add_test(NAME test_failure_report SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_failure_report.c
            LABELS unit TIMEOUT 60)
