# common/http/: event loop, HTTP/1.1 parser and server, worker pool (libpdhttp). Real sockets on 127.0.0.1 only.
if(TARGET pdhttp)
  pd_add_test(NAME test_http_evloop SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_http_evloop.c
    LABELS unit TIMEOUT 60 LIBS pdhttp)
  pd_add_test(NAME test_http_parser SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_http_parser.c
    LABELS unit TIMEOUT 60 LIBS pdhttp)
  pd_add_test(NAME test_http_server SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_http_server.c
    LABELS unit TIMEOUT 90 LIBS pdhttp)
  pd_add_test(NAME test_workpool SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_workpool.c
    LABELS unit TIMEOUT 60 LIBS pdhttp)
endif()
