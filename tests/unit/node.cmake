# Node library tests (pdnode): the page-locked KV frame pool and the outbox's release of payload
# frames. ZeroMQ traffic stays on inproc:// and tcp://127.0.0.1, and every wait has a timeout.
if(TARGET pdnode)
  pd_add_test(NAME test_node_framepool SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_node_framepool.c
              LIBS pdnode LABELS unit TIMEOUT 60)
  pd_add_test(NAME test_node_outbox SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_node_outbox.c
              LIBS pdnode LABELS unit TIMEOUT 60)
endif()
