# Fuzz targets (issue 30): one per parser of untrusted bytes, each a tests/fuzz/fuzz_<name>.c
# that defines LLVMFuzzerTestOneInput (and LLVMFuzzerInitialize where it loads data once).
#   - PD_FUZZ=ON (clang): fuzz_<name>, linked with libFuzzer, ASan and UBSan; the target `fuzz`
#     builds them all and tests/fuzz/run.sh runs each for a bounded time (tests/fuzz/README.md).
#   - every test build: test_fuzz_<name> (label unit) replays tests/fuzz/corpus/<name>/ (the seeds
#     and every input that once failed) through the same code with replay.c, so a regression
#     fails with gcc and without libFuzzer too.
# Included by tests/CMakeLists.txt (its *.cmake glob) and, with PD_FUZZ, by the top-level
# CMakeLists.txt: each target is defined once, whichever comes first.
include(${PROJECT_SOURCE_DIR}/tests/data/tokenizers.cmake)
set(_pd_fz ${PROJECT_SOURCE_DIR}/tests/fuzz)

# pd_fuzz_target(name LIBS lib ... [SOURCES extra.c ...] [DEFS def ...] [INCS dir ...]): LIBS are the libraries
# of the code under test, the lowest that holds it (pdhttp, pdnet, pdapi, pdtokenizer, pdcommon),
# so a fuzzer links no more than the product does there; the replay tests link pdcommon too, as
# every pd_add_test does.
function(pd_fuzz_target name)
  cmake_parse_arguments(F "" "" "SOURCES;LIBS;DEFS;INCS" ${ARGN})
  set(srcs ${_pd_fz}/fuzz_${name}.c ${F_SOURCES})
  set(defs PD_TEST_DATA="${PROJECT_SOURCE_DIR}/tests/data"
           PD_TOKENIZER_DATA_DIR="${PD_TOKENIZER_DATA_DIR}" ${F_DEFS})
  if(PD_FUZZ AND NOT TARGET fuzz_${name})
    add_executable(fuzz_${name} ${srcs})
    target_link_libraries(fuzz_${name} PRIVATE ${F_LIBS})
    target_include_directories(fuzz_${name} PRIVATE ${_pd_fz} ${F_INCS})
    target_compile_definitions(fuzz_${name} PRIVATE ${defs})
    target_compile_options(fuzz_${name} PRIVATE -fsanitize=fuzzer)
    target_link_options(fuzz_${name} PRIVATE -fsanitize=fuzzer)
    add_dependencies(fuzz fuzz_${name} pd_tokenizer_data)
  endif()
  if(COMMAND pd_add_test AND NOT TARGET test_fuzz_${name})
    pd_add_test(NAME test_fuzz_${name} SOURCES ${srcs} ${_pd_fz}/replay.c LABELS unit
                TIMEOUT 300 LIBS ${F_LIBS} ARGS ${_pd_fz}/corpus/${name})
    target_include_directories(test_fuzz_${name} PRIVATE ${_pd_fz} ${F_INCS})
    target_compile_definitions(test_fuzz_${name} PRIVATE ${defs})
    add_dependencies(test_fuzz_${name} pd_tokenizer_data)
  endif()
endfunction()

if(PD_FUZZ AND NOT TARGET fuzz)
  add_custom_target(fuzz)
endif()

# (a) the HTTP/1.1 request parser, pipelined, split at the fuzzer's points
if(TARGET pdhttp)
  pd_fuzz_target(http LIBS pdhttp)
endif()
# (b) the OpenAI request validation: strict JSON, then the router's checks of completions and
#     chat bodies into sampling parameters, prompts and messages (router/api.c), without a
#     running router: pd-router's own sources, its main() renamed out of the way
if(TARGET pd-router)
  get_target_property(_pd_router_srcs pd-router SOURCES)
  foreach(_s IN LISTS _pd_router_srcs)
    if(_s MATCHES "/main\\.c$")
      set_source_files_properties(${_s} PROPERTIES COMPILE_DEFINITIONS main=pd_router_main)
    endif()
  endforeach()
  get_target_property(_pd_router_libs pd-router LINK_LIBRARIES)
  get_target_property(_pd_router_defs pd-router COMPILE_DEFINITIONS)
  get_target_property(_pd_router_dir pd-router SOURCE_DIR) # router.h
  pd_fuzz_target(openai SOURCES ${_pd_router_srcs} LIBS ${_pd_router_libs}
                 DEFS ${_pd_router_defs} INCS ${_pd_router_dir})
endif()
# (c) protobuf envelopes: pd_wire_decode and the validators of every cluster and client message
if(TARGET pdnet)
  pd_fuzz_target(wire LIBS pdnet)
endif()
# (d) model files: the safetensors header (the engine's loader, pdcommon); config.json (pdapi,
#     which the router shares); tokenizer.json with tokenizer_config.json
pd_fuzz_target(safetensors LIBS pdcommon)
pd_fuzz_target(model_config LIBS pdapi)
pd_fuzz_target(tokenizer_files LIBS pdtokenizer)
# (e) the bundled tokenizers: encode and decode of arbitrary bytes and ids
pd_fuzz_target(tokenizer LIBS pdtokenizer)
# (f) the Jinja chat-template interpreter: arbitrary templates and messages
pd_fuzz_target(chat_template LIBS pdtokenizer)
