# Network layer tests (pdnet): only when PD_NET found ZeroMQ and protobuf-c. ZeroMQ traffic stays
# on inproc:// and tcp://127.0.0.1, and every receive has a timeout.
if(TARGET pdnet)
  pd_add_test(NAME test_net_wire SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_net_wire.c
              LIBS pdnet LABELS unit TIMEOUT 120)
  pd_add_test(NAME test_net_kvpack SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_net_kvpack.c
              LIBS pdnet LABELS unit TIMEOUT 60)
  pd_add_test(NAME test_net_kvstage SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_net_kvstage.c
              LIBS pdnet LABELS unit TIMEOUT 120)
  pd_add_test(NAME test_net_crc32 SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_net_crc32.c
              LIBS pdnet LABELS unit TIMEOUT 60)
  pd_add_test(NAME test_net_crcpool SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_net_crcpool.c
              LIBS pdnet LABELS unit TIMEOUT 120)
  pd_add_test(NAME test_net_liveness SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_net_liveness.c
              LIBS pdnet LABELS unit TIMEOUT 30)
  pd_add_test(NAME test_net_zmq SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_net_zmq.c
              LIBS pdnet LABELS unit TIMEOUT 120)
endif()
