find_package(Python3 COMPONENTS Interpreter)
if(Python3_FOUND)
  add_test(NAME test_pdctl_cli COMMAND Python3::Interpreter ${CMAKE_CURRENT_LIST_DIR}/test_pdctl_cli.py
           $<TARGET_FILE:pdctl>)
  set_tests_properties(test_pdctl_cli PROPERTIES LABELS golden TIMEOUT 600 SKIP_RETURN_CODE 77)
endif()
