# Tokenizer golden test: exact ids and decoded text for every entry of
# tests/data/golden/tokenizer_reference.json (llama2, llama3, qwen3, pycoder).
#
# The llama2/llama3/qwen3 tokenizers are decompressed into ${PD_TOKENIZER_DATA_DIR} by the
# pd_tokenizer_data target of tests/data/tokenizers.cmake, and that directory is passed to the tests.
pd_add_test(NAME test_tokenizer_golden
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer_golden.c
  LABELS golden TIMEOUT 120
  ARGS ${PD_TOKENIZER_DATA_DIR})
add_dependencies(test_tokenizer_golden pd_tokenizer_data)
