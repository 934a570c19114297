/* The strict JSON parser (pd/json.h): every kind of input the router must refuse, with the
 * parameter path it reports, and what it must accept unchanged. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/json.h"
#include "pd_test.h"

typedef struct reject_case {
  const char *text;
  size_t len; /* 0: strlen(text) (set for inputs with NUL bytes) */
  const char *param; /* the path the error must name */
  const char *msg;   /* a part of the message */
} reject_case;

static const reject_case rejects[] = {
    /* duplicate keys, at any depth, compared after unescaping */
    {"{\"max_tokens\": 2, \"max_tokens\": -5}", 0, "max_tokens", "duplicate key"},
    {"{\"a\": 1, \"\\u0061\": 2}", 0, "a", "duplicate key"},
    {"{\"stream_options\": {\"include_usage\": true, \"include_usage\": false}}", 0,
     "stream_options.include_usage", "duplicate key"},
    {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\", \"role\": \"system\"}]}", 0,
     "messages.[0].role", "duplicate key"},
    {"[{}, {\"k\": 1, \"k\": 1}]", 0, "[1].k", "duplicate key"},
    /* raw control characters and NUL inside strings; the \u0000 escape */
    {"{\"prompt\": \"a\0b\"}", 16, "prompt", "raw NUL byte"},
    {"{\"prompt\": \"a\001b\"}", 0, "prompt", "raw control character 0x01"},
    {"{\"prompt\": \"line\nbreak\"}", 0, "prompt", "raw control character 0x0a"},
    {"{\"prompt\": \"tab\there\"}", 0, "prompt", "raw control character 0x09"},
    {"{\"prompt\": \"a\\u0000b\"}", 0, "prompt", "\\u0000"},
    {"{\"messages\": [{\"content\": \"x\\u0000\"}]}", 0, "messages.[0].content", "\\u0000"},
    {"{\"ke\001y\": 1}", 0, "", "raw control character"},
    /* trailing data */
    {"{\"prompt\": \"x\"} x", 0, "", "unexpected data after the JSON value"},
    {"{\"prompt\": \"x\"}{}", 0, "", "unexpected data after the JSON value"},
    {"{\"prompt\": \"x\"}\0", 16, "", "unexpected data after the JSON value"},
    {"{} ,", 0, "", "unexpected data after the JSON value"},
    /* unpaired surrogates */
    {"{\"p\": \"\\ud800\"}", 0, "p", "lone high surrogate"},
    {"{\"p\": \"\\ud800x\"}", 0, "p", "lone high surrogate"},
    {"{\"p\": \"\\ud800\\u0041\"}", 0, "p", "lone high surrogate"},
    {"{\"p\": \"\\udbff\\ud800\"}", 0, "p", "lone high surrogate"},
    {"{\"p\": \"\\udc00\"}", 0, "p", "lone low surrogate"},
    /* invalid UTF-8 */
    {"{\"p\": \"\xff\"}", 0, "p", "invalid UTF-8"},
    {"{\"p\": \"\xc0\xaf\"}", 0, "p", "invalid UTF-8"},         /* overlong '/' */
    {"{\"p\": \"\xe0\x80\xaf\"}", 0, "p", "invalid UTF-8"},     /* overlong, 3 bytes */
    {"{\"p\": \"\xed\xa0\x80\"}", 0, "p", "invalid UTF-8"},     /* an encoded surrogate */
    {"{\"p\": \"\xf4\x90\x80\x80\"}", 0, "p", "invalid UTF-8"}, /* beyond U+10FFFF */
    {"{\"p\": \"\xe2\x82\"}", 0, "p", "invalid UTF-8"},         /* cut short */
    {"{\"p\": \"\x80\"}", 0, "p", "invalid UTF-8"},             /* a lone continuation byte */
    {"{\"k\xff\": 1}", 0, "", "invalid UTF-8"},
    {"\xff", 0, "", "expected a value"},
    /* numbers */
    {"{\"max_tokens\": 1e400}", 0, "max_tokens", "beyond the range of a double"},
    {"{\"n\": -1e999}", 0, "n", "beyond the range of a double"},
    {"{\"n\": 01}", 0, "n", "leading zero"},
    {"{\"n\": 1.}", 0, "n", "no digit after the point"},
    {"{\"n\": .5}", 0, "n", "expected a value"},
    {"{\"n\": -}", 0, "n", "invalid number"},
    {"{\"n\": +1}", 0, "n", "expected a value"},
    {"{\"n\": 1e}", 0, "n", "no digit in the exponent"},
    {"{\"n\": NaN}", 0, "n", "expected a value"},
    {"{\"n\": Infinity}", 0, "n", "expected a value"},
    {"{\"seed\": 0x10}", 0, "", "expected ',' or '}'"},
    /* the grammar's other leniencies */
    {"{'a': 1}", 0, "", "expected a string key"},
    {"{a: 1}", 0, "", "expected a string key"},
    {"{\"a\": 1,}", 0, "", "expected a string key"},
    {"[1, 2,]", 0, "[2]", "expected a value"},
    {"{\"a\" 1}", 0, "", "expected ':'"},
    {"{\"a\": 1 \"b\": 2}", 0, "", "expected ',' or '}'"},
    {"[1 2]", 0, "", "expected ',' or ']'"},
    {"{\"a\": 1} // comment", 0, "", "unexpected data"},
    {"/* c */ {}", 0, "", "expected a value"},
    {"", 0, "", "unexpected end"},
    {"   \n ", 0, "", "unexpected end"},
    {"\xef\xbb\xbf{}", 0, "", "byte order mark"},
    {"{\"a\": tru}", 0, "a", "expected a value"},
    {"{\"a\": nul", 0, "a", "expected a value"},
    {"{\"a\": True}", 0, "a", "expected a value"},
    {"{\"a\": \"open", 0, "a", "unterminated string"},
    /* a backslash as the last byte once looped for ever (tests/fuzz/fuzz_openai.c) */
    {"{\"mo\": \"pycoder-\\\\\\\\\\\\\\", 0, "mo", "unterminated string"},
    {"\"\\", 0, "", "unterminated string"},
    {"{\"a\": \"x\\q\"}", 0, "a", "invalid escape"},
    {"{\"a\": \"\\u12\"}", 0, "a", "four hex digits"},
    {"{\"a\": \"\\u12g4\"}", 0, "a", "four hex digits"},
    {"{\"a\": [1, {\"b\": [true, \"\\ud800\"]}]}", 0, "a.[1].b.[1]", "lone high surrogate"},
    {"{\"a\": 1", 0, "", "expected ',' or '}'"},
};

