# The llama2/llama3/qwen3 tokenizer.json files are stored xz-compressed; the target
# pd_tokenizer_data decompresses them into ${PD_TOKENIZER_DATA_DIR}/<name>/ at build time (with
# their tokenizer_config.json), for the golden, unit and fuzz tests. Included by tests/CMakeLists.txt
# (before the other folders' files: it sorts first) and by tests/fuzz/fuzz.cmake; defined once.
set(PD_TOKENIZER_DATA_DIR ${CMAKE_BINARY_DIR}/tokenizers)
if(NOT TARGET pd_tokenizer_data)
  find_program(PD_XZ_EXECUTABLE xz)
  set(_pd_tok_outputs "")
  if(PD_XZ_EXECUTABLE)
    foreach(_name llama2 llama3 qwen3)
      set(_src ${PROJECT_SOURCE_DIR}/tests/data/tokenizers/${_name})
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
