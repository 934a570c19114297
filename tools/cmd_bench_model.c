/* pdctl bench-model: throughput of a model on this machine, through the real scheduler.
 *
 * For each concurrency B: B requests with random prompts of --prompt-len tokens and
 * --decode-tokens outputs (ignore_eos) are queued at once with --max-seqs B. Reported:
 *   prefill tok/s: B * prompt_len / (time until every request has its first token)
 *   decode tok/s:  over the steps in which every one of the B sequences decoded a token (pure
 *                  decode at concurrency B): their tokens / their time; 0 when no step had all
 *                  B decoding (raise --decode-tokens so decodes outlast the staggered prefill).
 *                  A step in which a sequence got its first token ran that prompt's last prefill
 *                  chunk too: not a decode step, even where the others all decoded
 *   total tok/s:   all generated tokens / the whole run (offline throughput)
 *   steps:         the decode steps counted (in the run whose decode tok/s is reported)
 * Best of --repeat runs. Prefix caching is off so repeated runs measure real work.
 *
 * With speculative options (--speculative-model, --speculative-method) every batch runs twice,
 * without and with speculation, and a second table compares them: output tok/s after the last
 * prefill (tokens generated once every request had its first token, over the time from then to
 * the end), the speedup, the acceptance rate and the tokens per verification. Random prompts
 * make acceptance low: --prompt-file takes the prompts from a file instead (JSON Lines, one
 * prompt text per line; sequence s gets line s mod the number of lines; --prompt-len is then
 * unused).
 *
 * --spec-cost K (with --speculative-model DIR; random weights are fine): the cost model of
 * speculation instead, at the engine level: for each batch B, the median time of a forward of
 * the model over B sequences of --prompt-len context with 1 token each (a decode step) and with
 * k + 1 tokens each (a verification, k = 1..K, every row's logits to the host), and the draft's
 * one-token step; then the speedup they predict at acceptance 0.6, 0.7 and 0.8 for the best k:
 * (1 + a + .. + a^k) * decode / (verify(k) + k * draft). */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/runtime.h"
#include "pdctl.h"

typedef struct result {
  int batch;
  double prefill_tps, decode_tps, total_tps, step_ms, engine_ms;
  long long decode_steps; /* the decode steps behind decode_tps (its run's) */
  double gen_tps;          /* tokens generated after the last first token / the time since */
  pd_sched_stats ss;       /* the scheduler's counters over all runs */
} result;

typedef struct counter {
  uint64_t generated;
  uint64_t base;     /* id of this run's first request */
  int n_first;       /* requests that have their first token */
  unsigned char *seen; /* [batch] */
} counter;

static void on_event(void *user, const pd_sched_event *ev) {
  counter *c = user;
  if (ev->token < 0) return;
  c->generated++;
  if (!c->seen[ev->id - c->base]) {
    c->seen[ev->id - c->base] = 1;
    c->n_first++;
  }
}

typedef struct prompts {
  int32_t **ids;
  int *len;
  int n;
} prompts;

