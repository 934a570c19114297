# The options table (common/util/opts.c): command line, environment, --config file; secrets from
# flags, files or the environment.
pd_add_test(NAME test_opts SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_opts.c LABELS unit TIMEOUT 60)
pd_add_test(NAME test_secret_opts SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_secret_opts.c
            LABELS unit TIMEOUT 60)
# Failure reports (common/base/base.c): PD_ASSERT and fatal signals print a backtrace.
pd_add_test(NAME test_failure_report SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_failure_report.c
            LABELS unit TIMEOUT 60)
