/* pd/opts.h: flags from the command line and the environment, and secrets (pd_secret_opt) from
 * a value or a file: one of the two, the file's first line, printable ASCII, bounded, and never
 * repeated in an error message. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "pd/opts.h"
#include "pd_test.h"

static char dir[] = "/tmp/pd_opts_XXXXXX";

/* Writes n bytes of text to dir/name; returns its path (static). */
static const char *file_with(const char *name, const char *text, size_t n) {
  static char path[128];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE *f = fopen(path, "wb");
  REQUIRE(f);
  REQUIRE(fwrite(text, 1, n, f) == n);
  fclose(f);
  return path;
}

static void test_env_and_argv(void) {
  const char *key = NULL;
  bool insecure = false;
  pd_opt opts[] = {{"api-key", PD_OPT_STR, &key, "KEY", "a key", NULL},
                   {"insecure", PD_OPT_BOOL, &insecure, NULL, "no keys", NULL},
                   {0}};
  pd_err e = {0};
  setenv("PD_API_KEY", "from-env", 1);
  setenv("PD_INSECURE", "1", 1);
  char *argv0[] = {"prog"};
  CHECK(pd_opts_parse(opts, 1, argv0, 1, &e) == PD_OK && key && !strcmp(key, "from-env") &&
        insecure);
  char *argv1[] = {"prog", "--api-key=from-argv"};
  CHECK(pd_opts_parse(opts, 2, argv1, 1, &e) == PD_OK && !strcmp(key, "from-argv")); /* wins */
  unsetenv("PD_API_KEY");
  unsetenv("PD_INSECURE");
}

static void test_secrets(void) {
  pd_err e = {0};
  char *s = (char *)1;
  CHECK(pd_secret_opt("api-key", NULL, NULL, &s, &e) == PD_OK && s == NULL); /* none */
  CHECK(pd_secret_opt("api-key", "sk-abc", NULL, &s, &e) == PD_OK && !strcmp(s, "sk-abc"));
  pd_secret_free(s);
  /* the first line of a file, blanks and the line end dropped */
  const char *p = file_with("k1", "  sk-from-file\r\nsecond line\n", 29);
  CHECK(pd_secret_opt("api-key", NULL, p, &s, &e) == PD_OK && !strcmp(s, "sk-from-file"));
  pd_secret_free(s);
  p = file_with("k2", "sk-no-newline", 13);
  CHECK(pd_secret_opt("api-key", NULL, p, &s, &e) == PD_OK && !strcmp(s, "sk-no-newline"));
  pd_secret_free(s);
  /* one of the two only */
  CHECK(pd_secret_opt("api-key", "sk-abc", p, &s, &e) == PD_ERANGE && s == NULL &&
        strstr(e.msg, "PD_API_KEY") && !strstr(e.msg, "sk-abc"));
  /* refusals name the flag or the file, never the secret */
  CHECK(pd_secret_opt("api-key", "has space", NULL, &s, &e) == PD_EINVAL && !strstr(e.msg, "has"));
  p = file_with("k3", "sk-with\001control\n", 17);
  CHECK(pd_secret_opt("api-key", NULL, p, &s, &e) == PD_EINVAL && !strstr(e.msg, "sk-with") &&
        strstr(e.msg, "k3"));
  p = file_with("k4", "sk-nul\0after\n", 13); /* a NUL is not printable: not a silent cut */
  CHECK(pd_secret_opt("api-key", NULL, p, &s, &e) == PD_EINVAL);
  p = file_with("k5", "\n", 1);
  CHECK(pd_secret_opt("api-key", NULL, p, &s, &e) == PD_EINVAL && strstr(e.msg, "empty"));
  static char big[5000];
  memset(big, 'k', sizeof big);
  p = file_with("k6", big, sizeof big);
  CHECK(pd_secret_opt("api-key", NULL, p, &s, &e) == PD_ERANGE && !strstr(e.msg, "kkkk"));
  CHECK(pd_secret_opt("api-key", NULL, "/nonexistent/key", &s, &e) == PD_EIO &&
        strstr(e.msg, "/nonexistent/key"));
  char max[4097];
  memset(max, 'k', 4096);
  max[4096] = 0;
  CHECK(pd_secret_opt("api-key", max, NULL, &s, &e) == PD_OK && strlen(s) == 4096);
  pd_secret_free(s);
  pd_secret_free(NULL);
}

int main(void) {
  REQUIRE(mkdtemp(dir));
  test_env_and_argv();
  test_secrets();
  for (int i = 1; i <= 6; i++) {
    char path[128];
    snprintf(path, sizeof path, "%s/k%d", dir, i);
    unlink(path);
  }
  rmdir(dir);
  return pd_test_finish("test_secret_opts");
}
