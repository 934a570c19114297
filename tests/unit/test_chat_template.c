/* Chat template interpreter tests (common/tokenizer/chat_template.c).
 *
 * Expected outputs below were produced ONCE by Python jinja2 3.1.6 configured exactly like
 * transformers' apply_chat_template (ImmutableSandboxedEnvironment(trim_blocks=True,
 * lstrip_blocks=True, extensions=[loopcontrols]), tojson = json.dumps(ensure_ascii=False),
 * raise_exception, strftime_now), rendering with tools=None and documents=None. They are the
 * reference implementation's output, pasted as literals; this test needs no Python.
 *
 * Covered: byte-exact rendering of ChatML, Llama 2, Llama 3, Llama 3.2 (strftime_now date) and
 * Qwen3 for several conversations with add_generation_prompt on and off; a battery of expression,
 * filter, test, loop, macro and whitespace-control cases; errors (syntax with positions,
 * unsupported tags / filters / functions, raise_exception, runtime type errors); resource bounds
 * (step budget, output cap, memory cap, range size, parser and evaluator nesting); API misuse;
 * concurrent rendering of one parsed template from several threads. */
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "pd/chat_template.h"

static int failures;
#define CHECK(cond, ...)                                            \
  do {                                                              \
    if (!(cond)) {                                                  \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);          \
      fprintf(stderr, __VA_ARGS__);                                 \
      fputc('\n', stderr);                                          \
      failures++;                                                   \
    }                                                               \
  } while (0)

enum { T_CHATML, T_LLAMA3, T_LLAMA2, T_QWEN3, T_LLAMA32, T_COUNT };
typedef struct golden {
  int tmpl;
  const pd_chat_msg *msgs;
  size_t n;
  bool agp;
  const char *expected;
} golden;
typedef struct sem_case {
  const char *tmpl;
  const char *expected;
} sem_case;
#define NMSG(a) (sizeof(a) / sizeof((a)[0]))

/* The classic Meta Llama-2-chat template (as published in its tokenizer_config.json). */
static const char LLAMA2_TEMPLATE[] =
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message "
    "= messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message "
    "= false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') "
    "}}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' "
    "+ system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] "
    "%}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + "
    "' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token "
    "}}{% endif %}{% endfor %}";

static const char LLAMA32_TEMPLATE[] =
    "{{- bos_token }}\n"
    "{%- if custom_tools is defined %}\n"
    "    {%- set tools = custom_tools %}\n"
    "{%- endif %}\n"
    "{%- if not tools_in_user_message is defined %}\n"
    "    {%- set tools_in_user_message = true %}\n"
    "{%- endif %}\n"
    "{%- if not date_string is defined %}\n"
    "    {%- if strftime_now is defined %}\n"
    "        {%- set date_string = strftime_now(\"%d %b %Y\") %}\n"
    "    {%- else %}\n"
    "        {%- set date_string = \"26 Jul 2024\" %}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- if not tools is defined %}\n"
    "    {%- set tools = none %}\n"
    "{%- endif %}\n"
    "\n"
    "{#- This block extracts the system message, so we can slot it into the right place. #}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = \"\" %}\n"
    "{%- endif %}\n"
    "\n"
    "{#- System message #}\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{%- if tools is not none %}\n"
    "    {{- \"Environment: ipython\\n\" }}\n"
    "{%- endif %}\n"
    "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n"
    "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
    "{%- if tools is not none and not tools_in_user_message %}\n"
    "    {{- \"You have access to the following functions. To call a function, please respond with "
    "JSON for a function call.\" }}\n"
    "    {{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument "
    "name and its value}.' }}\n"
    "    {{- \"Do not use variables.\\n\\n\" }}\n"
    "    {%- for t in tools %}\n"
    "        {{- t | tojson(indent=4) }}\n"
    "        {{- \"\\n\\n\" }}\n"
    "    {%- endfor %}\n"
    "{%- endif %}\n"
    "{{- system_message }}\n"
    "{{- \"<|eot_id|>\" }}\n"
    "\n"
    "{#- Custom tools are passed in a user message with some extra guidance #}\n"
    "{%- if tools_in_user_message and not tools is none %}\n"
    "    {#- Extract the first user message so we can plug it in here #}\n"
    "    {%- if messages | length != 0 %}\n"
    "        {%- set first_user_message = messages[0]['content']|trim %}\n"
    "        {%- set messages = messages[1:] %}\n"
    "    {%- else %}\n"
    "        {{- raise_exception(\"Cannot put tools in the first user message when there's no first "
    "user message!\") }}\n"
    "    {%- endif %}\n"
    "    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}\n"
    "    {{- \"Given the following functions, please respond with a JSON for a function call \" "
    "}}\n"
    "    {{- \"with its proper arguments that best answers the given prompt.\\n\\n\" }}\n"
    "    {{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of argument "
    "name and its value}.' }}\n"
    "    {{- \"Do not use variables.\\n\\n\" }}\n"
    "    {%- for t in tools %}\n"
    "        {{- t | tojson(indent=4) }}\n"
    "        {{- \"\\n\\n\" }}\n"
    "    {%- endfor %}\n"
    "    {{- first_user_message + \"<|eot_id|>\"}}\n"
    "{%- endif %}\n"
    "\n"
    "{%- for message in messages %}\n"
    "    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) "
    "%}\n"
    "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] "
    "| trim + '<|eot_id|>' }}\n"
    "    {%- elif 'tool_calls' in message %}\n"
    "        {%- if not message.tool_calls|length == 1 %}\n"
    "            {{- raise_exception(\"This model only supports single tool-calls at once!\") }}\n"
    "        {%- endif %}\n"
    "        {%- set tool_call = message.tool_calls[0].function %}\n"
    "        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "        {{- '{\"name\": \"' + tool_call.name + '\", ' }}\n"
    "        {{- '\"parameters\": ' }}\n"
    "        {{- tool_call.arguments | tojson }}\n"
    "        {{- \"}\" }}\n"
    "        {{- \"<|eot_id|>\" }}\n"
    "    {%- elif message.role == \"tool\" or message.role == \"ipython\" %}\n"
    "        {{- \"<|start_header_id|>ipython<|end_header_id|>\\n\\n\" }}\n"
    "        {%- if message.content is mapping or message.content is iterable %}\n"
    "            {{- message.content | tojson }}\n"
    "        {%- else %}\n"
    "            {{- message.content }}\n"
    "        {%- endif %}\n"
    "        {{- \"<|eot_id|>\" }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n";

/* ---- generated by Python jinja2 3.1.6 (transformers environment) ---- */
static const pd_chat_msg CONV_SYS_USER[] = {
    {"system", "You are a helpful assistant."},
    {"user", "Hello!"},
};
static const pd_chat_msg CONV_USER_ONLY[] = {
    {"user", "  Hi there  "},
};
static const pd_chat_msg CONV_MULTI[] = {
    {"system", " Be brief.\n"},
    {"user", "Grüße, 世界 🌍\tok"},
    {"assistant", "\n"
     " Héllo! \n"},
    {"user", "again\r\n"
     "\?  "},
};
static const pd_chat_msg CONV_THINK[] = {
    {"user", "q1"},
    {"assistant", "<think>\n"
     "reasoning here\n"
     "</think>\n"
     "\n"
     "answer one"},
    {"user", "q2"},
    {"assistant", "<think>r2</think>a2"},
};
static const pd_chat_msg CONV_TOOLRESP[] = {
    {"user", "weather\?"},
    {"assistant", "calling"},
    {"tool", "{\"t\": 21}"},
    {"tool", "sunny"},
    {"user", "thanks"},
};
static const pd_chat_msg CONV_BAD_ALT[] = {
    {"user", "a"},
    {"user", "b"},
};

