# Tokenizer golden test: exact ids and decoded text for every entry of
# tests/data/golden/tokenizer_reference.json (llama2, llama3, qwen3, pycoder).
#
# The llama2/llama3/qwen3 tokenizer.json files are stored xz-compressed; they are decompressed
# into ${CMAKE_BINARY_DIR}/tokenizers/<name>/ at build time (with their tokenizer_config.json),
# and that directory is passed to the tests. tests/unit/tokenizer.cmake uses the same target.
if(NOT TARGET pd_tokenizer_data)
  set(PD_TOKENIZER_DATA_DIR ${CMAKE_BINARY_DIR}/tokenizers)
  find_program(PD_XZ_EXECUTABLE xz)
  set(_pd_tok_outputs "")
  if(PD_XZ_EXECUTABLE)
    foreach(_name llama2 llama3 qwen3)
      set(_src ${PD_TEST_DATA}/tokenizers/${_name})
      set(_dst ${PD_TOKENIZER_DATA_DIR}/${_name})
      add_custom_command(
        OUTPUT ${_dst}/tokenizer.json ${_dst}/tokenizer_config.json
        COMMAND ${CMAKE_COMMAND} -E make_directory ${_dst}
        COMMAND sh -c "\"$1\" -dc \"$2\" > \"$3.tmp\" && mv \"$3.tmp\" \"$3\"" sh
                ${PD_XZ_EXECUTABLE} ${_src}/tokenizer.json.xz ${_dst}/tokenizer.json
        COMMAND ${CMAKE_COMMAND} -E copy ${_src}/tokenizer_config.json ${_dst}/tokenizer_config.json
        DEPENDS ${_src}/tokenizer.json.xz ${_src}/tokenizer_config.json
        COMMENT "Decompressing the ${_name} tokenizer"
        VERBATIM)
      list(APPEND _pd_tok_outputs ${_dst}/tokenizer.json ${_dst}/tokenizer_config.json)
    endforeach()
  else()
    message(WARNING "xz not found: the tokenizer tests that need llama2/llama3/qwen3 will skip")
  endif()
  add_custom_target(pd_tokenizer_data ALL DEPENDS ${_pd_tok_outputs})
endif()

pd_add_test(NAME test_tokenizer_golden
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_tokenizer_golden.c
  LABELS golden TIMEOUT 120
  ARGS ${PD_TOKENIZER_DATA_DIR})
add_dependencies(test_tokenizer_golden pd_tokenizer_data)
