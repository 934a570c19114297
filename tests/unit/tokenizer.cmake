# Tokenizer unit tests. The decompressed tokenizers come from the pd_tokenizer_data target of
# tests/data/tokenizers.cmake (included first: tests/CMakeLists.txt sorts the .cmake files).
if(NOT TARGET pd_tokenizer_data)
  message(FATAL_ERROR "tests/unit/tokenizer.cmake needs tests/data/tokenizers.cmake")
endif()

pd_add_test(NAME test_tokenizer
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer.c
  LABELS unit TIMEOUT 120
  ARGS ${PD_TOKENIZER_DATA_DIR})
add_dependencies(test_tokenizer pd_tokenizer_data)
# The load-time bound (< 1 s for the 151k-entry Qwen3 tokenizer) is asserted in optimised,
# unsanitized builds only; elsewhere the time is printed.
if(CMAKE_BUILD_TYPE STREQUAL "Release" AND NOT PD_SANITIZE)
  target_compile_definitions(test_tokenizer PRIVATE PD_TOK_ASSERT_LOAD_TIME=1)
endif()

pd_add_test(NAME test_tokenizer_damaged
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer_damaged.c
  LABELS unit TIMEOUT 120)
