/* Strict JSON into cJSON trees (pd/json.h): a recursive-descent parser over the bytes, bounded
 * by PD_JSON_MAX_DEPTH, that builds the tree with cJSON's own allocator. Strings are checked
 * in one pass (end, escapes, UTF-8, decoded length) and copied in a second (a memcpy when they
 * hold no escape), so a multi-megabyte prompt costs about what cJSON_Parse costs. */
#include "pd/json.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* Where the parser is: one segment per open container, the key or index being parsed. */
typedef struct seg {
  const char *key; /* decoded key in an object, or NULL in an array */
  size_t index;
} seg;

typedef struct parser {
  const char *s;
  size_t n, i;
  int depth;
  seg path[PD_JSON_MAX_DEPTH + 1];
  pd_json_error *err;
} parser;

/* Renders path[0, depth) the way OpenAI names nested parameters: "messages.[0].content". */
static void render_path(const parser *p, int depth, char *out, size_t cap) {
  size_t o = 0;
  out[0] = 0;
  for (int d = 0; d < depth && o + 1 < cap; d++) {
    int w = p->path[d].key ? snprintf(out + o, cap - o, "%s%s", o ? "." : "", p->path[d].key)
                           : snprintf(out + o, cap - o, "%s[%zu]", o ? "." : "", p->path[d].index);
    if (w < 0) break;
    o += (size_t)w;
  }
  if (o >= cap) out[cap - 1] = 0;
}

/* Records a refusal at offset at the current path (depth segments). Returns NULL for the
 * callers' convenience. */
__attribute__((format(printf, 4, 5))) static cJSON *fail_at(parser *p, size_t offset, int depth,
                                                            const char *fmt, ...) {
  pd_json_error *e = p->err;
  e->code = PD_EINVAL;
  e->offset = offset;
  render_path(p, depth, e->param, sizeof e->param);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->msg, sizeof e->msg, fmt, ap);
  va_end(ap);
  return NULL;
}

static cJSON *oom(parser *p) {
  pd_json_error *e = p->err;
  e->code = PD_ENOMEM;
  e->offset = p->i;
  e->param[0] = 0;
  snprintf(e->msg, sizeof e->msg, "out of memory");
  return NULL;
}

static void skip_ws(parser *p) {
  while (p->i < p->n) {
    char c = p->s[p->i];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') return;
    p->i++;
  }
}

