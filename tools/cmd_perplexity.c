/* pdctl perplexity --model DIR (--text-file F | --ids-file F) [--context N] [--stride N]
 *
 * Token-level perplexity as transformers' sliding-window recipe computes it: windows of
 * --context tokens starting every --stride tokens (the last one ends at the end of the text);
 * a window scores its last (end - previous end) tokens, never its first (which has no context);
 * perplexity = exp(total negative log-likelihood / tokens scored). Each window is a fresh
 * forward pass (no cache shared between windows), in chunks of at most --max-batch-tokens rows.
 * --ids-file takes token ids (a JSON array, or an object with an "ids" array, as
 * ../shared/quant/eval_ids.json); --text-file tokenizes a text with the model's tokenizer (BOS
 * added where the model uses one). */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/runtime.h"
#include "pdctl.h"

/* log-softmax of row at index t, in double */
static double token_nll(const float *row, int V, int32_t t) {
  float mx = row[0];
  for (int v = 1; v < V; v++)
    if (row[v] > mx) mx = row[v];
  double s = 0;
  for (int v = 0; v < V; v++) s += exp((double)row[v] - mx);
  return -((double)row[t] - mx - log(s));
}

static int32_t *read_ids(const char *path, size_t *n, pd_err *e) {
  size_t len = 0;
  char *text = pdctl_read_file(path, &len);
  if (!text) {
    pd_err_set(e, PD_EIO, "cannot read %s", path);
    return NULL;
  }
  cJSON *j = cJSON_ParseWithLength(text, len);
  free(text);
  const cJSON *a = cJSON_IsObject(j) ? cJSON_GetObjectItemCaseSensitive(j, "ids") : j;
  if (!cJSON_IsArray(a)) {
    cJSON_Delete(j);
    pd_err_set(e, PD_EFORMAT, "%s: expected a JSON array of token ids or an object with \"ids\"",
               path);
    return NULL;
  }
  const int m = cJSON_GetArraySize(a);
  int32_t *ids = malloc((size_t)(m > 0 ? m : 1) * sizeof *ids);
  if (!ids) {
    cJSON_Delete(j);
    pd_err_set(e, PD_ENOMEM, "out of memory");
    return NULL;
  }
  int k = 0;
  const cJSON *v;
  cJSON_ArrayForEach(v, a) {
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < 0 ||
        v->valuedouble > 2147483647.0) {
      free(ids);
      cJSON_Delete(j);
      pd_err_set(e, PD_EFORMAT, "%s: id %d is not a non-negative integer", path, k);
      return NULL;
    }
    ids[k++] = (int32_t)v->valuedouble;
  }
  cJSON_Delete(j);
  *n = (size_t)k;
  return ids;
}

