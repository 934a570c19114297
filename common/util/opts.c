#include "pd/opts.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SECRET_MAX 4096

static pd_status set_value(const pd_opt *o, const char *v, const char *from, pd_err *e) {
  char *end = NULL;
  errno = 0;
  switch (o->type) {
    case PD_OPT_STR:
      *(const char **)o->dst = v;
      break;
    case PD_OPT_INT: {
      long x = strtol(v, &end, 10);
      if (errno || end == v || *end || x < -2147483647L || x > 2147483647L)
        return pd_err_set(e, PD_EINVAL, "%s --%s: '%s' is not an integer", from, o->name, v);
      *(int *)o->dst = (int)x;
      break;
    }
    case PD_OPT_U64: {
      if (v[0] == '-')
        return pd_err_set(e, PD_EINVAL, "%s --%s: '%s' is not a non-negative integer", from,
                          o->name, v);
      unsigned long long x = strtoull(v, &end, 10);
      if (errno || end == v || *end)
        return pd_err_set(e, PD_EINVAL, "%s --%s: '%s' is not a non-negative integer", from,
                          o->name, v);
      *(unsigned long long *)o->dst = x;
      break;
    }
    case PD_OPT_DOUBLE: {
      double x = strtod(v, &end);
      if (errno || end == v || *end)
        return pd_err_set(e, PD_EINVAL, "%s --%s: '%s' is not a number", from, o->name, v);
      *(double *)o->dst = x;
      break;
    }
    case PD_OPT_BOOL:
      if (!strcmp(v, "1") || !strcmp(v, "true") || !strcmp(v, "yes") || !strcmp(v, "on")) {
        *(bool *)o->dst = true;
      } else if (!strcmp(v, "0") || !strcmp(v, "false") || !strcmp(v, "no") ||
                 !strcmp(v, "off")) {
        *(bool *)o->dst = false;
      } else {
        return pd_err_set(e, PD_EINVAL, "%s --%s: '%s' is not a boolean", from, o->name, v);
      }
      break;
  }
  if (o->seen) *o->seen = true;
  return PD_OK;
}

static const pd_opt *find(const pd_opt *opts, const char *name, size_t len) {
  for (const pd_opt *o = opts; o->name; o++)
    if (strlen(o->name) == len && !strncmp(o->name, name, len)) return o;
  return NULL;
}

