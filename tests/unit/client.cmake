# pdclient (pd/client.h): the C client of the router's ZeroMQ client API, against a scripted
# stand-in for the router on tcp://127.0.0.1. Every wait is bounded.
if(TARGET pdclient)
  pd_add_test(NAME test_client SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_client.c
              LIBS pdclient LABELS unit TIMEOUT 60)
endif()