int cmd_perplexity(int argc, char **argv) {
  pd_runtime_opts ro;
  pd_runtime_opts_default(&ro);
  const char *model = NULL, *text_file = NULL, *ids_file = NULL;
  int context = 0, stride = 0;
  bool json = false, help = false;
  pd_opt opts[64] = {
      {"model", PD_OPT_STR, &model, "DIR", "model folder", NULL},
      {"text-file", PD_OPT_STR, &text_file, "FILE", "the text to score (- = stdin)", NULL},
      {"ids-file", PD_OPT_STR, &ids_file, "FILE",
       "token ids to score: a JSON array, or an object with an \"ids\" array", NULL},
      {"context", PD_OPT_INT, &context, "N", "tokens per window (default: the model's context)",
       NULL},
      {"stride", PD_OPT_INT, &stride, "N", "tokens between window starts (default: --context)",
       NULL},
      {"json", PD_OPT_BOOL, &json, NULL, "print JSON", NULL},
      {"help", PD_OPT_BOOL, &help, NULL, "show this help", NULL},
  };
  int n0 = 0;
  while (opts[n0].name) n0++;
  if (pd_runtime_opts_table(&ro, opts + n0, 64 - n0) < 0) return pdctl_fail("option table");
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 2, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (help) {
    fputs("usage: pdctl perplexity --model DIR (--text-file F | --ids-file F) [--context N] "
          "[--stride N] [options]\n",
          stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  if (!model) return pdctl_fail("perplexity needs --model DIR");
  if (!!text_file + !!ids_file != 1) return pdctl_fail("give exactly one of --text-file, --ids-file");
  if (context < 0 || stride < 0) return pdctl_fail("--context and --stride must be positive");
  if (ro.speculative_model || ro.speculative_method)
    return pdctl_fail("perplexity scores the model alone: no speculative options");
  ro.model_dir = model;
  ro.no_prefix_cache = true;
  pd_model_config cfg;
  if (pd_model_config_load(model, &cfg, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  const int max_len = ro.max_model_len ? ro.max_model_len : cfg.max_position_embeddings;
  if (!context) context = max_len;
  if (context < 2 || context > max_len)
    return pdctl_fail("--context %d: must be in [2, %d] (the context length)", context, max_len);
  if (!stride) stride = context;
  if (stride > context) return pdctl_fail("--stride %d is longer than --context %d", stride, context);
  if (!ro.kv_cache_tokens) ro.kv_cache_tokens = context;
  pd_runtime rt;
  if (pd_runtime_open(&rt, &ro, NULL, NULL, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  size_t n = 0;
  int32_t *ids = NULL;
  if (ids_file) {
    ids = read_ids(ids_file, &n, &e);
  } else {
    size_t len = 0;
    char *text = pdctl_read_file(text_file, &len);
    if (!text) pd_err_set(&e, PD_EIO, "cannot read %s", text_file);
    else if (pd_tokenizer_encode(rt.tok, text, len, true, &ids, &n, &e) != PD_OK) ids = NULL;
    free(text);
  }
  if (!ids) {
    pd_runtime_close(&rt);
    return pdctl_fail("%s", e.msg);
  }
  const int V = rt.model->cfg.vocab_size;
  for (size_t i = 0; i < n; i++)
    if (ids[i] >= V) {
      const int32_t bad = ids[i];
      free(ids);
      pd_runtime_close(&rt);
      return pdctl_fail("token id %d (at %zu) is outside the vocabulary of %d", bad, i, V);
    }
  const pd_engine_opts *eo = pd_engine_get_opts(rt.eng);
  const int bs = eo->block_size, nb = (context + bs - 1) / bs;
  int chunk = eo->max_batch_tokens < 512 ? eo->max_batch_tokens : 512; /* logits rows at once */
  int32_t *bt = malloc((size_t)nb * sizeof *bt), *pos = malloc((size_t)chunk * sizeof *pos),
          *slots = malloc((size_t)chunk * sizeof *slots), *rows = malloc((size_t)chunk * sizeof *rows);
  float *logits = malloc((size_t)chunk * (size_t)V * sizeof *logits);
  if (!bt || !pos || !slots || !rows || !logits) {
    free(ids);
    pd_runtime_close(&rt);
    return pdctl_fail("out of memory");
  }
  for (int b = 0; b < nb; b++) bt[b] = b;
  for (int i = 0; i < chunk; i++) rows[i] = i;
  double nll = 0, t0 = pdctl_now();
  long long scored = 0, windows = 0;
  int rc = 0;
  size_t prev_end = 0;
  for (size_t begin = 0; begin < n && rc == 0; begin += (size_t)stride) {
    size_t end = begin + (size_t)context < n ? begin + (size_t)context : n;
    const int wl = (int)(end - begin);
    const int trg = (int)(end - prev_end);          /* tokens this window scores ... */
    const int first = wl - (trg < wl - 1 ? trg : wl - 1); /* ... from this position on */
    for (int off = 0; off < wl && rc == 0; off += chunk) {
      const int m = wl - off < chunk ? wl - off : chunk;
      for (int i = 0; i < m; i++) {
        pos[i] = off + i;
        slots[i] = bt[(off + i) / bs] * bs + (off + i) % bs;
      }
      int32_t qs[2] = {0, m}, ctx = off + m;
      pd_batch b = {.n_tokens = m, .tokens = ids + begin + off, .positions = pos,
                    .slots = slots, .n_seqs = 1, .q_start = qs, .ctx_len = &ctx,
                    .block_tables = bt, .max_blocks = (ctx + bs - 1) / bs, .n_logits = m,
                    .logit_rows = rows};
      if (pd_engine_forward(rt.eng, &b, logits, &e) != PD_OK) {
        rc = pdctl_fail("%s", e.msg);
        break;
      }
      /* row i predicts token off + i + 1 of the window */
      for (int i = 0; i < m; i++) {
        const int p = off + i + 1;
        if (p < first || p >= wl) continue;
        nll += token_nll(logits + (size_t)i * V, V, ids[begin + (size_t)p]);
        scored++;
      }
    }
    windows++;
    prev_end = end;
    if (end == n) break;
  }
  const double secs = pdctl_now() - t0;
  if (rc == 0 && scored == 0) rc = pdctl_fail("nothing to score: %zu tokens", n);
  if (rc == 0) {
    const double ppl = exp(nll / (double)scored);
    if (json) {
      cJSON *o = cJSON_CreateObject();
      cJSON_AddNumberToObject(o, "perplexity", ppl);
      cJSON_AddNumberToObject(o, "mean_nll", nll / (double)scored);
      cJSON_AddNumberToObject(o, "tokens_scored", (double)scored);
      cJSON_AddNumberToObject(o, "tokens", (double)n);
      cJSON_AddNumberToObject(o, "windows", (double)windows);
      cJSON_AddNumberToObject(o, "context", context);
      cJSON_AddNumberToObject(o, "stride", stride);
      cJSON_AddNumberToObject(o, "seconds", secs);
      char *s = cJSON_PrintUnformatted(o);
      puts(s);
      free(s);
      cJSON_Delete(o);
    } else {
      printf("perplexity %.4f (mean NLL %.6f) over %lld tokens: %lld windows of %d, stride %d "
             "(%.1f s, %s)\n",
             ppl, nll / (double)scored, scored, windows, context, stride, secs, rt.be->ops.name);
    }
  }
  free(ids);
  free(bt);
  free(pos);
  free(slots);
  free(rows);
  free(logits);
  pd_runtime_close(&rt);
  return rc;
}
