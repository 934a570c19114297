#include "pd/opts.h"

#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

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

pd_status pd_opts_parse(const pd_opt *opts, int argc, char **argv, int first, pd_err *e) {
  /* environment first: PD_MAX_TOKENS for --max-tokens */
  for (const pd_opt *o = opts; o->name; o++) {
    char env[128] = "PD_";
    size_t j = 3;
    for (const char *p = o->name; *p && j < sizeof env - 1; p++)
      env[j++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
    env[j] = 0;
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
}
