/* The options table (pd/opts.h): values from the command line, the environment and a --config
 * JSON file, their precedence (file < environment < command line), and the refusals: unknown
 * options, values of the wrong type, a file that is not a JSON object. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pd/opts.h"
#include "pd_test.h"

typedef struct vals {
  int n;
  double t;
  const char *s;
  bool b;
  unsigned long long u;
} vals;

static pd_status parse(vals *v, int argc, char **argv, pd_err *e) {
  memset(v, 0, sizeof *v);
  v->n = 7;
  const pd_opt opts[] = {{"max-tokens", PD_OPT_INT, &v->n, "N", "", NULL},
                         {"temperature", PD_OPT_DOUBLE, &v->t, "T", "", NULL},
                         {"device", PD_OPT_STR, &v->s, "DEV", "", NULL},
                         {"enforce-eager", PD_OPT_BOOL, &v->b, NULL, "", NULL},
                         {"seed", PD_OPT_U64, &v->u, "S", "", NULL},
                         {0}};
  return pd_opts_parse(opts, argc, argv, 1, e);
}

static const char *write_tmp(const char *text) {
  static char path[64];
  snprintf(path, sizeof path, "/tmp/pd-test-opts-%d.json", (int)getpid());
  FILE *f = fopen(path, "w");
  REQUIRE(f);
  fputs(text, f);
  fclose(f);
  return path;
}

int main(void) {
  pd_err e = {0};
  vals v;
  unsetenv("PD_MAX_TOKENS");
  unsetenv("PD_CONFIG");
  {
    char *argv[] = {"x", "--max-tokens", "12", "--temperature=0.5", "--device", "cuda:1",
                    "--enforce-eager", "--seed", "18446744073709551615"};
    CHECK(parse(&v, 9, argv, &e) == PD_OK);
    CHECK(v.n == 12 && v.t == 0.5 && !strcmp(v.s, "cuda:1") && v.b &&
          v.u == 18446744073709551615ull);
  }
  { /* a config file: every type, flag names with or without dashes */
    const char *p = write_tmp("{\"max-tokens\": 5, \"temperature\": 0.25, \"--device\": "
                              "\"cuda:2\", \"enforce-eager\": true, \"seed\": 42}\n");
    char *argv[] = {"x", "--config", (char *)p};
    CHECK(parse(&v, 3, argv, &e) == PD_OK);
    CHECK(v.n == 5 && v.t == 0.25 && !strcmp(v.s, "cuda:2") && v.b && v.u == 42);
    /* the environment wins over the file, the command line over both */
    setenv("PD_MAX_TOKENS", "9", 1);
    CHECK(parse(&v, 3, argv, &e) == PD_OK && v.n == 9);
    char *argv2[] = {"x", "--config=" , "--max-tokens", "3"};
    char cfg[128];
    snprintf(cfg, sizeof cfg, "--config=%s", p);
    argv2[1] = cfg;
    CHECK(parse(&v, 4, argv2, &e) == PD_OK && v.n == 3 && v.t == 0.25);
    unsetenv("PD_MAX_TOKENS");
    /* PD_CONFIG names the file too */
    setenv("PD_CONFIG", p, 1);
    char *argv3[] = {"x"};
    CHECK(parse(&v, 1, argv3, &e) == PD_OK && v.n == 5);
    unsetenv("PD_CONFIG");
    unlink(p);
  }
  { /* refusals, each with a message naming what is wrong */
    static const struct {
      const char *json, *want;
    } bad[] = {{"{\"bogus\": 1}", "unknown option 'bogus'"},
               {"{\"max-tokens\": \"many\"}", "is not an integer"},
               {"{\"max-tokens\": 2.5}", "is not an integer"},
               {"{\"seed\": -1}", "non-negative"},
               {"{\"device\": [1]}", "must be a string, number or boolean"},
               {"[1, 2]", "not a JSON object"},
               {"{\"max-tokens\": 1} trailing", "not a JSON object"},
               {"{\"help\": true}", "unknown option 'help'"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
      const char *p = write_tmp(bad[i].json);
      char *argv[] = {"x", "--config", (char *)p};
      memset(&e, 0, sizeof e);
      CHECKF(parse(&v, 3, argv, &e) != PD_OK && strstr(e.msg, bad[i].want),
             "%s: got '%s'", bad[i].json, e.msg);
      unlink(p);
    }
    char *argv[] = {"x", "--config", "/nonexistent/pd.json"};
    CHECK(parse(&v, 3, argv, &e) != PD_OK && strstr(e.msg, "cannot read"));
    char *argv2[] = {"x", "--config"};
    CHECK(parse(&v, 2, argv2, &e) != PD_OK && strstr(e.msg, "needs a value"));
    char *argv3[] = {"x", "--nope"};
    CHECK(parse(&v, 2, argv3, &e) != PD_OK && strstr(e.msg, "unknown option"));
  }
  if (pd_test_failures) {
    printf("test_opts: %d checks failed\n", pd_test_failures);
    return 1;
  }
  printf("test_opts: all checks passed\n");
  return 0;
}