static const golden GOLDEN[] = {
    {T_CHATML, CONV_SYS_USER, NMSG(CONV_SYS_USER), false,
     "<|im_start|>system\n"
     "You are a helpful assistant.<|im_end|>\n"
     "<|im_start|>user\n"
     "Hello!<|im_end|>\n"},
    {T_CHATML, CONV_SYS_USER, NMSG(CONV_SYS_USER), true,
     "<|im_start|>system\n"
     "You are a helpful assistant.<|im_end|>\n"
     "<|im_start|>user\n"
     "Hello!<|im_end|>\n"
     "<|im_start|>assistant\n"},
    {T_CHATML, CONV_USER_ONLY, NMSG(CONV_USER_ONLY), false,
     "<|im_start|>user\n"
     "  Hi there  <|im_end|>\n"},
    {T_CHATML, CONV_USER_ONLY, NMSG(CONV_USER_ONLY), true,
     "<|im_start|>user\n"
     "  Hi there  <|im_end|>\n"
     "<|im_start|>assistant\n"},
    {T_CHATML, CONV_MULTI, NMSG(CONV_MULTI), false,
     "<|im_start|>system\n"
     " Be brief.\n"
     "<|im_end|>\n"
     "<|im_start|>user\n"
     "Grüße, 世界 🌍\tok<|im_end|>\n"
     "<|im_start|>assistant\n"
     "\n"
     " Héllo! \n"
     "<|im_end|>\n"
     "<|im_start|>user\n"
     "again\r\n"
     "\?  <|im_end|>\n"},
    {T_CHATML, CONV_MULTI, NMSG(CONV_MULTI), true,
     "<|im_start|>system\n"
     " Be brief.\n"
     "<|im_end|>\n"
     "<|im_start|>user\n"
     "Grüße, 世界 🌍\tok<|im_end|>\n"
     "<|im_start|>assistant\n"
     "\n"
     " Héllo! \n"
     "<|im_end|>\n"
     "<|im_start|>user\n"
     "again\r\n"
     "\?  <|im_end|>\n"
     "<|im_start|>assistant\n"},
    {T_LLAMA3, CONV_SYS_USER, NMSG(CONV_SYS_USER), false,
     "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n"
     "\n"
     "You are a helpful assistant.<|eot_id|><|start_header_id|>user<|end_header_id|>\n"
     "\n"
     "Hello!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n"
     "\n"},
    {T_LLAMA3, CONV_SYS_USER, NMSG(CONV_SYS_USER), true,
     "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n"
     "\n"
     "You are a helpful assistant.<|eot_id|><|start_header_id|>user<|end_header_id|>\n"
     "\n"
     "Hello!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n"
     "\n"},
    {T_LLAMA3, CONV_USER_ONLY, NMSG(CONV_USER_ONLY), false,
     "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n"
     "\n"
     "Hi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n"
     "\n"},
    {T_LLAMA3, CONV_USER_ONLY, NMSG(CONV_USER_ONLY), true,
     "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n"
     "\n"
     "Hi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n"
     "\n"},
    {T_LLAMA3, CONV_MULTI, NMSG(CONV_MULTI), false,
     "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n"
     "\n"
     "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n"
     "\n"
     "Grüße, 世界 🌍\tok<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n"
     "\n"
     "Héllo!<|eot_id|><|start_header_id|>user<|end_header_id|>\n"
     "\n"
     "again\r\n"
     "\?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n"
     "\n"},
    {T_LLAMA3, CONV_MULTI, NMSG(CONV_MULTI), true,
     "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n"
     "\n"
     "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n"
     "\n"
     "Grüße, 世界 🌍\tok<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n"
     "\n"
     "Héllo!<|eot_id|><|start_header_id|>user<|end_header_id|>\n"
     "\n"
     "again\r\n"
     "\?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n"
     "\n"},
    {T_LLAMA2, CONV_SYS_USER, NMSG(CONV_SYS_USER), false,
     "<s>[INST] <<SYS>>\n"
     "You are a helpful assistant.\n"
     "<</SYS>>\n"
     "\n"
     "Hello! [/INST]"},
    {T_LLAMA2, CONV_SYS_USER, NMSG(CONV_SYS_USER), true,
     "<s>[INST] <<SYS>>\n"
     "You are a helpful assistant.\n"
     "<</SYS>>\n"
     "\n"
     "Hello! [/INST]"},
    {T_LLAMA2, CONV_USER_ONLY, NMSG(CONV_USER_ONLY), false,
     "<s>[INST] Hi there [/INST]"},
    {T_LLAMA2, CONV_USER_ONLY, NMSG(CONV_USER_ONLY), true,
     "<s>[INST] Hi there [/INST]"},
    {T_LLAMA2, CONV_MULTI, NMSG(CONV_MULTI), false,
     "<s>[INST] <<SYS>>\n"
     " Be brief.\n"
     "\n"
     "<</SYS>>\n"
     "\n"
     "Grüße, 世界 🌍\tok [/INST] Héllo! </s><s>[INST] again\r\n"
     "\? [/INST]"},
    {T_LLAMA2, CONV_MULTI, NMSG(CONV_MULTI), true,
     "<s>[INST] <<SYS>>\n"
     " Be brief.\n"
     "\n"
     "<</SYS>>\n"
     "\n"
     "Grüße, 世界 🌍\tok [/INST] Héllo! </s><s>[INST] again\r\n"
     "\? [/INST]"},
    {T_QWEN3, CONV_SYS_USER, NMSG(CONV_SYS_USER), false,
     "<|im_start|>system\n"
     "You are a helpful assistant.<|im_end|>\n"
     "<|im_start|>user\n"
     "Hello!<|im_end|>\n"},
    {T_QWEN3, CONV_SYS_USER, NMSG(CONV_SYS_USER), true,
     "<|im_start|>system\n"
     "You are a helpful assistant.<|im_end|>\n"
     "<|im_start|>user\n"
     "Hello!<|im_end|>\n"
     "<|im_start|>assistant\n"},
    {T_QWEN3, CONV_USER_ONLY, NMSG(CONV_USER_ONLY), false,
     "<|im_start|>user\n"
     "  Hi there  <|im_end|>\n"},
    {T_QWEN3, CONV_USER_ONLY, NMSG(CONV_USER_ONLY), true,
     "<|im_start|>user\n"
     "  Hi there  <|im_end|>\n"
     "<|im_start|>assistant\n"},
    {T_QWEN3, CONV_MULTI, NMSG(CONV_MULTI), false,
     "<|im_start|>system\n"
     " Be brief.\n"
     "<|im_end|>\n"
     "<|im_start|>user\n"
     "Grüße, 世界 🌍\tok<|im_end|>\n"
     "<|im_start|>assistant\n"
     "\n"
     " Héllo! \n"
     "<|im_end|>\n"
     "<|im_start|>user\n"
     "again\r\n"
     "\?  <|im_end|>\n"},
    {T_QWEN3, CONV_MULTI, NMSG(CONV_MULTI), true,
     "<|im_start|>system\n"
     " Be brief.\n"
     "<|im_end|>\n"
     "<|im_start|>user\n"
     "Grüße, 世界 🌍\tok<|im_end|>\n"
     "<|im_start|>assistant\n"
     "\n"
     " Héllo! \n"
     "<|im_end|>\n"
     "<|im_start|>user\n"
     "again\r\n"
     "\?  <|im_end|>\n"
     "<|im_start|>assistant\n"},
    {T_QWEN3, CONV_THINK, NMSG(CONV_THINK), false,
     "<|im_start|>user\n"
     "q1<|im_end|>\n"
     "<|im_start|>assistant\n"
     "answer one<|im_end|>\n"
     "<|im_start|>user\n"
     "q2<|im_end|>\n"
     "<|im_start|>assistant\n"
     "<think>\n"
     "r2\n"
     "</think>\n"
     "\n"
     "a2<|im_end|>\n"},
    {T_QWEN3, CONV_THINK, NMSG(CONV_THINK), true,
     "<|im_start|>user\n"
     "q1<|im_end|>\n"
     "<|im_start|>assistant\n"
     "answer one<|im_end|>\n"
     "<|im_start|>user\n"
     "q2<|im_end|>\n"
     "<|im_start|>assistant\n"
     "<think>\n"
     "r2\n"
     "</think>\n"
     "\n"
     "a2<|im_end|>\n"
     "<|im_start|>assistant\n"},
    {T_QWEN3, CONV_TOOLRESP, NMSG(CONV_TOOLRESP), false,
     "<|im_start|>user\n"
     "weather\?<|im_end|>\n"
     "<|im_start|>assistant\n"
     "calling<|im_end|>\n"
     "<|im_start|>user\n"
     "<tool_response>\n"
     "{\"t\": 21}\n"
     "</tool_response>\n"
     "<tool_response>\n"
     "sunny\n"
     "</tool_response><|im_end|>\n"
     "<|im_start|>user\n"
     "thanks<|im_end|>\n"},
    {T_QWEN3, CONV_TOOLRESP, NMSG(CONV_TOOLRESP), true,
     "<|im_start|>user\n"
     "weather\?<|im_end|>\n"
     "<|im_start|>assistant\n"
     "calling<|im_end|>\n"
     "<|im_start|>user\n"
     "<tool_response>\n"
     "{\"t\": 21}\n"
     "</tool_response>\n"
     "<tool_response>\n"
     "sunny\n"
     "</tool_response><|im_end|>\n"
     "<|im_start|>user\n"
     "thanks<|im_end|>\n"
     "<|im_start|>assistant\n"},
    {T_LLAMA32, CONV_SYS_USER, NMSG(CONV_SYS_USER), false,
     "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n"
     "\n"
     "Cutting Knowledge Date: December 2023\n"
     "Today Date: @DATE@\n"
     "\n"
     "You are a helpful assistant.<|eot_id|><|start_header_id|>user<|end_header_id|>\n"
     "\n"
     "Hello!<|eot_id|>"},
    {T_LLAMA32, CONV_SYS_USER, NMSG(CONV_SYS_USER), true,
     "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n"
     "\n"
     "Cutting Knowledge Date: December 2023\n"
     "Today Date: @DATE@\n"
     "\n"
     "You are a helpful assistant.<|eot_id|><|start_header_id|>user<|end_header_id|>\n"
     "\n"
     "Hello!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n"
     "\n"},
    {T_LLAMA32, CONV_USER_ONLY, NMSG(CONV_USER_ONLY), false,
     "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n"
     "\n"
     "Cutting Knowledge Date: December 2023\n"
     "Today Date: @DATE@\n"
     "\n"
     "<|eot_id|><|start_header_id|>user<|end_header_id|>\n"
     "\n"
     "Hi there<|eot_id|>"},
    {T_LLAMA32, CONV_USER_ONLY, NMSG(CONV_USER_ONLY), true,
     "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n"
     "\n"
     "Cutting Knowledge Date: December 2023\n"
     "Today Date: @DATE@\n"
     "\n"
     "<|eot_id|><|start_header_id|>user<|end_header_id|>\n"
     "\n"
     "Hi there<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n"
     "\n"},
    {T_LLAMA32, CONV_MULTI, NMSG(CONV_MULTI), false,
     "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n"
     "\n"
     "Cutting Knowledge Date: December 2023\n"
     "Today Date: @DATE@\n"
     "\n"
     "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n"
     "\n"
     "Grüße, 世界 🌍\tok<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n"
     "\n"
     "Héllo!<|eot_id|><|start_header_id|>user<|end_header_id|>\n"
     "\n"
     "again\r\n"
     "\?<|eot_id|>"},
    {T_LLAMA32, CONV_MULTI, NMSG(CONV_MULTI), true,
     "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n"
     "\n"
     "Cutting Knowledge Date: December 2023\n"
     "Today Date: @DATE@\n"
     "\n"
     "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n"
     "\n"
     "Grüße, 世界 🌍\tok<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n"
     "\n"
     "Héllo!<|eot_id|><|start_header_id|>user<|end_header_id|>\n"
     "\n"
     "again\r\n"
     "\?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n"
     "\n"},
};