static int hexval(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

/* Four hex digits at s[at]; -1 when they are not. */
static long hex4(const parser *p, size_t at) {
  if (at + 4 > p->n) return -1;
  long v = 0;
  for (int k = 0; k < 4; k++) {
    int h = hexval(p->s[at + (size_t)k]);
    if (h < 0) return -1;
    v = v * 16 + h;
  }
  return v;
}

/* The string starting at the '"' at p->i, decoded into a cJSON_malloc'ed buffer (*len bytes
 * plus a NUL); p->i ends after the closing quote. depth: the path of the string (a key is
 * reported at its object's path). */
static char *parse_string(parser *p, int depth, size_t *len) {
  const char *s = p->s;
  size_t start = p->i + 1, i = start, out_len = 0;
  bool escapes = false;
  /* pass 1: find the end, check every byte, count the decoded length */
  for (;;) {
    if (i >= p->n) {
      fail_at(p, p->i, depth, "unterminated string");
      return NULL;
    }
    unsigned char c = (unsigned char)s[i];
    if (c == '"') break;
    if (c < 0x20) {
      if (c == 0) fail_at(p, i, depth, "raw NUL byte in a string");
      else fail_at(p, i, depth, "raw control character 0x%02x in a string (escape it as \\u%04x)",
                   c, c);
      return NULL;
    }
    if (c == '\\') {
      escapes = true;
      if (i + 1 >= p->n) { /* a backslash as the last byte: nothing follows to escape */
        fail_at(p, p->i, depth, "unterminated string");
        return NULL;
      }
      char x = s[i + 1];
      if (x == 'u') {
        long cp = hex4(p, i + 2);
        if (cp < 0) {
          fail_at(p, i, depth, "\\u must be followed by four hex digits");
          return NULL;
        }
        size_t used = 6;
        if (cp == 0) {
          fail_at(p, i, depth, "\\u0000 (NUL) is not allowed in strings");
          return NULL;
        }
        if (cp >= 0xdc00 && cp <= 0xdfff) {
          fail_at(p, i, depth, "lone low surrogate \\u%04lx", cp);
          return NULL;
        }
        if (cp >= 0xd800 && cp <= 0xdbff) {
          long lo = i + 7 < p->n && s[i + 6] == '\\' && s[i + 7] == 'u' ? hex4(p, i + 8) : -1;
          if (lo < 0xdc00 || lo > 0xdfff) {
            fail_at(p, i, depth, "lone high surrogate \\u%04lx (not followed by a low surrogate)",
                    cp);
            return NULL;
          }
          used = 12;
          out_len += 4;
        } else {
          out_len += cp < 0x80 ? 1 : cp < 0x800 ? 2 : 3;
        }
        i += used;
        continue;
      }
      if (!strchr("\"\\/bfnrt", x) || x == 0) {
        fail_at(p, i, depth, "invalid escape \\%c", x >= 0x20 && x < 0x7f ? x : '?');
        return NULL;
      }
      out_len++;
      i += 2;
      continue;
    }
    if (c < 0x80) {
      out_len++;
      i++;
      continue;
    }
    utf8proc_int32_t cp;
    utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)s + i,
                                          (utf8proc_ssize_t)(p->n - i), &cp);
    if (k <= 0) {
      fail_at(p, i, depth, "invalid UTF-8 in a string");
      return NULL;
    }
    out_len += (size_t)k;
    i += (size_t)k;
  }
  size_t end = i;
  char *out = cJSON_malloc(out_len + 1);
  if (!out) {
    oom(p);
    return NULL;
  }
  /* pass 2: copy (every byte is known to be valid) */
  if (!escapes) {
    memcpy(out, s + start, out_len);
  } else {
    size_t o = 0;
    for (size_t j = start; j < end;) {
      if (s[j] != '\\') {
        out[o++] = s[j++];
        continue;
      }
      char x = s[j + 1];
      if (x == 'u') {
        uint32_t cp = (uint32_t)hex4(p, j + 2);
        j += 6;
        if (cp >= 0xd800 && cp <= 0xdbff) {
          uint32_t lo = (uint32_t)hex4(p, j + 2);
          cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          j += 6;
        }
        o += (size_t)utf8proc_encode_char((utf8proc_int32_t)cp, (utf8proc_uint8_t *)out + o);
        continue;
      }
      static const char from[] = "\"\\/bfnrt", to[] = "\"\\/\b\f\n\r\t";
      out[o++] = to[strchr(from, x) - from];
      j += 2;
    }
  }
  out[out_len] = 0;
  *len = out_len;
  p->i = end + 1;
  return out;
}

static cJSON *parse_number(parser *p, int depth) {
  const char *s = p->s;
  size_t b = p->i, i = b;
  bool integer = true;
  if (i < p->n && s[i] == '-') i++;
  if (i >= p->n || s[i] < '0' || s[i] > '9') return fail_at(p, b, depth, "invalid number");
  if (s[i] == '0') {
    i++;
    if (i < p->n && s[i] >= '0' && s[i] <= '9')
      return fail_at(p, b, depth, "invalid number (leading zero)");
  } else {
    while (i < p->n && s[i] >= '0' && s[i] <= '9') i++;
  }
  size_t int_digits = i - b - (s[b] == '-');
  if (i < p->n && s[i] == '.') {
    integer = false;
    i++;
    if (i >= p->n || s[i] < '0' || s[i] > '9')
      return fail_at(p, b, depth, "invalid number (no digit after the point)");
    while (i < p->n && s[i] >= '0' && s[i] <= '9') i++;
  }
  if (i < p->n && (s[i] == 'e' || s[i] == 'E')) {
    integer = false;
    i++;
    if (i < p->n && (s[i] == '+' || s[i] == '-')) i++;
    if (i >= p->n || s[i] < '0' || s[i] > '9')
      return fail_at(p, b, depth, "invalid number (no digit in the exponent)");
    while (i < p->n && s[i] >= '0' && s[i] <= '9') i++;
  }
  size_t len = i - b;
  char stack[128], *text = len < sizeof stack ? stack : malloc(len + 1);
  if (!text) return oom(p);
  memcpy(text, s + b, len);
  text[len] = 0;
  errno = 0;
  double v = strtod(text, NULL); /* the "C" locale: the router never calls setlocale */
  cJSON *item = NULL;
  if (isinf(v)) {
    fail_at(p, b, depth, "number %.40s%s is beyond the range of a double", text,
            len > 40 ? "..." : "");
  } else if (!(item = cJSON_CreateNumber(v))) {
    oom(p);
  } else if (integer && int_digits > 15) {
    /* more digits than a double holds exactly: keep the text (pd_json_int64) */
    item->valuestring = cJSON_malloc(len + 1);
    if (!item->valuestring) {
      cJSON_Delete(item);
      item = oom(p);
    } else {
      memcpy(item->valuestring, text, len + 1);
    }
  }
  if (text != stack) free(text);
  if (item) p->i = i;
  return item;
}

