# pdctl make-model (tools/cmd_make_model.c, run in-process) and the safetensors writer
# (common/model/st_write.c).
pd_add_test(NAME test_make_model
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_make_model.c ${PROJECT_SOURCE_DIR}/tools/cmd_make_model.c
          ${PROJECT_SOURCE_DIR}/tests/st_writer.c
  LABELS unit TIMEOUT 60)
target_include_directories(test_make_model PRIVATE ${PROJECT_SOURCE_DIR}/tools)
