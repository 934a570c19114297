# Prometheus metrics registry (common/util/metrics.c).
pd_add_test(NAME test_metrics SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_metrics.c LABELS unit TIMEOUT 60)
