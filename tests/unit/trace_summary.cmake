# bench/trace_summary.py (the CUPTI kernel-timeline summary) on a synthetic trace.
find_package(Python3 COMPONENTS Interpreter)
if(Python3_FOUND)
  add_test(NAME test_trace_summary
           COMMAND Python3::Interpreter ${CMAKE_CURRENT_LIST_DIR}/test_trace_summary.py)
  set_tests_properties(test_trace_summary PROPERTIES LABELS unit TIMEOUT 60)
endif()