static int run_one(pd_runtime_opts ro, int batch, int prompt_len, int gen, int repeat,
                   const prompts *pf, result *out, const char **isa) {
  counter cnt = {0};
  pd_runtime rt;
  pd_err e = {0};
  ro.max_seqs = batch;
  ro.no_prefix_cache = true;
  if (pf)
    for (int i = 0; i < pf->n; i++)
      if (pf->len[i] > prompt_len) prompt_len = pf->len[i];
  if (!ro.kv_cache_tokens) ro.kv_cache_tokens = batch * (prompt_len + gen + 16);
  if (pd_runtime_open(&rt, &ro, on_event, &cnt, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  *isa = strcmp(rt.be->ops.name, "cpu") == 0 ? pd_backend_cpu_isa(rt.be) : rt.be->ops.name;
  int V = rt.model->cfg.vocab_size;
  int32_t *prompt = malloc((size_t)prompt_len * sizeof *prompt);
  cnt.seen = calloc((size_t)batch, 1);
  if (!prompt || !cnt.seen) return pdctl_fail("out of memory");
  unsigned seed = 12345;
  memset(out, 0, sizeof *out);
  out->batch = batch;
  uint64_t next_id = 0;
  for (int rep = 0; rep < repeat; rep++) {
    long long prompt_tokens = 0;
    cnt.base = next_id;
    cnt.n_first = 0;
    memset(cnt.seen, 0, (size_t)batch);
    for (int s = 0; s < batch; s++) {
      int n_prompt = prompt_len;
      if (pf) {
        n_prompt = pf->len[s % pf->n];
        memcpy(prompt, pf->ids[s % pf->n], (size_t)n_prompt * sizeof *prompt);
      }
      for (int i = 0; !pf && i < prompt_len; i++) {
        seed = seed * 1103515245u + 12345u;
        prompt[i] = (int32_t)((seed >> 8) % (unsigned)V);
      }
      pd_sampling_params p;
      pd_sampling_params_init(&p);
      p.temperature = 0;
      p.max_tokens = gen;
      p.ignore_eos = true;
      prompt_tokens += n_prompt;
      if (pd_sched_add(rt.sched, next_id++, prompt, n_prompt, &p, &e) != PD_OK)
        return pdctl_fail("%s", e.msg);
    }
    cnt.generated = 0;
    double t0 = pdctl_now(), t1 = 0, full_time = 0, full_engine = 0;
    uint64_t gen_t1 = 0;
    uint64_t full_tokens = 0, full_steps = 0;
    while (pd_sched_has_work(rt.sched)) {
      uint64_t before = cnt.generated;
      const int firsts = cnt.n_first;
      double ts = pdctl_now(), fs = pd_engine_forward_seconds(rt.eng);
      if (pd_sched_step(rt.sched, &e) != PD_OK) return pdctl_fail("%s", e.msg);
      /* all B decoded in this step, and none of them got its first token (from a prefill) */
      if (cnt.generated - before == (uint64_t)batch && cnt.n_first == firsts) {
        full_time += pdctl_now() - ts;
        full_engine += pd_engine_forward_seconds(rt.eng) - fs;
        full_tokens += (uint64_t)batch;
        full_steps++;
      }
      if (!t1 && cnt.n_first == batch) { /* every request has its first token */
        t1 = pdctl_now();
        gen_t1 = cnt.generated;
      }
    }
    double t2 = pdctl_now();
    double p = (double)prompt_tokens / (t1 - t0);
    double d = full_time > 0 ? (double)full_tokens / full_time : 0;
    double tot = (double)cnt.generated / (t2 - t0);
    if (p > out->prefill_tps) out->prefill_tps = p;
    if (d > out->decode_tps) {
      out->decode_tps = d;
      out->step_ms = 1e3 * full_time / (double)full_steps;
      out->engine_ms = 1e3 * full_engine / (double)full_steps;
      out->decode_steps = (long long)full_steps;
    }
    if (tot > out->total_tps) out->total_tps = tot;
    double g = t2 > t1 ? (double)(cnt.generated - gen_t1) / (t2 - t1) : 0;
    if (g > out->gen_tps) out->gen_tps = g;
  }
  pd_sched_get_stats(rt.sched, &out->ss);
  free(prompt);
  free(cnt.seen);
  pd_runtime_close(&rt);
  return 0;
}

static double median(double *v, int n) {
  for (int i = 1; i < n; i++)
    for (int j = i; j > 0 && v[j] < v[j - 1]; j--) {
      double t = v[j];
      v[j] = v[j - 1];
      v[j - 1] = t;
    }
  return v[n / 2];
}

/* Median seconds of a forward of B sequences x T tokens at context C (KV garbage: timing). */
static int time_forward(pd_engine *eng, int B, int T, int C, int bs, double *out) {
  int nb = (C + T + bs - 1) / bs, nt = B * T;
  int32_t *tok = calloc((size_t)nt, sizeof *tok), *pos = malloc((size_t)nt * sizeof *pos),
          *slot = malloc((size_t)nt * sizeof *slot), *qs = malloc((size_t)(B + 1) * sizeof *qs),
          *ctx = malloc((size_t)B * sizeof *ctx), *bt = malloc((size_t)B * nb * sizeof *bt),
          *rows = malloc((size_t)nt * sizeof *rows);
  float *logits = malloc((size_t)nt * (size_t)pd_engine_config(eng)->vocab_size * sizeof *logits);
  pd_dev_sample_spec *sp = NULL;
  pd_dev_sample_out *so = NULL;
  int rc = 0;
  if (!tok || !pos || !slot || !qs || !ctx || !bt || !rows || !logits) {
    rc = pdctl_fail("out of memory");
    goto out;
  }
  for (int b = 0; b < B; b++) {
    qs[b] = b * T;
    ctx[b] = C + T;
    for (int i = 0; i < nb; i++) bt[(size_t)b * nb + i] = b * nb + i;
    for (int t = 0; t < T; t++) {
      int p = C + t, i = b * T + t;
      tok[i] = (b * 31 + t * 7) % 1000 + 10;
      pos[i] = p;
      slot[i] = (b * nb + p / bs) * bs + p % bs;
      rows[i] = i;
    }
  }
  qs[B] = nt;
  pd_batch bat = {.n_tokens = nt, .tokens = tok, .positions = pos, .slots = slot, .n_seqs = B,
                  .q_start = qs, .ctx_len = ctx, .block_tables = bt, .max_blocks = nb,
                  .n_logits = nt, .logit_rows = rows};
  /* every row's logits; where the engine samples on the device, every row's argmax there (as
   * greedy verification does), else every row to the host (as the host sampler needs) */
  if (pd_engine_can_sample(eng)) {
    sp = calloc((size_t)nt, sizeof *sp);
    so = calloc((size_t)nt, sizeof *so);
    if (!sp || !so) {
      rc = pdctl_fail("out of memory");
      goto out;
    }
    for (int i = 0; i < nt; i++) {
      sp[i].top_p = 1;
      sp[i].rep_penalty = 1;
      sp[i].n_top = -1;
    }
    bat.n_sample = nt;
    bat.sample = sp;
    bat.sample_out = so;
  }
  double v[9];
  pd_err e = {0};
  for (int r = -2; r < 9; r++) {
    double t0 = pdctl_now();
    if (pd_engine_forward(eng, &bat, logits, &e) != PD_OK) {
      rc = pdctl_fail("%s", e.msg);
      goto out;
    }
    if (r >= 0) v[r] = pdctl_now() - t0;
  }
  *out = median(v, 9);
out:
  free(tok);
  free(pos);
  free(slot);
  free(qs);
  free(ctx);
  free(bt);
  free(rows);
  free(logits);
  free(sp);
  free(so);
  return rc;
}

static int spec_cost(pd_runtime_opts ro, const int32_t *bl, size_t nb, int C, int K) {
  int maxb = 0;
  for (size_t i = 0; i < nb; i++)
    if (bl[i] > maxb) maxb = bl[i];
  ro.max_seqs = maxb;
  ro.no_prefix_cache = true;
  ro.speculative_adaptive = "off";
  if (ro.max_batch_tokens < maxb * (K + 1)) ro.max_batch_tokens = maxb * (K + 1);
  int nblk = (C + K + 2 + ro.block_size - 1) / ro.block_size;
  if (!ro.kv_cache_tokens) ro.kv_cache_tokens = maxb * nblk * ro.block_size;
  pd_runtime rt;
  pd_err e = {0};
  if (pd_runtime_open(&rt, &ro, NULL, NULL, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (!rt.draft_eng) {
    pd_runtime_close(&rt);
    return pdctl_fail("--spec-cost needs --speculative-model DIR (the draft's shape)");
  }
  printf("speculation cost model: context %d, k up to %d (%s); ms per forward\n", C, K,
         rt.be->ops.name);
  printf("%6s %9s %9s", "batch", "decode", "draft");
  for (int k = 1; k <= K; k++) printf("  verify%-2d", k);
  printf(" %14s %14s %14s\n", "speedup a=0.6", "a=0.7", "a=0.8");
  int rc = 0;
  for (size_t i = 0; i < nb && !rc; i++) {
    int B = bl[i];
    double t1 = 0, td = 0, tv[PD_SPEC_MAX_K + 1] = {0};
    rc = time_forward(rt.eng, B, 1, C, ro.block_size, &t1);
    if (!rc) rc = time_forward(rt.draft_eng, B, 1, C, ro.block_size, &td);
    for (int k = 1; k <= K && !rc; k++) rc = time_forward(rt.eng, B, k + 1, C, ro.block_size, &tv[k]);
    if (rc) break;
    printf("%6d %9.3f %9.3f", B, t1 * 1e3, td * 1e3);
    for (int k = 1; k <= K; k++) printf(" %9.3f", tv[k] * 1e3);
    const double as[3] = {0.6, 0.7, 0.8};
    for (int a = 0; a < 3; a++) {
      double best = 1;
      int best_k = 0;
      for (int k = 1; k <= K; k++) {
        double emitted = 0, p = 1;
        for (int j = 0; j <= k; j++, p *= as[a]) emitted += p;
        double sp = emitted * t1 / (tv[k] + k * td);
        if (sp > best) {
          best = sp;
          best_k = k;
        }
      }
      printf("   %6.2fx (k %d)", best, best_k);
    }
    printf("\n");
    fflush(stdout);
  }
  pd_runtime_close(&rt);
  return rc;
}

int cmd_bench_model(int argc, char **argv) {
  pd_runtime_opts ro;
  pd_runtime_opts_default(&ro);
  ro.kv_cache_tokens = 0;
  const char *model = NULL, *batches = "1", *prompt_file = NULL;
  int prompt_len = 512, gen = 128, repeat = 3, spec_k = 0;
  bool json = false, help = false;
  pd_opt opts[64] = {
      {"model", PD_OPT_STR, &model, "DIR", "model folder", NULL},
      {"batch", PD_OPT_STR, &batches, "B[,B...]", "concurrent sequences (default 1)", NULL},
      {"prompt-len", PD_OPT_INT, &prompt_len, "N", "prompt tokens per sequence (512)", NULL},
      {"decode-tokens", PD_OPT_INT, &gen, "N", "tokens generated per sequence (128)", NULL},
      {"repeat", PD_OPT_INT, &repeat, "N", "runs; the best is reported (3)", NULL},
      {"spec-cost", PD_OPT_INT, &spec_k, "K",
       "the cost model of speculation (engine forward times, with --speculative-model) "
       "instead of the runs", NULL},
      {"prompt-file", PD_OPT_STR, &prompt_file, "FILE",
       "prompts from this file (JSON Lines of prompt texts) instead of random ids", NULL},
      {"json", PD_OPT_BOOL, &json, NULL, "print JSON", NULL},
      {"help", PD_OPT_BOOL, &help, NULL, "show this help", NULL},
  };
  int n0 = 0;
  while (opts[n0].name) n0++;
  if (pd_runtime_opts_table(&ro, opts + n0, 64 - n0) < 0) return pdctl_fail("option table");
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 2, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (help) {
    fputs("usage: pdctl bench-model --model DIR [options]\n", stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  if (!model) return pdctl_fail("bench-model needs --model DIR");
  if (prompt_len < 1 || gen < 2 || repeat < 1)
    return pdctl_fail("--prompt-len and --repeat must be positive, --decode-tokens at least 2");
  ro.model_dir = model;
  size_t nb = 0;
  int32_t *bl = pdctl_parse_ids(batches, &nb, &e);
  if (!bl || nb == 0) return pdctl_fail("--batch: %s", bl ? "empty list" : e.msg);
  pd_spec_config spec;
  if (pd_runtime_spec_config(&ro, &spec, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (spec_k) {
    if (spec_k < 1 || spec_k > PD_SPEC_MAX_K)
      return pdctl_fail("--spec-cost must be in [1, %d]", PD_SPEC_MAX_K);
    int rc = spec_cost(ro, bl, nb, prompt_len, spec_k);
    free(bl);
    return rc;
  }
  prompts pf = {0};
  if (prompt_file) {
    FILE *f = fopen(prompt_file, "r");
    if (!f) return pdctl_fail("--prompt-file %s: %s", prompt_file, strerror(errno));
    pd_tokenizer *tok = pd_tokenizer_load(model, &e);
    if (!tok) return pdctl_fail("%s", e.msg);
    char *line = NULL;
    size_t cap = 0;
    int lineno = 0;
    while (getline(&line, &cap, f) > 0) {
      lineno++;
      cJSON *j = cJSON_Parse(line);
      size_t n = 0;
      int32_t *ids = NULL;
      if (!cJSON_IsString(j) ||
          pd_tokenizer_encode(tok, j->valuestring, strlen(j->valuestring), false, &ids, &n, &e) !=
              PD_OK ||
          n == 0) {
        cJSON_Delete(j);
        return pdctl_fail("--prompt-file %s:%d: expected a JSON string of a non-empty prompt",
                          prompt_file, lineno);
      }
      cJSON_Delete(j);
      pf.ids = realloc(pf.ids, (size_t)(pf.n + 1) * sizeof *pf.ids);
      pf.len = realloc(pf.len, (size_t)(pf.n + 1) * sizeof *pf.len);
      if (!pf.ids || !pf.len) return pdctl_fail("out of memory");
      pf.ids[pf.n] = ids;
      pf.len[pf.n++] = (int)n;
    }
    free(line);
    fclose(f);
    pd_tokenizer_free(tok);
    if (!pf.n) return pdctl_fail("--prompt-file %s: no prompts", prompt_file);
  }
  pd_runtime_opts plain = ro;
  plain.speculative_model = NULL;
  plain.speculative_method = "none";
  result *spec_res = calloc(nb, sizeof *spec_res), *plain_res = calloc(nb, sizeof *plain_res);
  if (!spec_res || !plain_res) return pdctl_fail("out of memory");
  cJSON *arr = cJSON_CreateArray();
  const char *isa = "?";
  if (!json)
    printf("%8s %15s %15s %15s %10s %10s %7s\n", "batch", "prefill tok/s", "decode tok/s",
           "total tok/s", "ms/step", "engine ms", "steps");
  for (size_t i = 0; i < nb; i++) {
    if (bl[i] < 1) return pdctl_fail("--batch values must be positive");
    result res;
    if (run_one(spec.method != PD_SPEC_NONE ? plain : ro, bl[i], prompt_len, gen, repeat, pf.n ? &pf : NULL,
                &res, &isa))
      return 1;
    plain_res[i] = res;
    if (spec.method != PD_SPEC_NONE &&
        run_one(ro, bl[i], prompt_len, gen, repeat, pf.n ? &pf : NULL, &spec_res[i], &isa))
      return 1;
    if (json) {
      cJSON *o = cJSON_CreateObject();
      cJSON_AddNumberToObject(o, "batch", res.batch);
      cJSON_AddNumberToObject(o, "prefill_tokens_per_s", res.prefill_tps);
      cJSON_AddNumberToObject(o, "decode_tokens_per_s", res.decode_tps);
      cJSON_AddNumberToObject(o, "total_tokens_per_s", res.total_tps);
      cJSON_AddNumberToObject(o, "decode_ms_per_step", res.step_ms);
      cJSON_AddNumberToObject(o, "decode_engine_ms_per_step", res.engine_ms);
      cJSON_AddNumberToObject(o, "decode_steps", (double)res.decode_steps);
      cJSON_AddNumberToObject(o, "output_tokens_per_s_after_prefill", res.gen_tps);
      if (spec.method != PD_SPEC_NONE) {
        const pd_sched_stats *ss = &spec_res[i].ss;
        cJSON *sp = cJSON_AddObjectToObject(o, "speculative");
        cJSON_AddNumberToObject(sp, "output_tokens_per_s_after_prefill", spec_res[i].gen_tps);
        cJSON_AddNumberToObject(sp, "speedup", res.gen_tps > 0 ? spec_res[i].gen_tps / res.gen_tps : 0);
        cJSON_AddNumberToObject(sp, "proposed", (double)ss->spec_proposed);
        cJSON_AddNumberToObject(sp, "accepted", (double)ss->spec_accepted);
        cJSON_AddNumberToObject(sp, "verifications", (double)ss->spec_verified);
        cJSON_AddNumberToObject(sp, "total_tokens_per_s", spec_res[i].total_tps);
      }
      cJSON_AddItemToArray(arr, o);
    } else {
      printf("%8d %15.0f %15.0f %15.0f %10.3f %10.3f %7lld\n", res.batch, res.prefill_tps,
             res.decode_tps, res.total_tps, res.step_ms, res.engine_ms, res.decode_steps);
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
    printf("(%s backend, %s kernels, %d threads, prompt %d, %d generated per sequence, best "
           "of %d)\n",
           ro.device, isa, ro.threads, prompt_len, gen, repeat);
    if (spec.method != PD_SPEC_NONE) {
      printf("\nspeculative decoding (%s, k %d, adaptive %s): output tok/s after the last "
             "prefill, without and with it, one run each, same prompts\n",
             pd_spec_method_name(spec.method), spec.num_tokens, spec.fixed ? "off" : "on");
      printf("%8s %12s %12s %8s %10s %12s %12s\n", "batch", "plain", "speculative", "speedup",
             "accepted", "tokens/ver.", "verif. share");
      for (size_t i = 0; i < nb; i++) {
        const pd_sched_stats *ss = &spec_res[i].ss;
        double emitted = 0;
        for (int j = 0; j < PD_SPEC_MAX_K + 2; j++) emitted += (double)j * ss->spec_emitted_hist[j];
        printf("%8d %12.0f %12.0f %7.2fx %9.1f%% %12.2f %11.1f%%\n", bl[i], plain_res[i].gen_tps,
               spec_res[i].gen_tps,
               plain_res[i].gen_tps > 0 ? spec_res[i].gen_tps / plain_res[i].gen_tps : 0,
               ss->spec_proposed ? 100.0 * ss->spec_accepted / ss->spec_proposed : 0,
               ss->spec_verified ? emitted / ss->spec_verified : 0,
               ss->generated_tokens ? 100.0 * emitted / ss->generated_tokens : 0);
      }
    }
    cJSON_Delete(arr);
  }
  free(bl);
  for (int i = 0; i < pf.n; i++) free(pf.ids[i]);
  free(pf.ids);
  free(pf.len);
  free(spec_res);
  free(plain_res);
  return 0;
}
