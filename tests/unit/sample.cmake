# Sampling (common/sample): parameters, pipeline, logprobs, seeds, chi-square distribution
# tests, speculative verification, and a 151936-token timing print.
pd_add_test(NAME test_sample SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sample.c LABELS unit TIMEOUT 60)
pd_add_test(NAME test_sample_stats SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sample_stats.c LABELS unit TIMEOUT 240)
pd_add_test(NAME test_sample_perf SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sample_perf.c LABELS unit TIMEOUT 120)
# The statistical test again (fewer draws) on the SSE2 path (pd_sample_set_portable, as
# --cpu-isa generic sets it): the library picks AVX2 where the CPU has it.
if(TARGET test_sample_stats)
  add_test(NAME test_sample_stats_sse2 COMMAND test_sample_stats quick portable)
  set_tests_properties(test_sample_stats_sse2 PROPERTIES LABELS unit TIMEOUT 120)
endif()
# pd_sampler_dev_spec (device sampling's sparse edits) against pd_sampler_process_logits.
pd_add_test(NAME test_sample_devspec SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_sample_devspec.c LABELS unit TIMEOUT 60)