static int cmp_keys(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Whether key is among the members of obj so far (the first SMALL_OBJECT members are checked
 * this way as they arrive, so the error points at the repeated key). */
#define SMALL_OBJECT 16
static bool has_key(const cJSON *obj, const char *key) {
  for (const cJSON *a = obj->child; a; a = a->next)
    if (!strcmp(a->string, key)) return true;
  return false;
}

/* A key that occurs twice among the n members of a large object (logit_bias), or NULL: a sorted
 * copy of the keys, so no input costs quadratic time. */
static const char *duplicate_key(parser *p, const cJSON *obj, int n, bool *nomem) {
  *nomem = false;
  if (n <= SMALL_OBJECT) return NULL; /* checked member by member */
  const char **keys = malloc((size_t)n * sizeof *keys);
  if (!keys) {
    *nomem = true;
    oom(p);
    return NULL;
  }
  int k = 0;
  for (const cJSON *a = obj->child; a; a = a->next) keys[k++] = a->string;
  qsort(keys, (size_t)k, sizeof *keys, cmp_keys);
  const char *dup = NULL;
  for (int j = 1; j < k && !dup; j++)
    if (!strcmp(keys[j - 1], keys[j])) dup = keys[j];
  free(keys);
  return dup;
}

static cJSON *parse_value(parser *p);

/* After a member or an element: a ',' (1: another follows), the closing bracket (0), or
 * neither (-1). */
static int next_or_close(parser *p, char close) {
  skip_ws(p);
  if (p->i < p->n && p->s[p->i] == ',') {
    p->i++;
    return 1;
  }
  if (p->i < p->n && p->s[p->i] == close) {
    p->i++;
    return 0;
  }
  return -1;
}

static cJSON *parse_object(parser *p) {
  size_t open = p->i;
  int depth = p->depth;
  if (depth >= PD_JSON_MAX_DEPTH)
    return fail_at(p, open, depth, "nested deeper than %d levels", PD_JSON_MAX_DEPTH);
  cJSON *obj = cJSON_CreateObject();
  if (!obj) return oom(p);
  p->i++;
  skip_ws(p);
  int n = 0;
  if (p->i < p->n && p->s[p->i] == '}') {
    p->i++;
    return obj;
  }
  for (;;) {
    skip_ws(p);
    if (p->i >= p->n || p->s[p->i] != '"') {
      fail_at(p, p->i, depth, p->i >= p->n ? "unexpected end of the text in an object"
                                           : "expected a string key in an object");
      goto fail;
    }
    size_t klen, kat = p->i;
    char *key = parse_string(p, depth, &klen);
    if (!key) goto fail;
    if (n < SMALL_OBJECT && has_key(obj, key)) {
      p->path[depth] = (seg){key, 0};
      fail_at(p, kat, depth + 1, "duplicate key \"%.60s\"", key);
      cJSON_free(key);
      goto fail;
    }
    skip_ws(p);
    if (p->i >= p->n || p->s[p->i] != ':') {
      fail_at(p, p->i, depth, "expected ':' after the key \"%.60s\"", key);
      cJSON_free(key);
      goto fail;
    }
    p->i++;
    p->path[depth] = (seg){key, 0};
    p->depth = depth + 1;
    cJSON *v = parse_value(p);
    p->depth = depth;
    if (!v) {
      cJSON_free(key);
      goto fail;
    }
    v->string = key; /* cJSON_Delete frees it with the item */
    cJSON_AddItemToArray(obj, v); /* an object's members are its children, in order */
    n++;
    int more = next_or_close(p, '}');
    if (more > 0) continue;
    if (!more) break;
    fail_at(p, p->i, depth, "expected ',' or '}' after an object member");
    goto fail;
  }
  bool nomem;
  const char *dup = duplicate_key(p, obj, n, &nomem);
  if (nomem) goto fail;
  if (dup) {
    p->path[depth] = (seg){dup, 0};
    fail_at(p, open, depth + 1, "duplicate key \"%.60s\"", dup);
    goto fail;
  }
  return obj;
fail:
  cJSON_Delete(obj);
  return NULL;
}

static cJSON *parse_array(parser *p) {
  int depth = p->depth;
  if (depth >= PD_JSON_MAX_DEPTH)
    return fail_at(p, p->i, depth, "nested deeper than %d levels", PD_JSON_MAX_DEPTH);
  cJSON *arr = cJSON_CreateArray();
  if (!arr) return oom(p);
  p->i++;
  skip_ws(p);
  if (p->i < p->n && p->s[p->i] == ']') {
    p->i++;
    return arr;
  }
  for (size_t k = 0;; k++) {
    p->path[depth] = (seg){NULL, k};
    p->depth = depth + 1;
    cJSON *v = parse_value(p);
    p->depth = depth;
    if (!v) goto fail;
    cJSON_AddItemToArray(arr, v);
    int more = next_or_close(p, ']');
    if (more > 0) continue;
    if (!more) return arr;
    fail_at(p, p->i, depth, "expected ',' or ']' after an array element");
    goto fail;
  }
fail:
  cJSON_Delete(arr);
  return NULL;
}

static cJSON *parse_literal(parser *p, const char *word, cJSON *(*make)(void)) {
  size_t l = strlen(word);
  if (p->n - p->i < l || memcmp(p->s + p->i, word, l))
    return fail_at(p, p->i, p->depth, "expected a value");
  cJSON *v = make();
  if (!v) return oom(p);
  p->i += l;
  return v;
}

static cJSON *make_true(void) { return cJSON_CreateTrue(); }
static cJSON *make_false(void) { return cJSON_CreateFalse(); }

static cJSON *parse_value(parser *p) {
  skip_ws(p);
  if (p->i >= p->n) return fail_at(p, p->i, p->depth, "unexpected end of the text");
  char c = p->s[p->i];
  switch (c) {
    case '{': return parse_object(p);
    case '[': return parse_array(p);
    case '"': {
      size_t len;
      char *s = parse_string(p, p->depth, &len);
      if (!s) return NULL;
      cJSON *v = cJSON_CreateNull(); /* becomes the string that owns s */
      if (!v) {
        cJSON_free(s);
        return oom(p);
      }
      v->type = cJSON_String;
      v->valuestring = s;
      return v;
    }
    case 't': return parse_literal(p, "true", make_true);
    case 'f': return parse_literal(p, "false", make_false);
    case 'n': return parse_literal(p, "null", cJSON_CreateNull);
    default:
      if (c == '-' || (c >= '0' && c <= '9')) return parse_number(p, p->depth);
      if ((unsigned char)c == 0xef)
        return fail_at(p, p->i, p->depth, "a byte order mark is not allowed");
      return fail_at(p, p->i, p->depth, "expected a value");
  }
}

cJSON *pd_json_parse(const char *s, size_t n, pd_json_error *err) {
  pd_json_error dummy;
  parser p = {.s = s, .n = n, .err = err ? err : &dummy};
  memset(p.err, 0, sizeof *p.err);
  if (!s) {
    p.n = 0;
    p.s = "";
  }
  cJSON *root = parse_value(&p);
  if (!root) return NULL;
  skip_ws(&p);
  if (p.i < p.n) {
    fail_at(&p, p.i, 0, "unexpected data after the JSON value");
    cJSON_Delete(root);
    return NULL;
  }
  return root;
}

bool pd_json_int64(const cJSON *item, int64_t *out) {
  if (!cJSON_IsNumber(item)) return false;
  if (item->valuestring) { /* an integer literal of more than 15 digits, kept as text */
    char *end;
    errno = 0;
    long long v = strtoll(item->valuestring, &end, 10);
    if (errno == ERANGE || *end) return false;
    *out = (int64_t)v;
    return true;
  }
  double d = item->valuedouble;
  /* -2^63 and 2^63 are exact doubles; every integral double in between converts exactly */
  if (!isfinite(d) || d != floor(d) || d < -9223372036854775808.0 || d >= 9223372036854775808.0)
    return false;
  *out = (int64_t)d;
  return true;
}
