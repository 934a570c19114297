# common/model: safetensors reader, config.json, weight layout, RoPE frequencies.
pd_add_test(NAME test_safetensors
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_safetensors.c ${PROJECT_SOURCE_DIR}/tests/st_writer.c
  LABELS unit TIMEOUT 60)
pd_add_test(NAME test_model
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_model.c ${PROJECT_SOURCE_DIR}/tests/st_writer.c
  LABELS unit TIMEOUT 60)