/* ---- expression / statement semantics: expected outputs from Python jinja2 (transformers environment), */
/* rendered with messages = [{user, "hi é"}, {assistant, "yo"}], add_generation_prompt=True, bos "<s>", eos "</s>" */
static const sem_case SEM[] = {
    {"a  {% if true %}\n"
     "  x\n"
     "{% endif %}\n"
     "  b",
     "a    x\n"
     "  b"},
    {"a\n"
     "  {%- if true -%}\n"
     "  x  \n"
     "  {%- endif %}  \n"
     "b",
     "ax  \n"
     "b"},
    {"  {% for i in [1,2] %}\n"
     "    {{ i }}\n"
     "  {% endfor %}\n"
     "end",
     "    1\n"
     "    2\n"
     "end"},
    {"x {%+ if true %}y{% endif +%}\n"
     "z",
     "x y\n"
     "z"},
    {"{# comment #}\n"
     "A\n"
     "  {#- c2 -#}  B {#+ c3 #}\n"
     "C",
     "AB C"},
    {"line\n"
     "\t {% if 1 %}T{% endif %}\n",
     "line\n"
     "T"},
    {"trail\n"
     "\n",
     "trail\n"},
    {"crlf\r\n"
     "{% if 1 %}\r\n"
     "yes\r\n"
     "{% endif %}\r\n",
     "crlf\n"
     "yes\n"},
    {"{% raw %}{{ not parsed }}{% endraw %}\n"
     "  {%- raw -%}  x {{ y }}  {%- endraw %}|",
     "{{ not parsed }}x {{ y }}|"},
    {"a {{- 1 -}} b {{ 2 }}\n"
     " c",
     "a1b 2\n"
     " c"},
    {"  {{ 1 }}\n"
     "  {% if 1 %}x{% endif %}",
     "  1\n"
     "x"},
    {"　 {%- if 1 %}x{% endif -%}  \n"
     "y",
     "xy"},
    {"{%- for m in messages -%}\n"
     "  {{- m.role -}}\n"
     "  {%- if not loop.last %}, {% endif -%}\n"
     "{%- endfor %}",
     "user, assistant"},
    {"{{ none }}|{{ true }}|{{ 1.0 }}|{{ 1e16 }}|{{ 123456789012345.678 }}|{{ 0.1+0.2 }}|{{ 1/3 }}|{{ "
     "-0.0 }}|{{ 2**0.5 }}|{{ 1e-5 }}|{{ 0.0001 }}",
     "None|True|1.0|1e+16|123456789012345.67|0.30000000000000004|0.3333333333333333|-0.0|1.4142135623730951|1e-05|0.0001"},
    {"{{ [1, 'a', \"b'c\", 'd\"e', none, true, 1.5] }}|{{ (1,) }}|{{ (1, 2) }}|{{ {'a': [1, {'b': "
     "none}]} }}|{{ [] }}|{{ {} }}",
     "[1, 'a', \"b'c\", 'd\"e', None, True, 1.5]|(1,)|(1, 2)|{'a': [1, {'b': None}]}|[]|{}"},
    {"{{ 'tab\\tnl\\nq\\'bs\\\\ \\x41\\u00e9\\U0001F600 \\d \\101' }}|{{ \"dq\\\"\" }}|{{ 'é\\é' "
     "}}|{{ 'a' 'b' \"c\" }}",
     "tab\tnl\n"
     "q'bs\\ Aé😀 \\d A|dq\"|é\\xe9|abc"},
    {"{{ ['é', '\\x07', '\\x85', '\\u2028', 'a\\nb', \"it's\"] }}",
     "['é', '\\x07', '\\x85', '\\u2028', 'a\\nb', \"it's\"]"},
    {"{{ 1_000 + 0x10 + 0o10 + 0b10 }}|{{ 1.5e3 }}|{{ 1_0.5 }}",
     "1026|1500.0|10.5"},
    {"{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % -3 }} {{ -7 % 3 }} {{ 7.5 // 2 }} {{ -7.5 % 2 }} {{ 2 ** "
     "10 }} {{ 2 ** -1 }} {{ 10 / 4 }} {{ 3 * 'ab' }} {{ [1] * 3 }} {{ true + 1 }}",
     "3 -4 -2 2 3.0 0.5 1024 0.5 2.5 ababab [1, 1, 1] 2"},
    {"{{ 1 + 2 * 3 - 4 }} {{ (1 + 2) * 3 }} {{ 'a' ~ none ~ undefined_thing ~ 1.5 }} {{ -2 ** 2 }} "
     "{{ 2 ** 3 ** 2 }}",
     "3 9 aNone1.5 4 64"},
    {"{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 1 == 1.0 }} {{ 'a' < 'b' }} {{ [1,2] < [1,3] }} {{ 'a' in "
     "'cat' }} {{ 1 in [1,2] }} {{ 'k' in {'k': 1} }} {{ 'x' not in 'abc' }} {{ none == none }} {{ "
     "1 != 'a' }}",
     "True False True True True True True True True True True"},
    {"{{ 0 or 'x' }} {{ 'y' and 'z' }} {{ '' and 'z' }}|{{ none or [] }}|{{ not 0 }} {{ not not 'a' "
     "}}|{{ 'a' if 0 }}|{{ 'b' if 1 else 'c' }}|{{ 'd' if 0 else 'e' if 1 else 'f' }}",
     "x z |[]|True True||b|e"},
    {"{{ foo }}|{{ foo is defined }}|{{ foo is undefined }}|{{ tools is none }}|{{ tools is defined "
     "}}|{{ documents }}|{{ bos_token }}|{{ eos_token }}",
     "|False|True|True|True|None|<s>|</s>"},
    {"{{ (messages|length - 1) - 0 }}{{ messages|length * 2 }}{{ -(messages|length) }}",
     "14-2"},
    {"{{ 'héllo'[1] }}{{ 'héllo'[-1] }}{{ 'héllo'[1:3] }}{{ 'héllo'[::-1] }}{{ 'héllo'[::2] }}|{{ "
     "[1,2,3,4][1:] }}{{ [1,2,3,4][:-1] }}{{ [1,2,3,4][::-1] }}{{ [1,2,3,4][-2:] }}{{ [1,2,3][5:9] "
     "}}{{ [1,2,3][3] }}|{{ messages[0].role }}{{ messages[-1]['content'] }}",
     "éoélolléhhlo|[2, 3, 4][1, 2, 3][4, 3, 2, 1][3, 4][]|useryo"},
    {"{{ {'a': 1}.a }}{{ {'a': 1}['a'] }}{{ {'a': 1}.b }}|{{ {'a':1,'b':2}.keys()|list }}{{ {'a':1}.values()|list "
     "}}{{ {'a':1}.get('a') }}{{ {'a':1}.get('z') }}{{ {'a':1}.get('z', 9) }}",
     "11|['a', 'b'][1]1None9"},
    {"{{ {'a': {'b': 1}} }}|{{ '{{' }}|{{ '}}' }}|{% set x = {'a': {'b': [1, {'c': 2}]}} %}{{ x.a.b[1].c "
     "}}{{ x['a']['b'][0] }}",
     "{'a': {'b': 1}}|{{|}}|21"},
    {"{{ 'abc'[10:] }}|{{ 'abc'[-10:2] }}|{{ [1,2,3][::2] }}|{{ [1,2,3][None:None:-1] }}|{{ messages[5:] "
     "}}",
     "|ab|[1, 3]|[3, 2, 1]|[]"},
    {"{{ '  ab  '.strip() }}|{{ 'xxabxx'.strip('x') }}|{{ '  ab  '.lstrip() }}|{{ '  ab  '.rstrip() "
     "}}|{{ '\\n\\nab\\n'.lstrip('\\n') }}|{{ '　ab '.strip() }}",
     "ab|ab|ab  |  ab|ab\n"
     "|ab"},
    {"{{ 'a,b,,c'.split(',') }}{{ '  a  b  c  '.split() }}{{ '  a  b  c  '.split(None, 1) }}{{ 'a "
     "b c'.rsplit(' ', 1) }}{{ '  a  b  c  '.rsplit(None, 1) }}{{ 'a</think>b</think>c'.split('</think>')[-1] "
     "}}",
     "['a', 'b', '', 'c']['a', 'b', 'c']['a', 'b  c  ']['a b', 'c']['  a  b', 'c']c"},
    {"{{ 'Hello World'.upper() }}{{ 'Hello World'.lower() }}{{ 'hello world'.title() }}{{ 'hELLO "
     "wORLD'.capitalize() }}{{ 'straße'.upper() }}{{ 'ÉCOLE'.lower() }}{{ 'aBc'.swapcase() }}",
     "HELLO WORLDhello worldHello WorldHello worldSTRASSEécoleAbC"},
    {"{{ 'abcabc'.replace('b', 'X') }}{{ 'abc'.replace('', '-') }}{{ 'aaa'.replace('a', 'b', 2) }}{{ "
     "'héllo'.find('l') }}{{ 'hello'.rfind('l') }}{{ 'hello'.count('l') }}{{ 'x'.find('z') }}",
     "aXcaXc-a-b-c-bba232-1"},
    {"{{ '-'.join(['a','b']) }}{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x','c')) }}{{ '123'.isdigit() "
     "}}{{ 'abc'.isalpha() }}{{ ' '.isspace() }}{{ 'abc'.islower() }}{{ 'ABC'.isupper() }}{{ 'a\\nb\\r\\nc'.splitlines() "
     "}}{{ 'ab'.center(6, '*') }}{{ 'ab'.ljust(4) }}|{{ 'ab'.rjust(4) }}{{ 'prefix_x'.removeprefix('prefix_') "
     "}}",
     "a-bTrueTrueTrueTrueTrueTrueTrue['a', 'b', 'c']**ab**ab  |  abx"},
    {"{{ 'a{}b{}c{x}{{}}'.format(1, 2.5, x=none) }}",
     "a1b2.5cNone{}"},
    {"{{ '  x  '|trim }}|{{ 'xxyxx'|trim('x') }}|{{ [1,2]|length }}{{ 'héllo'|length }}{{ {'a':1}|count "
     "}}{{ undefined_v|length }}|{{ 'ab'|upper }}{{ 'AB'|lower }}{{ 'hello wORLD-foo(bar'|title }}{{ "
     "'hello WORLD'|capitalize }}",
     "x|y|2510|ABabHello World-Foo(BarHello world"},
    {"{{ x|default('d') }}{{ ''|default('e') }}{{ ''|default('f', true) }}{{ none|default('g') }}{{ "
     "0|d('h', boolean=true) }}",
     "dfNoneh"},
    {"{{ [1,2,3]|first }}{{ [1,2,3]|last }}{{ 'abc'|first }}{{ 'abc'|last }}{{ []|first }}|{{ [1,2,3]|join('-') "
     "}}{{ ['a', none, 1]|join }}{{ [{'n':'x'},{'n':'y'}]|join(',', attribute='n') }}",
     "13ac|1-2-3aNone1x,y"},
    {"{{ 'abc'|list }}{{ {'a':1,'b':2}|list }}{{ {'a':1,'b':2}|items|list }}{{ 12|string }}{{ none|string "
     "}}{{ [1]|string }}{{ 'aXbX'|replace('X', '_') }}{{ 'aaa'|replace('a','b',1) }}",
     "['a', 'b', 'c']['a', 'b'][('a', 1), ('b', 2)]12None[1]a_b_baa"},
    {"{{ '42'|int }}{{ ' 42 '|int }}{{ '4.7'|int }}{{ 'x'|int }}{{ 'x'|int(7) }}{{ 3.9|int }}{{ -3.9|int "
     "}}{{ '0x1A'|int(0, 16) }}{{ '1e3'|int }}{{ '3.5'|float }}{{ 'x'|float }}{{ 2|float }}{{ -5|abs "
     "}}{{ 2.567|round(2) }}{{ 2.5|round }}{{ 3.5|round }}{{ 2.1|round(0, 'ceil') }}{{ 7|round }}",
     "42424073-32610003.50.02.052.572.04.03.07"},
    {"{{ [3,1,2]|sort }}{{ ['b','A','c']|sort }}{{ ['b','A','c']|sort(case_sensitive=true) }}{{ [3,1,2]|sort(reverse=true) "
     "}}{{ [{'a':2},{'a':1}]|sort(attribute='a') }}{{ [1,2,2,1,3]|unique|list }}{{ [1,2,3]|reverse|list "
     "}}{{ 'abc'|reverse }}{{ [1,2,3]|sum }}{{ [1,2,3]|max }}{{ ['b','a']|min }}",
     "[1, 2, 3]['A', 'b', 'c']['A', 'b', 'c'][3, 2, 1][{'a': 1}, {'a': 2}][1, 2, 3][3, 2, 1]cba63a"},
    {"{{ [{'r':'u'},{'r':'a'},{'r':'u'}]|selectattr('r', 'equalto', 'u')|list|length }}{{ [{'r':'u'},{'x':1}]|selectattr('r')|list "
     "}}{{ [{'r':'u'},{'r':'a'}]|rejectattr('r', '==', 'u')|list }}{{ [1,2,3,4]|select('odd')|list "
     "}}{{ [1,0,2]|select|list }}{{ [1,2,3,4]|reject('even')|list }}{{ ['a','b']|map('upper')|list "
     "}}{{ [{'a':1},{'a':2}]|map(attribute='a')|list }}{{ [{'a':1},{}]|map(attribute='a', default=0)|list "
     "}}",
     "2[{'r': 'u'}][{'r': 'a'}][1, 3][1, 2][1, 3]['A', 'B'][1, 2][1, 0]"},
    {"{{ {'b':1,'a':2}|dictsort }}{{ {'b':1,'a':2}|dictsort(by='value') }}{{ 'a\\nb\\n\\nc'|indent "
     "}}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent('>', blank=true) }}|{{ '<a&\"\\''|e }}{{ "
     "'x'|safe }}{{ 'ab'|center(6) }}|{{ 'one two, three'|wordcount }}",
     "[('a', 2), ('b', 1)][('b', 1), ('a', 2)]a\n"
     "    b\n"
     "\n"
     "    c|  a\n"
     "  b|a\n"
     ">\n"
     ">b|&lt;a&amp;&#34;&#39;x  ab  |3"},
    {"{{ {'a': [1, 2.5, none, true, 'é\"\\n\\x01']}|tojson }}|{{ {'a': {'b': []}, 'c': {}}|tojson(indent=2) "
     "}}|{{ {'z':1,'a':2}|tojson(sort_keys=true) }}|{{ 'é😀'|tojson(ensure_ascii=true) }}|{{ [1,2]|tojson(separators=(',',':')) "
     "}}|{{ {1: 'x', none: 1, true: 2}|tojson }}|{{ 1e16|tojson }}|{{ {'a':[1,{'b':2}]}|tojson(indent='\t') "
     "}}",
     "{\"a\": [1, 2.5, null, true, \"é\\\"\\n\\u0001\"]}|{\n"
     "  \"a\": {\n"
     "    \"b\": []\n"
     "  },\n"
     "  \"c\": {}\n"
     "}|{\"a\": 2, \"z\": 1}|\"\\u00e9\\ud83d\\ude00\"|[1,2]|{\"1\": 2, \"null\": 1}|1e+16|{\n"
     "\t\"a\": [\n"
     "\t\t1,\n"
     "\t\t{\n"
     "\t\t\t\"b\": 2\n"
     "\t\t}\n"
     "\t]\n"
     "}"},
    {"{{ messages|map(attribute='role')|join(',') }}|{{ messages|selectattr('role', 'equalto', 'user')|list|length "
     "}}|{{ messages[0] }}|{{ messages|tojson }}",
     "user,assistant|1|{'role': 'user', 'content': 'hi é'}|[{\"role\": \"user\", \"content\": \"hi "
     "é\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]"},
    {"{{ 'Ünïcödé'|upper }}{{ 'ΑΒΓ'|lower }}{{ 'ß'|title }}",
     "ÜNÏCÖDÉαβγSS"},
    {"{{ 1 is number }}{{ true is number }}{{ 1 is integer }}{{ true is integer }}{{ 1.0 is float "
     "}}{{ 'a' is string }}{{ {} is mapping }}{{ [] is iterable }}{{ 'a' is sequence }}{{ none is "
     "none }}{{ x is none }}{{ true is true }}{{ 0 is false }}{{ false is boolean }}{{ 3 is odd }}{{ "
     "4 is even }}{{ 9 is divisibleby 3 }}{{ 9 is divisibleby(4) }}{{ 2 is in [1,2] }}{{ 'ab' is "
     "lower }}{{ 'AB' is upper }}{{ 3 is gt 2 }}{{ 3 is not lt 2 }}{{ 1 is eq 1 }}{{ 1 is ne 1 }}{{ "
     "range is callable }}{{ 'upper' is filter }}{{ 'odd' is test }}{{ none is sameas none }}",
     "TrueTrueTrueFalseTrueTrueTrueTrueTrueTrueFalseTrueFalseTrueTrueTrueTrueFalseTrueTrueTrueTrueTrueTrueFalseTrueTrueTrueTrue"},
    {"{{ 3 is divisibleby 3 and 2 is even }}{{ not 1 is odd }}{{ (1, 2) == (1, 2) }}{{ [1] == (1,) "
     "}}",
     "TrueFalseTrueFalse"},
    {"{% for x in ['a','b','c'] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 "
     "}}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.previtem }}{{ loop.nextitem }}{{ "
     "loop.cycle('o','e') }}{{ loop.depth }}|{% endfor %}",
     "1032TrueFalse3bo1|2121FalseFalse3ace1|3210FalseTrue3bo1|"},
    {"{% for x in [] %}A{% else %}empty{% endfor %}{% for x in [1,2,3,4,5] if x is odd %}{{ x }}{{ "
     "loop.index }}{{ loop.length }}{% endfor %}",
     "empty113323533"},
    {"{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}{% "
     "endif %}{{ x }}{% endfor %}|{% for i in range(3) %}{% for j in range(3) %}{% if j > i %}{% "
     "break %}{% endif %}{{ i }}{{ j }} {% endfor %}{% endfor %}",
     "0134|00 10 11 20 21 22 "},
    {"{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}{% for k in {'x': 1} "
     "%}{{ k }}{% endfor %}{% for c in 'hé' %}[{{ c }}]{% endfor %}{% for a, b in [[1,2],[3,4]] %}{{ "
     "a+b }}{% endfor %}",
     "a=1;b=2;x[h][é]37"},
    {"{% set x = 1 %}{% for i in [1,2] %}{{ x }}{% set x = x + 10 %}{{ x }}{% endfor %}{{ x }}|{% "
     "set ns = namespace(c=0, found=false) %}{% for i in [1,2,3] %}{% set ns.c = ns.c + i %}{% if "
     "i == 2 %}{% set ns.found = true %}{% endif %}{% endfor %}{{ ns.c }}{{ ns.found }}{{ ns.missing "
     "}}",
     "1111111|6True"},
    {"{% for m in messages %}{% if m.role == 'user' %}{% set last = m.content %}{% endif %}{% endfor "
     "%}[{{ last }}]{% set ns = namespace(items=[]) %}{% for m in messages %}{% set ns.items = ns.items "
     "+ [m.role] %}{% endfor %}{{ ns.items }}",
     "[]['user', 'assistant']"},
    {"{% if 0 %}a{% elif '' %}b{% elif [1] %}c{% else %}d{% endif %}{% if none %}{% else %}E{% endif "
     "%}{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = 1, 2 %}{{ t }}",
     "cE12(1, 2)"},
    {"{% for x in range(3) %}{{ range(x)|list }}{% endfor %}{{ range(1, 10, 3)|list }}{{ range(5, "
     "0, -2)|list }}{{ dict(a=1, b='x') }}{{ namespace(a=1).a }}",
     "[][0][0, 1][1, 4, 7][5, 3, 1]{'a': 1, 'b': 'x'}1"},
    {"{% for message in messages[::-1] %}{{ loop.index0 }}{{ message.role[0] }}{% endfor %}{% for "
     "a in [1,2] %}{% for b in [3,4] %}{{ loop.index }}{{ a }}{{ b }}{% endfor %}{{ loop.index }}{% "
     "endfor %}",
     "0a1u11321411232242"},
    {"{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Bob') }} "
     "{{ greet('Al', punct='\?') }} {{ greet(name='Z') }}",
     "Hi Bob! Hi Al\? Hi Z!"},
    {"{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n * (fact(n - 1)|int) }}{% endif %}{% endmacro "
     "%}{{ fact(5) }}{% macro a(x) %}[{{ b(x) }}]{% endmacro %}{% macro b(y) %}<{{ y }}>{% endmacro "
     "%}{{ a(1) }}",
     "120[<1>]"},
    {"{% set block %}  inner {{ 1 + 1 }}  {% endset %}[{{ block }}]{% set b2 | trim | upper %}  xy "
     " {% endset %}[{{ b2 }}]",
     "[  inner 2  ][XY]"},
};