/* Inputs that must parse, with a check of what they hold. */
static void accepts(void) {
  pd_json_error e;
  const char *esc = " {\"a\": \"\\u00e9\\ud83d\\ude00 \\\" \\\\ \\/ \\b\\f\\n\\r\\t\"} \r\n";
  cJSON *j = pd_json_parse(esc, strlen(esc), &e);
  CHECKF(j != NULL, "escapes: %s", e.msg);
  if (j) {
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(j, "a");
    CHECK(cJSON_IsString(a) &&
          !strcmp(a->valuestring, "\xc3\xa9\xf0\x9f\x98\x80 \" \\ / \b\f\n\r\t"));
  }
  cJSON_Delete(j);

  const char *raw = "{\"p\": \"caf\xc3\xa9 \xf0\x9f\x98\x80 \xe2\x82\xac\", \"q\": []}";
  j = pd_json_parse(raw, strlen(raw), &e);
  CHECKF(j != NULL, "raw UTF-8: %s", e.msg);
  if (j) CHECK(!strcmp(cJSON_GetObjectItem(j, "p")->valuestring, "caf\xc3\xa9 \xf0\x9f\x98\x80 \xe2\x82\xac"));
  cJSON_Delete(j);

  static const char *ok[] = {"{}", "[]", "\"x\"", "0", "-0", "1.5e-3", "1E+2", "true", "false",
                             "null", "[[[]]]", "{\"\": 1}", "{\"a\": {\"a\": 1}}",
                             "[{\"k\": 1}, {\"k\": 2}]", "{\"x\": \"\\u0001\"}"};
  for (size_t i = 0; i < sizeof ok / sizeof *ok; i++) {
    j = pd_json_parse(ok[i], strlen(ok[i]), &e);
    CHECKF(j != NULL, "'%s' refused: %s", ok[i], e.msg);
    cJSON_Delete(j);
  }
  /* the text need not be NUL-terminated: only n bytes are read */
  j = pd_json_parse("{\"a\": 12}garbage", 9, &e);
  CHECK(j && cJSON_GetObjectItem(j, "a")->valuedouble == 12);
  cJSON_Delete(j);
}

