# Block KV cache manager (common/kvcache): deterministic unit tests and a randomised stress test.
pd_add_test(NAME test_kvcache SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kvcache.c LABELS unit TIMEOUT 60)
pd_add_test(NAME test_kvcache_stress SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kvcache_stress.c LABELS unit TIMEOUT 120)
