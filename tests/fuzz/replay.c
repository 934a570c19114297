/* Replays inputs through a fuzz target without libFuzzer: every file named on the command
 * line, or every file of a directory named there (in name order), once each. The unit tests
 * test_fuzz_<name> run the corpus of tests/fuzz/corpus/<name>/ this way, so that an input that
 * once crashed, leaked or hung stays fixed in every build (gcc, Release, ASan). */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz.h"

__attribute__((weak)) int LLVMFuzzerInitialize(int *argc, char ***argv);

static int run_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "replay: cannot open %s\n", path);
    return 1;
  }
  size_t cap = 4096, n = 0;
  uint8_t *buf = malloc(cap);
  size_t k;
  while (buf && (k = fread(buf + n, 1, cap - n, f)) > 0) {
    n += k;
    if (n == cap) {
      uint8_t *b = realloc(buf, cap *= 2);
      if (!b) free(buf);
      buf = b;
    }
  }
  fclose(f);
  if (!buf) {
    fprintf(stderr, "replay: out of memory reading %s\n", path);
    return 1;
  }
  /* a copy of exactly n bytes, so that ASan sees a read past the input's end */
  uint8_t *exact = malloc(n ? n : 1);
  if (!exact) {
    free(buf);
    return 1;
  }
  memcpy(exact, buf, n);
  free(buf);
  LLVMFuzzerTestOneInput(exact, n);
  free(exact);
  return 0;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv) {
  if (LLVMFuzzerInitialize) LLVMFuzzerInitialize(&argc, &argv);
  int files = 0, bad = 0;
  for (int i = 1; i < argc; i++) {
    struct stat sb;
    if (stat(argv[i], &sb) != 0) {
      fprintf(stderr, "replay: %s: no such file or directory\n", argv[i]);
      return 1;
    }
    if (!S_ISDIR(sb.st_mode)) {
      bad += run_file(argv[i]);
      files++;
      continue;
    }
    DIR *d = opendir(argv[i]);
    if (!d) return 1;
    char **names = NULL;
    size_t n = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
      if (de->d_name[0] == '.') continue;
      char **v = realloc(names, (n + 1) * sizeof *v);
      if (!v) return 1;
      names = v;
      size_t l = strlen(argv[i]) + strlen(de->d_name) + 2;
      if (!(names[n] = malloc(l))) return 1;
      snprintf(names[n++], l, "%s/%s", argv[i], de->d_name);
    }
    closedir(d);
    qsort(names, n, sizeof *names, cmp_str);
    for (size_t k = 0; k < n; k++) {
      bad += run_file(names[k]);
      files++;
      free(names[k]);
    }
    free(names);
  }
  if (!files) fprintf(stderr, "replay: no inputs\n");
  else if (!bad) printf("replay: %d inputs, every one ran without a failure\n", files);
  return bad || !files ? 1 : 0;
}
