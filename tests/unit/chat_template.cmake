# Jinja2-subset chat template interpreter (common/tokenizer/chat_template.c).
pd_add_test(NAME test_chat_template SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_chat_template.c LABELS unit TIMEOUT 60)