/* ---- helpers ---------------------------------------------------------------------------------- */
static char *read_file(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  char *buf = NULL;
  size_t cap = 0, len = 0;
  for (;;) {
    if (cap - len < 4096) {
      cap = cap ? cap * 2 : 65536;
      char *nb = realloc(buf, cap + 1);
      if (!nb) {
        free(buf);
        fclose(f);
        return NULL;
      }
      buf = nb;
    }
    size_t k = fread(buf + len, 1, cap - len, f);
    len += k;
    if (k == 0) break;
  }
  fclose(f);
  buf[len] = 0;
  *n = len;
  return buf;
}

/* The "chat_template" string of a tokenizer_config.json (malloc'ed). */
static char *config_template(const char *path) {
  size_t n;
  char *js = read_file(path, &n);
  if (!js) return NULL;
  cJSON *root = cJSON_ParseWithLength(js, n);
  free(js);
  if (!root) return NULL;
  const cJSON *t = cJSON_GetObjectItemCaseSensitive(root, "chat_template");
  char *out = cJSON_IsString(t) ? strdup(t->valuestring) : NULL;
  cJSON_Delete(root);
  return out;
}

/* Prints where two strings first differ, escaped, so a mismatch is readable. */
static void show_diff(const char *label, const char *want, const char *got) {
  size_t i = 0;
  while (want[i] && want[i] == got[i]) i++;
  size_t from = i > 40 ? i - 40 : 0;
  fprintf(stderr, "  %s: first difference at byte %zu\n  want: ", label, i);
  for (size_t k = from; want[k] && k < i + 40; k++) fprintf(stderr, (unsigned char)want[k] < 0x20 ? "\\x%02x" : "%c", (unsigned char)want[k]);
  fprintf(stderr, "\n  got:  ");
  for (size_t k = from; got[k] && k < i + 40; k++) fprintf(stderr, (unsigned char)got[k] < 0x20 ? "\\x%02x" : "%c", (unsigned char)got[k]);
  fputc('\n', stderr);
}

