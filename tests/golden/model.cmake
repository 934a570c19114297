# Golden parity of the CPU forward, one test per bundled model (one executable).
pd_add_test(NAME test_model_golden SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_model_golden.c
            LABELS golden TIMEOUT 300 ARGS pycoder-12m)
foreach(model pycoder-draft-2m pycoder-qwen2-4m tiny-random-llama31)
  add_test(NAME test_model_golden_${model} COMMAND test_model_golden ${model})
  set_tests_properties(test_model_golden_${model} PROPERTIES LABELS golden TIMEOUT 300
                       SKIP_RETURN_CODE 77)
endforeach()
