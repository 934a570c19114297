# Differential HTTP parsing (label integration; issue 30, part 2): pdserve's request parser
# (through http_parse_dump, which prints what it parsed as JSON) against llhttp (the httptools
# package of tests/integration/requirements.txt) on every hand-written case and thousands of
# generated and mutated ones, request-smuggling shapes included. Where they disagree, RFC 9112
# decides; each such case is on the test's allow-list with its section. A missing httptools
# fails the test.
if(TARGET pdhttp)
  find_package(Python3 COMPONENTS Interpreter)
  add_executable(http_parse_dump ${CMAKE_CURRENT_LIST_DIR}/http_parse_dump.c)
  target_link_libraries(http_parse_dump PRIVATE pdhttp)
  if(NOT Python3_Interpreter_FOUND)
    message(STATUS "pdserve: Python 3 not found: test_http_differential is skipped")
    return()
  endif()
  add_test(NAME test_http_differential
           COMMAND ${Python3_EXECUTABLE} ${CMAKE_CURRENT_LIST_DIR}/test_http_differential.py
                   --dump $<TARGET_FILE:http_parse_dump> --repo ${PROJECT_SOURCE_DIR})
  set_tests_properties(test_http_differential PROPERTIES LABELS integration TIMEOUT 300
                       ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
endif()