static const char *BOS[T_COUNT] = {"<s>", "<|begin_of_text|>", "<s>", NULL, "<|begin_of_text|>"};
static const char *EOS[T_COUNT] = {"</s>", "<|end_of_text|>", "</s>", "<|im_end|>", "<|eot_id|>"};
static pd_chat_template *TPL[T_COUNT];

static char *render(const pd_chat_template *t, const pd_chat_msg *m, size_t n, bool agp, const char *bos,
                    const char *eos, pd_status *st, pd_err *e) {
  pd_chat_vars v = {m, n, agp, bos, eos};
  char *out = (char *)"sentinel";
  *st = pd_chat_template_render(t, &v, &out, e);
  if (*st != PD_OK && out != NULL) {
    fprintf(stderr, "FAIL: *out must be NULL on error\n");
    failures++;
    out = NULL;
  }
  return out;
}

/* Replaces "@DATE@" (what strftime_now returned in the reference run) by date. */
static char *with_date(const char *s, const char *date) {
  const char *p = strstr(s, "@DATE@");
  if (!p) return strdup(s);
  size_t n = strlen(s) - 6 + strlen(date);
  char *o = malloc(n + 1);
  if (!o) return NULL;
  size_t pre = (size_t)(p - s);
  memcpy(o, s, pre);
  strcpy(o + pre, date);
  strcat(o, p + 6);
  return o;
}