/* Nesting: PD_JSON_MAX_DEPTH containers parse, one more is refused. */
static void depth(void) {
  char buf[2 * PD_JSON_MAX_DEPTH + 8];
  for (int extra = 0; extra < 2; extra++) {
    int d = PD_JSON_MAX_DEPTH + extra, k = 0;
    for (int i = 0; i < d; i++) buf[k++] = '[';
    for (int i = 0; i < d; i++) buf[k++] = ']';
    pd_json_error e;
    cJSON *j = pd_json_parse(buf, (size_t)k, &e);
    if (extra == 0) CHECKF(j != NULL, "depth %d: %s", d, e.msg);
    else CHECK(!j && strstr(e.msg, "nested deeper"));
    cJSON_Delete(j);
  }
}

/* A large object: duplicates are found by sorting (no quadratic time), and its absence of
 * duplicates is confirmed. */
static void big_objects(void) {
  size_t cap = 1 << 20, k = 0;
  char *buf = malloc(cap);
  REQUIRE(buf);
  k += (size_t)snprintf(buf + k, cap - k, "{\"logit_bias\": {");
  for (int i = 0; i < 20000; i++) k += (size_t)snprintf(buf + k, cap - k, "%s\"%d\": 1", i ? ", " : "", i);
  size_t mid = k;
  k += (size_t)snprintf(buf + k, cap - k, "}}");
  pd_json_error e;
  cJSON *j = pd_json_parse(buf, k, &e);
  CHECKF(j != NULL, "20000 distinct keys: %s", e.msg);
  CHECK(j && cJSON_GetArraySize(cJSON_GetObjectItem(j, "logit_bias")) == 20000);
  cJSON_Delete(j);
  k = mid + (size_t)snprintf(buf + mid, cap - mid, ", \"12345\": 2}}");
  j = pd_json_parse(buf, k, &e);
  CHECK(!j && !strcmp(e.param, "logit_bias.12345") && strstr(e.msg, "duplicate key"));
  cJSON_Delete(j);
  free(buf);
}

/* pd_json_int64: exact 64-bit integers, refusals outside int64 or with a fraction. */
static void integers(void) {
  static const struct {
    const char *text;
    bool ok;
    int64_t v;
  } cases[] = {
      {"9223372036854775807", true, INT64_MAX},
      {"-9223372036854775808", true, INT64_MIN},
      {"9007199254740993", true, 9007199254740993LL}, /* 2^53 + 1: not a double */
      {"1152921504606846977", true, 1152921504606846977LL},
      {"9223372036854775808", false, 0},
      {"18446744073709551616", false, 0},
      {"-9223372036854775809", false, 0},
      {"1e18", true, 1000000000000000000LL},
      {"1e19", false, 0},
      {"1e30", false, 0},
      {"2.5", false, 0},
      {"7.0", true, 7},
      {"-3", true, -3},
      {"0", true, 0},
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    pd_json_error e;
    cJSON *j = pd_json_parse(cases[i].text, strlen(cases[i].text), &e);
    REQUIRE(j);
    int64_t v = 0;
    bool ok = pd_json_int64(j, &v);
    CHECKF(ok == cases[i].ok && (!ok || v == cases[i].v), "%s: ok %d v %lld", cases[i].text, ok,
           (long long)v);
    cJSON_Delete(j);
  }
  cJSON *s = cJSON_CreateString("5");
  int64_t v;
  CHECK(!pd_json_int64(s, &v));
  cJSON_Delete(s);
}

int main(void) {
  for (size_t i = 0; i < sizeof rejects / sizeof *rejects; i++) {
    const reject_case *c = &rejects[i];
    size_t len = c->len ? c->len : strlen(c->text);
    pd_json_error e;
    cJSON *j = pd_json_parse(c->text, len, &e);
    CHECKF(j == NULL, "case %zu accepted: %s", i, c->text);
    if (j) {
      cJSON_Delete(j);
      continue;
    }
    CHECKF(e.code == PD_EINVAL, "case %zu: code %d", i, e.code);
    CHECKF(!strcmp(e.param, c->param), "case %zu (%s): param '%s', want '%s'", i, c->text,
           e.param, c->param);
    CHECKF(strstr(e.msg, c->msg) != NULL, "case %zu (%s): message '%s' lacks '%s'", i, c->text,
           e.msg, c->msg);
    CHECKF(e.offset <= len, "case %zu: offset %zu beyond %zu", i, e.offset, len);
  }
  /* the offset of a refusal points at the fault: here the repeated key */
  pd_json_error e;
  CHECK(!pd_json_parse("{\"a\": 1, \"a\": 2}", 16, &e) && e.offset == 9);
  CHECK(!pd_json_parse("[1, 2] x", 8, &e) && e.offset == 7);
  accepts();
  depth();
  big_objects();
  integers();
  return pd_test_finish("test_json");
}
