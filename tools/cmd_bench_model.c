/* pdctl bench-model: prefill and decode tokens/s of a model on this machine's CPU backend.
 *
 * Prefill: each of B sequences gets a prompt of --prompt-len random token ids, fed in
 * --max-batch-tokens chunks (one forward per chunk), timed end to end.
 * Decode: then --decode-tokens steps, each one forward over all B sequences (one new token
 * each), timed end to end. Best of --repeat runs is reported. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pdctl.h"

typedef struct result {
  int batch;
  double prefill_tps, decode_tps, decode_ms_per_step;
} result;

static int run_one(const char *model, int batch, int prompt_len, int gen, int chunk,
                   int threads, int repeat, result *out, const char **isa) {
  pdctl_runner r;
  pd_err e = {0};
  if (pdctl_runner_open(&r, model, batch, prompt_len + gen, chunk, threads, &e))
    return pdctl_fail("%s", e.msg);
  *isa = pd_backend_cpu_isa(r.be);
  int32_t *prompt = malloc((size_t)prompt_len * sizeof *prompt);
  int32_t *toks = malloc((size_t)batch * sizeof *toks);
  if (!prompt || !toks) return pdctl_fail("out of memory");
  unsigned seed = 12345;
  out->batch = batch;
  out->prefill_tps = out->decode_tps = 0;
  for (int rep = 0; rep < repeat; rep++) {
    for (int s = 0; s < batch; s++) r.ctx[s] = 0;
    double t0 = pdctl_now();
    for (int s = 0; s < batch; s++) {
      for (int i = 0; i < prompt_len; i++) {
        seed = seed * 1103515245u + 12345u;
        prompt[i] = (int32_t)((seed >> 8) % (unsigned)r.V);
      }
      if (pdctl_runner_feed(&r, s, prompt, prompt_len, &e) != PD_OK)
        return pdctl_fail("%s", e.msg);
    }
    double t1 = pdctl_now();
    for (int s = 0; s < batch; s++) toks[s] = (int32_t)(s % r.V);
    for (int i = 0; i < gen; i++) {
      if (pdctl_runner_step(&r, toks, &e) != PD_OK) return pdctl_fail("%s", e.msg);
      for (int s = 0; s < batch; s++) {
        const float *lg = r.logits + (size_t)s * r.V;
        int best = 0;
        for (int v = 1; v < r.V; v++)
          if (lg[v] > lg[best]) best = v;
        toks[s] = best;
      }
    }
    double t2 = pdctl_now();
    double p = (double)batch * prompt_len / (t1 - t0), d = (double)batch * gen / (t2 - t1);
    if (p > out->prefill_tps) out->prefill_tps = p;
    if (d > out->decode_tps) {
      out->decode_tps = d;
      out->decode_ms_per_step = 1e3 * (t2 - t1) / gen;
    }
  }
  free(prompt);
  free(toks);
  pdctl_runner_close(&r);
  return 0;
}

int cmd_bench_model(int argc, char **argv) {
  const char *model = NULL, *batches = "1";
  int prompt_len = 512, gen = 128, chunk = 512, threads = 0, repeat = 3;
  bool json = false, help = false;
  pd_opt opts[] = {
      {"model", PD_OPT_STR, &model, "DIR", "model folder", NULL},
      {"batch", PD_OPT_STR, &batches, "B[,B...]", "concurrent sequences (default 1)", NULL},
      {"prompt-len", PD_OPT_INT, &prompt_len, "N", "prompt tokens per sequence (512)", NULL},
      {"decode-tokens", PD_OPT_INT, &gen, "N", "decode steps (128)", NULL},
      {"max-batch-tokens", PD_OPT_INT, &chunk, "N", "tokens per prefill forward (512)", NULL},
      {"threads", PD_OPT_INT, &threads, "N", "CPU threads (0 = all cores)", NULL},
      {"repeat", PD_OPT_INT, &repeat, "N", "runs; the best is reported (3)", NULL},
      {"json", PD_OPT_BOOL, &json, NULL, "print JSON", NULL},
      {"help", PD_OPT_BOOL, &help, NULL, "show this help", NULL},
      {0}};
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 2, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (help) {
    fputs("usage: pdctl bench-model --model DIR [options]\n", stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  if (!model) return pdctl_fail("bench-model needs --model DIR");
  if (prompt_len < 1 || gen < 1 || chunk < 1 || repeat < 1 || threads < 0)
    return pdctl_fail("--prompt-len, --decode-tokens, --max-batch-tokens and --repeat must be "
                      "positive");
  size_t nb = 0;
  int32_t *bl = pdctl_parse_ids(batches, &nb, &e);
  if (!bl || nb == 0) return pdctl_fail("--batch: %s", bl ? "empty list" : e.msg);
  cJSON *arr = cJSON_CreateArray();
  const char *isa = "?";
  if (!json)
    printf("%8s %16s %16s %14s\n", "batch", "prefill tok/s", "decode tok/s", "ms/step");
  for (size_t i = 0; i < nb; i++) {
    if (bl[i] < 1) return pdctl_fail("--batch values must be positive");
    result res = {0};
    if (run_one(model, bl[i], prompt_len, gen, chunk, threads, repeat, &res, &isa)) return 1;
    if (json) {
      cJSON *o = cJSON_CreateObject();
      cJSON_AddNumberToObject(o, "batch", res.batch);
      cJSON_AddNumberToObject(o, "prefill_tokens_per_s", res.prefill_tps);
      cJSON_AddNumberToObject(o, "decode_tokens_per_s", res.decode_tps);
      cJSON_AddNumberToObject(o, "decode_ms_per_step", res.decode_ms_per_step);
      cJSON_AddItemToArray(arr, o);
    } else {
      printf("%8d %16.0f %16.0f %14.3f\n", res.batch, res.prefill_tps, res.decode_tps,
             res.decode_ms_per_step);
      fflush(stdout);
    }
  }
  if (json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "model", model);
    cJSON_AddStringToObject(o, "isa", isa);
    cJSON_AddNumberToObject(o, "prompt_len", prompt_len);
    cJSON_AddNumberToObject(o, "decode_tokens", gen);
    cJSON_AddItemToObject(o, "results", arr);
    char *s = cJSON_PrintUnformatted(o);
    puts(s);
    free(s);
    cJSON_Delete(o);
  } else {
    printf("(CPU backend, %s kernels, prompt %d, %d decode steps, best of %d)\n", isa,
           prompt_len, gen, repeat);
    cJSON_Delete(arr);
  }
  free(bl);
  return 0;
}
