# common/model: safetensors reader, config.json, weight layout, RoPE frequencies.
pd_add_test(NAME test_safetensors
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_safetensors.c ${PROJECT_SOURCE_DIR}/tests/st_writer.c
  LABELS unit TIMEOUT 60)
pd_add_test(NAME test_model
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_model.c ${PROJECT_SOURCE_DIR}/tests/st_writer.c
  LABELS unit TIMEOUT 60)
# 4-bit checkpoints made by GPTQModel, AutoAWQ and llm-compressor (tests/data/quant): loading,
# the engine's 4-bit rows and CPU kernels against the tools' own float32 references.
pd_add_test(NAME test_quant SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_quant.c LABELS unit TIMEOUT 300)
# The same checkpoints on a GPU (label gpu; exits 77, skipped, without a CUDA device): the CUDA
# backend's 4-bit and FP8 kernels with the bf16 tolerances.
add_test(NAME test_quant_gpu COMMAND test_quant --device cuda:0)
set_tests_properties(test_quant_gpu PROPERTIES LABELS gpu TIMEOUT 300 SKIP_RETURN_CODE 77)