static void today(char *buf, size_t n) {
  time_t now = time(NULL);
  struct tm tm;
  localtime_r(&now, &tm);
  strftime(buf, n, "%d %b %Y", &tm);
}

/* ---- tests ------------------------------------------------------------------------------------------ */
static void load_templates(void) {
  const char *srcs[T_COUNT] = {0};
  char *owned[T_COUNT] = {0};
  size_t n;
  owned[T_CHATML] = read_file(PD_TEST_DATA "/models/pycoder-12m/chat_template.jinja", &n);
  owned[T_LLAMA3] = config_template(PD_TEST_DATA "/tokenizers/llama3/tokenizer_config.json");
  owned[T_QWEN3] = config_template(PD_TEST_DATA "/tokenizers/qwen3/tokenizer_config.json");
  srcs[T_CHATML] = owned[T_CHATML];
  srcs[T_LLAMA3] = owned[T_LLAMA3];
  srcs[T_QWEN3] = owned[T_QWEN3];
  srcs[T_LLAMA2] = LLAMA2_TEMPLATE;
  srcs[T_LLAMA32] = LLAMA32_TEMPLATE;
  for (int i = 0; i < T_COUNT; i++) {
    CHECK(srcs[i] != NULL, "template %d: source missing", i);
    if (!srcs[i]) continue;
    pd_err e = {0};
    TPL[i] = pd_chat_template_parse(srcs[i], strlen(srcs[i]), &e);
    CHECK(TPL[i] != NULL, "template %d does not parse: %s", i, e.msg);
    free(owned[i]);
  }
}

static void test_golden(void) {
  for (size_t i = 0; i < NMSG(GOLDEN); i++) {
    const golden *g = &GOLDEN[i];
    if (!TPL[g->tmpl]) continue;
    char d0[64], d1[64];
    today(d0, sizeof d0);
    pd_err e = {0};
    pd_status st;
    char *out = render(TPL[g->tmpl], g->msgs, g->n, g->agp, BOS[g->tmpl], EOS[g->tmpl], &st, &e);
    today(d1, sizeof d1);
    CHECK(st == PD_OK, "golden %zu: render failed: %s", i, e.msg);
    if (!out) continue;
    char *want0 = with_date(g->expected, d0), *want1 = with_date(g->expected, d1);
    bool ok = !strcmp(out, want0) || !strcmp(out, want1);
    CHECK(ok, "golden %zu (template %d, %zu messages, add_generation_prompt=%d) differs", i, g->tmpl, g->n, g->agp);
    if (!ok) show_diff("golden", want0, out);
    free(want0);
    free(want1);
    free(out);
  }
}

