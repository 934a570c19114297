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
 * Best of --repeat runs. Prefix caching is off so repeated runs measure real work. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/runtime.h"
#include "pdctl.h"

typedef struct result {
  int batch;
  double prefill_tps, decode_tps, total_tps, step_ms, engine_ms;
  long long decode_steps; /* the decode steps behind decode_tps (its run's) */
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

static int run_one(pd_runtime_opts ro, int batch, int prompt_len, int gen, int repeat,
                   result *out, const char **isa) {
  counter cnt = {0};
  pd_runtime rt;
  pd_err e = {0};
  ro.max_seqs = batch;
  ro.no_prefix_cache = true;
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
    cnt.base = next_id;
    cnt.n_first = 0;
    memset(cnt.seen, 0, (size_t)batch);
    for (int s = 0; s < batch; s++) {
      for (int i = 0; i < prompt_len; i++) {
        seed = seed * 1103515245u + 12345u;
        prompt[i] = (int32_t)((seed >> 8) % (unsigned)V);
      }
      pd_sampling_params p;
      pd_sampling_params_init(&p);
      p.temperature = 0;
      p.max_tokens = gen;
      p.ignore_eos = true;
      if (pd_sched_add(rt.sched, next_id++, prompt, prompt_len, &p, &e) != PD_OK)
        return pdctl_fail("%s", e.msg);
    }
    cnt.generated = 0;
    double t0 = pdctl_now(), t1 = 0, full_time = 0, full_engine = 0;
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
      if (!t1 && cnt.n_first == batch) t1 = pdctl_now(); /* every request has its first token */
    }
    double t2 = pdctl_now();
    double p = (double)batch * prompt_len / (t1 - t0);
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
  }
  free(prompt);
  free(cnt.seen);
  pd_runtime_close(&rt);
  return 0;
}

int cmd_bench_model(int argc, char **argv) {
  pd_runtime_opts ro;
  pd_runtime_opts_default(&ro);
  ro.kv_cache_tokens = 0;
  const char *model = NULL, *batches = "1";
  int prompt_len = 512, gen = 128, repeat = 3;
  bool json = false, help = false;
  pd_opt opts[64] = {
      {"model", PD_OPT_STR, &model, "DIR", "model folder", NULL},
      {"batch", PD_OPT_STR, &batches, "B[,B...]", "concurrent sequences (default 1)", NULL},
      {"prompt-len", PD_OPT_INT, &prompt_len, "N", "prompt tokens per sequence (512)", NULL},
      {"decode-tokens", PD_OPT_INT, &gen, "N", "tokens generated per sequence (128)", NULL},
      {"repeat", PD_OPT_INT, &repeat, "N", "runs; the best is reported (3)", NULL},
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
  cJSON *arr = cJSON_CreateArray();
  const char *isa = "?";
  if (!json)
    printf("%8s %15s %15s %15s %10s %10s %7s\n", "batch", "prefill tok/s", "decode tok/s",
           "total tok/s", "ms/step", "engine ms", "steps");
  for (size_t i = 0; i < nb; i++) {
    if (bl[i] < 1) return pdctl_fail("--batch values must be positive");
    result res;
    if (run_one(ro, bl[i], prompt_len, gen, repeat, &res, &isa)) return 1;
    if (json) {
      cJSON *o = cJSON_CreateObject();
      cJSON_AddNumberToObject(o, "batch", res.batch);
      cJSON_AddNumberToObject(o, "prefill_tokens_per_s", res.prefill_tps);
      cJSON_AddNumberToObject(o, "decode_tokens_per_s", res.decode_tps);
      cJSON_AddNumberToObject(o, "total_tokens_per_s", res.total_tps);
      cJSON_AddNumberToObject(o, "decode_ms_per_step", res.step_ms);
      cJSON_AddNumberToObject(o, "decode_engine_ms_per_step", res.engine_ms);
      cJSON_AddNumberToObject(o, "decode_steps", (double)res.decode_steps);
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
    cJSON_Delete(arr);
  }
  free(bl);
  return 0;
}