/* The environment variable of flag --name: PD_NAME, '-' as '_' ("max-tokens": PD_MAX_TOKENS). */
static void env_name(const char *name, char *out, size_t cap) {
  size_t j = (size_t)snprintf(out, cap, "PD_");
  for (const char *p = name; *p && j + 1 < cap; p++)
    out[j++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
  out[j] = 0;
}

/* String values from config files: options point into them for the rest of the process
 * (options are parsed once), so they are kept here, reachable, rather than freed. */
static char **g_kept;
static size_t g_n_kept, g_cap_kept;

static char *keep_string(const char *v) {
  if (g_n_kept == g_cap_kept) {
    size_t cap = g_cap_kept ? 2 * g_cap_kept : 16;
    char **k = realloc(g_kept, cap * sizeof *k);
    if (!k) return NULL;
    g_kept = k;
    g_cap_kept = cap;
  }
  char *s = strdup(v);
  if (s) g_kept[g_n_kept++] = s;
  return s;
}

/* --config FILE: {"flag-name": value, ...}. Values are JSON strings, numbers or booleans and go
 * through the same conversion and checks as command-line values. */
static pd_status apply_config(const pd_opt *opts, const char *path, pd_err *e) {
  FILE *f = fopen(path, "rb");
  if (!f) return pd_err_set(e, PD_EIO, "--config %s: cannot read it: %s", path, strerror(errno));
  char *text = NULL;
  size_t len = 0, cap = 0;
  for (;;) {
    if (len + 4096 + 1 > cap) {
      cap = cap ? 2 * cap : 8192;
      char *t = realloc(text, cap);
      if (!t) {
        free(text);
        fclose(f);
        return pd_err_set(e, PD_ENOMEM, "--config %s: out of memory", path);
      }
      text = t;
    }
    size_t got = fread(text + len, 1, 4096, f);
    len += got;
    if (got < 4096) break;
  }
  bool io_err = ferror(f);
  fclose(f);
  if (io_err || len > ((size_t)1 << 20)) {
    free(text);
    return pd_err_set(e, PD_EINVAL, "--config %s: %s", path,
                      io_err ? "read error" : "larger than 1 MiB");
  }
  text[len] = 0;
  const char *end = NULL;
  cJSON *root = cJSON_ParseWithLengthOpts(text, len + 1, &end, true); /* the NUL included */
  free(text);
  if (!root || !cJSON_IsObject(root)) {
    cJSON_Delete(root);
    return pd_err_set(e, PD_EFORMAT, "--config %s: not a JSON object of option names and values",
                      path);
  }
  pd_status st = PD_OK;
  const cJSON *it;
  cJSON_ArrayForEach(it, root) {
    const char *key = it->string;
    while (*key == '-') key++;
    const pd_opt *o = find(opts, key, strlen(key));
    if (!o || !strcmp(key, "config") || !strcmp(key, "help")) {
      st = pd_err_set(e, PD_EINVAL, "--config %s: unknown option '%s'", path, it->string);
      break;
    }
    char num[64];
    const char *v = NULL;
    if (cJSON_IsString(it)) {
      v = it->valuestring;
    } else if (cJSON_IsBool(it)) {
      v = cJSON_IsTrue(it) ? "true" : "false";
    } else if (cJSON_IsNumber(it)) {
      double d = it->valuedouble;
      if (d == (double)(int64_t)d && d > -9.2e18 && d < 9.2e18)
        snprintf(num, sizeof num, "%" PRId64, (int64_t)d);
      else
        snprintf(num, sizeof num, "%.17g", d);
      v = num;
    } else {
      st = pd_err_set(e, PD_EINVAL, "--config %s: '%s' must be a string, number or boolean",
                      path, it->string);
      break;
    }
    const char *val = o->type == PD_OPT_STR ? keep_string(v) : v;
    if (!val) {
      st = pd_err_set(e, PD_ENOMEM, "--config %s: out of memory", path);
      break;
    }
    char from[256];
    snprintf(from, sizeof from, "--config %s:", path);
    st = set_value(o, val, from, e);
    if (st) break;
  }
  cJSON_Delete(root);
  return st;
}

/* The --config FILE (or PD_CONFIG) given, or NULL. */
static const char *config_path(int argc, char **argv, int first) {
  const char *path = getenv("PD_CONFIG");
  for (int i = first; i < argc; i++) {
    if (!strcmp(argv[i], "--config") && i + 1 < argc) path = argv[i + 1];
    else if (!strncmp(argv[i], "--config=", 9)) path = argv[i] + 9;
  }
  return path && *path ? path : NULL;
}

pd_status pd_opts_parse(const pd_opt *opts, int argc, char **argv, int first, pd_err *e) {
  /* a config file first, then the environment, then the command line: each later one wins */
  const char *cfg = config_path(argc, argv, first);
  if (cfg) {
    pd_status st = apply_config(opts, cfg, e);
    if (st) return st;
  }
  /* environment: PD_MAX_TOKENS for --max-tokens */
  for (const pd_opt *o = opts; o->name; o++) {
    char env[128];
    env_name(o->name, env, sizeof env);
    const char *v = getenv(env);
    if (v && *v) {
      pd_status st = set_value(o, v, env, e);
      if (st) return st;
    }
  }
  for (int i = first; i < argc; i++) {
    const char *a = argv[i];
    if (strncmp(a, "--", 2) != 0 || !a[2])
      return pd_err_set(e, PD_EINVAL, "unexpected argument '%s'", a);
    const char *name = a + 2, *eq = strchr(name, '=');
    size_t len = eq ? (size_t)(eq - name) : strlen(name);
    if (len == 6 && !strncmp(name, "config", 6)) { /* applied first, above */
      if (!eq && ++i >= argc) return pd_err_set(e, PD_EINVAL, "option --config needs a value");
      continue;
    }
    const pd_opt *o = find(opts, name, len);
    if (!o) return pd_err_set(e, PD_EINVAL, "unknown option '--%.*s'", (int)len, name);
    if (o->type == PD_OPT_BOOL && !eq) {
      *(bool *)o->dst = true;
      if (o->seen) *o->seen = true;
      continue;
    }
    const char *v = eq ? eq + 1 : NULL;
    if (!v) {
      if (i + 1 >= argc) return pd_err_set(e, PD_EINVAL, "option --%s needs a value", o->name);
      v = argv[++i];
    }
    pd_status st = set_value(o, v, "option", e);
    if (st) return st;
  }
  return PD_OK;
}

void pd_opts_usage(FILE *f, const pd_opt *opts) {
  for (const pd_opt *o = opts; o->name; o++) {
    char left[64];
    snprintf(left, sizeof left, "--%s%s%s", o->name, o->metavar ? " " : "",
             o->metavar ? o->metavar : "");
    fprintf(f, "  %-28s %s\n", left, o->help);
  }
  fprintf(f, "  %-28s %s\n", "--config FILE",
          "options from a JSON file, {\"option-name\": value, ...} (PD_* environment variables "
          "and the command line win)");
}

/* ---- secrets ---- */

static pd_status secret_check(const char *what, const char *v, size_t n, pd_err *e) {
  if (n == 0) return pd_err_set(e, PD_EINVAL, "%s: empty", what);
  if (n > SECRET_MAX) return pd_err_set(e, PD_ERANGE, "%s: longer than %d bytes", what, SECRET_MAX);
  for (size_t i = 0; i < n; i++)
    if ((unsigned char)v[i] <= 0x20 || (unsigned char)v[i] >= 0x7f)
      return pd_err_set(e, PD_EINVAL, "%s: byte %zu is not printable ASCII (or is a space)",
                        what, i + 1);
  return PD_OK;
}

pd_status pd_secret_opt(const char *name, const char *value, const char *file, char **out,
                        pd_err *e) {
  *out = NULL;
  bool has_value = value && *value, has_file = file && *file;
  if (has_value && has_file) {
    char env[128];
    env_name(name, env, sizeof env);
    return pd_err_set(e, PD_ERANGE, "give --%s or --%s-file, not both (%s in the environment "
                      "counts as --%s)", name, name, env, name);
  }
  char what[4200];
  if (has_value) {
    snprintf(what, sizeof what, "--%s", name);
    size_t n = strlen(value);
    pd_status st = secret_check(what, value, n, e);
    if (st) return st;
    if (!(*out = strdup(value))) return pd_err_set(e, PD_ENOMEM, "out of memory");
    return PD_OK;
  }
  if (!has_file) return PD_OK;
  snprintf(what, sizeof what, "--%s-file %s", name, file);
  FILE *f = fopen(file, "r");
  if (!f) return pd_err_set(e, PD_EIO, "%s: %s", what, strerror(errno));
  char buf[SECRET_MAX + 3];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  bool bad = ferror(f) != 0;
  fclose(f);
  pd_status st = PD_OK;
  if (bad) {
    st = pd_err_set(e, PD_EIO, "%s: read error", what);
  } else {
    buf[n] = 0;
    const char *nl = memchr(buf, '\n', n); /* the first line */
    size_t end = nl ? (size_t)(nl - buf) : n;
    if (end == n && n == sizeof buf - 1)
      st = pd_err_set(e, PD_ERANGE, "%s: longer than %d bytes", what, SECRET_MAX);
    size_t b = 0;
    while (b < end && (buf[b] == ' ' || buf[b] == '\t')) b++;
    while (end > b && (buf[end - 1] == ' ' || buf[end - 1] == '\t' || buf[end - 1] == '\r'))
      end--;
    if (!st) st = secret_check(what, buf + b, end - b, e);
    if (!st) {
      *out = malloc(end - b + 1);
      if (!*out) {
        st = pd_err_set(e, PD_ENOMEM, "out of memory");
      } else {
        memcpy(*out, buf + b, end - b);
        (*out)[end - b] = 0;
      }
    }
  }
  volatile char *v = buf; /* the stack copy does not outlive the call */
  for (size_t i = 0; i < sizeof buf; i++) v[i] = 0;
  return st;
}

void pd_secret_free(char *s) {
  if (!s) return;
  volatile char *v = s;
  for (size_t i = 0; v[i]; i++) v[i] = 0;
  free(s);
}