static void test_semantics(void) {
  static const pd_chat_msg msgs[] = {{"user", "hi \xC3\xA9"}, {"assistant", "yo"}};
  for (size_t i = 0; i < NMSG(SEM); i++) {
    pd_err e = {0};
    pd_chat_template *t = pd_chat_template_parse(SEM[i].tmpl, strlen(SEM[i].tmpl), &e);
    CHECK(t != NULL, "sem %zu: parse failed: %s\n  template: %s", i, e.msg, SEM[i].tmpl);
    if (!t) continue;
    pd_status st;
    char *out = render(t, msgs, 2, true, "<s>", "</s>", &st, &e);
    CHECK(st == PD_OK, "sem %zu: render failed: %s\n  template: %s", i, e.msg, SEM[i].tmpl);
    if (out) {
      bool ok = !strcmp(out, SEM[i].expected);
      CHECK(ok, "sem %zu differs\n  template: %s", i, SEM[i].tmpl);
      if (!ok) show_diff("sem", SEM[i].expected, out);
    }
    free(out);
    pd_chat_template_free(t);
  }
}

/* Renders src with one user message; returns the status and fills e. */
static pd_status try_template(const char *src, size_t len, bool *parsed, char **out, pd_err *e) {
  static const pd_chat_msg one[] = {{"user", "hello"}};
  *out = NULL;
  memset(e, 0, sizeof *e);
  pd_chat_template *t = pd_chat_template_parse(src, len, e);
  *parsed = t != NULL;
  if (!t) return e->code;
  pd_status st;
  *out = render(t, one, 1, true, "<s>", "</s>", &st, e);
  pd_chat_template_free(t);
  return st;
}

typedef struct err_case {
  const char *tmpl;
  pd_status code;
  bool at_parse;
  const char *msg_part; /* must appear in the message */
} err_case;

static void test_errors(void) {
  static const err_case cases[] = {
      {"{{ 1 + }}", PD_EINVAL, true, "chat template:1:8:"},
      {"line one\n{% if x %}\nno end", PD_EINVAL, true, "chat template:3:7: unexpected end of template, expected 'elif' or 'else' or 'endif'"},
      {"{{ 'abc }}", PD_EINVAL, true, "unterminated string"},
      {"{{ [1, 2 }}", PD_EINVAL, true, "unexpected '}', expected ']'"},
      {"{# no end", PD_EINVAL, true, "missing end of comment"},
      {"{% frobnicate %}", PD_EINVAL, true, "'frobnicate'"},
      {"{% break %}", PD_EINVAL, true, "outside of a loop"},
      {"{% set 1 = 2 %}", PD_EINVAL, true, "can't assign"},
      {"{{ 'a' $ 1 }}", PD_EINVAL, true, "unexpected character '$'"},
      {"{% include 'x.jinja' %}", PD_EUNSUPPORTED, true, "'include' tags are not supported"},
      {"{% extends 'base.jinja' %}", PD_EUNSUPPORTED, true, "'extends'"},
      {"{% import 'm.jinja' as m %}", PD_EUNSUPPORTED, true, "'import'"},
      {"{% call foo() %}x{% endcall %}", PD_EUNSUPPORTED, true, "'call'"},
      {"{% filter upper %}x{% endfilter %}", PD_EUNSUPPORTED, true, "'filter'"},
      {"{% for x in y recursive %}{% endfor %}", PD_EUNSUPPORTED, true, "recursive"},
      {"{{ f(*args) }}", PD_EUNSUPPORTED, true, "*args"},
      {"{{ x|frobnicate }}", PD_EUNSUPPORTED, false, "filter 'frobnicate' is not supported"},
      {"{{ x is frobnicated }}", PD_EUNSUPPORTED, false, "test 'frobnicated' is not supported"},
      {"{{ my_helper('x') }}", PD_EUNSUPPORTED, false, "unknown function 'my_helper'"},
      {"{{ 'a'.format_map({}) }}", PD_EUNSUPPORTED, false, "str.format_map"},
      {"{{ messages.append(1) }}", PD_EUNSUPPORTED, false, "list.append"},
      {"{{ 2 ** 64 }}", PD_EUNSUPPORTED, false, "overflow"},
      {"{{ '%s' % 1 }}", PD_EUNSUPPORTED, false, "formatting"},
      {"{{ raise_exception('Custom failure: ' ~ messages|length) }}", PD_EINVAL, false, "chat template:1:4: Custom failure: 1"},
      {"{{ 1 + 'a' }}", PD_EINVAL, false, "unsupported operand type(s) for +: 'int' and 'str'"},
      {"{{ 'a' + 1 }}", PD_EINVAL, false, "can only concatenate str"},
      {"{{ x.y }}", PD_EINVAL, false, "'x' is undefined"},
      {"{{ messages[3].role }}", PD_EINVAL, false, "list object has no element 3"},
      {"{{ 1 / 0 }}", PD_EINVAL, false, "division by zero"},
      {"{% for x in none %}{% endfor %}", PD_EINVAL, false, "'NoneType' object is not iterable"},
      {"{% set ns = {} %}{% set ns.a = 1 %}", PD_EINVAL, false, "non-namespace"},
      {"{% set a, b = [1] %}", PD_EINVAL, false, "not enough values to unpack"},
      {"{{ range(100001)|length }}", PD_EINVAL, false, "range too big"},
      {"{{ 1 < 'a' }}", PD_EINVAL, false, "'<' not supported"},
      {"{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", PD_EINVAL, false, "macro 'm' takes not more than 1"},
      {"{% macro m(n) %}{{ m(n + 1) }}{% endmacro %}{{ m(0) }}", PD_EINVAL, false, "recursion too deep"},
      /* infinite-ish work is cut off by the step budget, the output cap or the memory cap */
      {"{% set r = range(1000) %}{% for i in r %}{% for j in r %}{% for k in r %}{% endfor %}{% endfor %}{% endfor %}",
       PD_EINVAL, false, "step budget"},
      {"{% set big = 'x' * 100000 %}{% for i in range(100000) %}{{ big }}{% endfor %}", PD_EINVAL, false, "output exceeds"},
      {"{% set ns = namespace(s='ab') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
       PD_EINVAL, false, "a string built by the template exceeds"},
      {"{% set ns = namespace(l=[1]) %}{% for i in range(100) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|length }}",
       PD_EINVAL, false, "memory"},
  };
  for (size_t i = 0; i < NMSG(cases); i++) {
    const err_case *c = &cases[i];
    bool parsed;
    char *out;
    pd_err e;
    clock_t t0 = clock();
    pd_status st = try_template(c->tmpl, strlen(c->tmpl), &parsed, &out, &e);
    double secs = (double)(clock() - t0) / CLOCKS_PER_SEC;
    CHECK(st == c->code, "error case %zu: status %d, want %d (%s)\n  template: %s", i, st, c->code, e.msg, c->tmpl);
    CHECK(parsed == !c->at_parse, "error case %zu: failed at %s, want at %s\n  template: %s", i,
          parsed ? "render" : "parse", c->at_parse ? "parse" : "render", c->tmpl);
    CHECK(strstr(e.msg, c->msg_part) != NULL, "error case %zu: message \"%s\" lacks \"%s\"", i, e.msg, c->msg_part);
    CHECK(out == NULL, "error case %zu: output on error", i);
    CHECK(secs < 20, "error case %zu took %.1f s", i, secs);
    free(out);
  }

  /* a filter / function outside the subset is only an error where it is evaluated (as in jinja2) */
  bool parsed;
  char *out;
  pd_err e;
  const char *lazy = "{% if false %}{{ x|frobnicate }}{{ my_helper() }}{% endif %}ok";
  pd_status st = try_template(lazy, strlen(lazy), &parsed, &out, &e);
  CHECK(st == PD_OK && out && !strcmp(out, "ok"), "untaken branch with unknown filter: %d %s", st, e.msg);
  free(out);

  /* the Llama 2 template's raise_exception for non-alternating roles */
  if (TPL[T_LLAMA2]) {
    pd_status st2;
    char *o = render(TPL[T_LLAMA2], CONV_BAD_ALT, NMSG(CONV_BAD_ALT), true, "<s>", "</s>", &st2, &e);
    CHECK(st2 == PD_EINVAL, "llama2 alternation: status %d", st2);
    CHECK(strstr(e.msg, "Conversation roles must alternate user/assistant/user/assistant/...") != NULL, "llama2 message: %s", e.msg);
    free(o);
  }
}

static char *repeat(const char *head, const char *unit, size_t times, const char *mid, const char *unit2,
                    const char *tail) {
  size_t n = strlen(head) + times * (strlen(unit) + strlen(unit2)) + strlen(mid) + strlen(tail) + 1;
  char *s = malloc(n);
  if (!s) return NULL;
  strcpy(s, head);
  char *p = s + strlen(s);
  for (size_t i = 0; i < times; i++) p = stpcpy(p, unit);
  p = stpcpy(p, mid);
  for (size_t i = 0; i < times; i++) p = stpcpy(p, unit2);
  strcpy(p, tail);
  return s;
}

/* Deep nesting must be an error, never a stack overflow. */
static void test_nesting(void) {
  struct {
    char *src;
    bool at_parse;
  } cases[] = {
      {repeat("{{ ", "(", 10000, "1", ")", " }}"), true},
      {repeat("{{ ", "[", 10000, "1", "]", " }}"), true},
      {repeat("", "{% if 1 %}", 10000, "x", "{% endif %}", ""), true},
      {repeat("{{ ", "-", 10000, "1", "", " }}"), true},
      {repeat("{{ ", "not ", 10000, "1", "", " }}"), true},
      {repeat("{{ 1", " + 1", 10000, "", "", " }}"), false},
      {repeat("{{ x", "|trim", 10000, "", "", " }}"), false},
  };
  for (size_t i = 0; i < NMSG(cases); i++) {
    if (!cases[i].src) continue;
    bool parsed;
    char *out;
    pd_err e;
    pd_status st = try_template(cases[i].src, strlen(cases[i].src), &parsed, &out, &e);
    CHECK(st == PD_EINVAL, "nesting case %zu: status %d (%s)", i, st, e.msg);
    CHECK(parsed == !cases[i].at_parse, "nesting case %zu: failed at the wrong stage (%s)", i, e.msg);
    CHECK(strstr(e.msg, "deep") != NULL, "nesting case %zu: message %s", i, e.msg);
    free(out);
    free(cases[i].src);
  }
  /* moderate nesting is fine */
  char *ok = repeat("{{ ", "(", 100, "1", ")", " }}");
  bool parsed;
  char *out;
  pd_err e;
  pd_status st = try_template(ok, strlen(ok), &parsed, &out, &e);
  CHECK(st == PD_OK && out && !strcmp(out, "1"), "100 parentheses: %d %s", st, e.msg);
  free(out);
  free(ok);
}

static void test_misc(void) {
  pd_err e = {0};
  bool parsed;
  char *out;
  pd_status st;
  /* transformers' {% generation %} tag renders its body */
  const char *gen = "A{% generation %}[{{ messages[0].content }}]{% endgeneration %}B";
  st = try_template(gen, strlen(gen), &parsed, &out, &e);
  CHECK(st == PD_OK && out && !strcmp(out, "A[hello]B"), "generation block: %d %s", st, e.msg);
  free(out);

  /* strftime_now is the local time, like transformers' datetime.now().strftime */
  const char *date = "{{ strftime_now('%Y-%m-%d') }}";
  char d0[32], d1[32];
  time_t now = time(NULL);
  struct tm tm;
  localtime_r(&now, &tm);
  strftime(d0, sizeof d0, "%Y-%m-%d", &tm);
  st = try_template(date, strlen(date), &parsed, &out, &e);
  now = time(NULL);
  localtime_r(&now, &tm);
  strftime(d1, sizeof d1, "%Y-%m-%d", &tm);
  CHECK(st == PD_OK && out && (!strcmp(out, d0) || !strcmp(out, d1)), "strftime_now: %s", out ? out : e.msg);
  free(out);

  /* a missing bos_token is undefined (transformers passes only the tokens a tokenizer has) */
  if (TPL[T_QWEN3]) {
    const char *tok = "[{{ bos_token }}]{{ bos_token is defined }}{{ eos_token }}";
    pd_chat_template *t = pd_chat_template_parse(tok, strlen(tok), &e);
    CHECK(t != NULL, "parse: %s", e.msg);
    if (t) {
      char *o = render(t, NULL, 0, false, NULL, NULL, &st, &e);
      CHECK(st == PD_OK && o && !strcmp(o, "[]False"), "NULL tokens: %s", o ? o : e.msg);
      free(o);
      pd_chat_template_free(t);
    }
  }

  /* an empty template renders "", the trailing newline of a template is dropped */
  st = try_template("", 0, &parsed, &out, &e);
  CHECK(st == PD_OK && out && !strcmp(out, ""), "empty template");
  free(out);
  st = try_template("x\n", 2, &parsed, &out, &e);
  CHECK(st == PD_OK && out && !strcmp(out, "x"), "trailing newline");
  free(out);

  /* API misuse */
  CHECK(pd_chat_template_parse(NULL, 3, &e) == NULL && e.code == PD_EINVAL, "NULL source");
  pd_chat_template_free(NULL);
  if (TPL[T_CHATML]) {
    pd_chat_vars v = {NULL, 1, false, NULL, NULL};
    char *o = NULL;
    CHECK(pd_chat_template_render(TPL[T_CHATML], &v, &o, &e) == PD_EINVAL && !o, "NULL messages");
    pd_chat_msg bad[] = {{"user", NULL}};
    v.messages = bad;
    CHECK(pd_chat_template_render(TPL[T_CHATML], &v, &o, &e) == PD_EINVAL && !o, "NULL content");
    CHECK(pd_chat_template_render(TPL[T_CHATML], &v, NULL, &e) == PD_EINVAL, "NULL out");
    CHECK(pd_chat_template_render(NULL, &v, &o, &e) == PD_EINVAL && !o, "NULL template");
  }
}

/* One parsed template rendered from several threads at once gives the same bytes each time. */
typedef struct thr_arg {
  const golden *g;
  int bad;
} thr_arg;

static void *thr_main(void *p) {
  thr_arg *a = p;
  for (int i = 0; i < 25; i++) {
    pd_err e = {0};
    pd_status st;
    char *out = render(TPL[a->g->tmpl], a->g->msgs, a->g->n, a->g->agp, BOS[a->g->tmpl], EOS[a->g->tmpl], &st, &e);
    if (st != PD_OK || !out || strcmp(out, a->g->expected)) a->bad++;
    free(out);
  }
  return NULL;
}

static void test_threads(void) {
  const golden *g = NULL;
  for (size_t i = 0; i < NMSG(GOLDEN); i++)
    if (GOLDEN[i].tmpl == T_QWEN3 && GOLDEN[i].msgs == CONV_THINK && GOLDEN[i].agp) g = &GOLDEN[i];
  CHECK(g != NULL, "no qwen3 golden case");
  if (!g || !TPL[T_QWEN3]) return;
  pthread_t th[4];
  thr_arg args[4];
  int started = 0;
  for (int i = 0; i < 4; i++) {
    args[i] = (thr_arg){g, 0};
    if (pthread_create(&th[i], NULL, thr_main, &args[i]) == 0) started++;
    else break;
  }
  for (int i = 0; i < started; i++) {
    pthread_join(th[i], NULL);
    CHECK(args[i].bad == 0, "thread %d: %d bad renders", i, args[i].bad);
  }
  CHECK(started == 4, "could not start threads");
}

int main(void) {
  load_templates();
  test_golden();
  test_semantics();
  test_errors();
  test_nesting();
  test_misc();
  test_threads();
  for (int i = 0; i < T_COUNT; i++) pd_chat_template_free(TPL[i]);
  if (failures) {
    fprintf(stderr, "test_chat_template: %d failure(s)\n", failures);
    return 1;
  }
  printf("test_chat_template: %zu golden renders, %zu semantic cases: all passed\n", NMSG(GOLDEN), NMSG(SEM));
  return 0;
}
