/* pdctl generate: text from a model on this machine, one prompt.
 *   pdctl generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3 | --chat TEXT)
 *                  [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
 *                  [--ignore-eos] [--json] [--dump-logits FILE] [engine options]
 * --prompt adds no special tokens; --chat applies the model's chat template. Text streams to
 * stdout as it is generated unless --json, which prints one object at the end. The prompt runs
 * through the same runtime (engine, KV pool, scheduler) as batch mode and the nodes, with the
 * same engine options (--device, --kv-cache-dtype, --enforce-eager, ...). */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/runtime.h"
#include "pd/sample.h"
#include "pdctl.h"

typedef struct gen_args {
  const char *model, *prompt, *prompt_ids, *chat, *dump_logits;
  int max_tokens, top_k;
  double temperature, top_p, min_p;
  unsigned long long seed;
  bool seed_set, ignore_eos, json, help;
} gen_args;

/* What the one request produced, filled by the scheduler's events. */
typedef struct gen_out {
  pd_detok *dt;
  bool json;
  int32_t *ids;
  size_t n, cap;
  char *text; /* --json: the decoded text */
  size_t text_len, text_cap;
  bool done, failed;
  char err[PD_ERR_MSG_MAX];
} gen_out;

static bool append_text(gen_out *g, const char *piece, size_t len) {
  if (g->text_len + len + 1 > g->text_cap) {
    size_t cap = 2 * (g->text_len + len + 1);
    char *t = realloc(g->text, cap);
    if (!t) return false;
    g->text = t;
    g->text_cap = cap;
  }
  memcpy(g->text + g->text_len, piece, len);
  g->text_len += len;
  g->text[g->text_len] = 0;
  return true;
}

/* Each new token: kept, decoded incrementally and printed (or kept for --json). */
static void on_event(void *user, const pd_sched_event *ev) {
  gen_out *g = user;
  if (ev->token >= 0 && !g->failed) {
    if (g->n == g->cap) {
      size_t cap = g->cap ? 2 * g->cap : 256;
      int32_t *t = realloc(g->ids, cap * sizeof *t);
      if (!t) {
        g->failed = true;
        snprintf(g->err, sizeof g->err, "out of memory");
        return;
      }
      g->ids = t;
      g->cap = cap;
    }
    g->ids[g->n++] = ev->token;
    const char *piece;
    size_t plen;
    pd_err e = {0};
    if (pd_detok_push(g->dt, ev->token, &piece, &plen, &e) != PD_OK) {
      g->failed = true;
      snprintf(g->err, sizeof g->err, "%s", e.msg);
    } else if (plen && g->json) {
      if (!append_text(g, piece, plen)) {
        g->failed = true;
        snprintf(g->err, sizeof g->err, "out of memory");
      }
    } else if (plen) {
      fwrite(piece, 1, plen, stdout);
      fflush(stdout);
    }
  }
  if (ev->finish != PD_FINISH_NONE) g->done = true;
}

static int dump_logits(const char *path, const float *logits, int V) {
  FILE *f = fopen(path, "wb");
  if (!f) return pdctl_fail("cannot write %s", path);
  /* little-endian float32: the host order on every platform pdserve builds for */
  size_t w = fwrite(logits, sizeof(float), (size_t)V, f);
  if (fclose(f) != 0 || w != (size_t)V) return pdctl_fail("cannot write %s", path);
  return 0;
}

/* --dump-logits: the prompt through the engine once on its own, for the last position's logits
 * (its KV goes to the pool's first blocks, which the scheduler has not handed out yet and
 * overwrites when it does). */
static int prompt_logits(pd_runtime *rt, const int32_t *ids, int n, const char *path,
                         pd_err *e) {
  const pd_engine_opts *eo = pd_engine_get_opts(rt->eng);
  const int V = pd_engine_config(rt->eng)->vocab_size;
  const int bs = eo->block_size, nb = (n + bs - 1) / bs, chunk = eo->max_batch_tokens;
  if (nb > eo->num_blocks) return pdctl_fail("the prompt does not fit the KV cache");
  int32_t *bt = malloc((size_t)nb * sizeof *bt), *pos = malloc((size_t)chunk * sizeof *pos),
          *slots = malloc((size_t)chunk * sizeof *slots);
  float *logits = malloc((size_t)V * sizeof *logits);
  int rc = 0;
  if (!bt || !pos || !slots || !logits) rc = pdctl_fail("out of memory");
  for (int i = 0; !rc && i < nb; i++) bt[i] = i;
  for (int off = 0; !rc && off < n; off += chunk) {
    const int m = n - off < chunk ? n - off : chunk;
    for (int i = 0; i < m; i++) {
      pos[i] = off + i;
      slots[i] = bt[(off + i) / bs] * bs + (off + i) % bs;
    }
    int32_t qs[2] = {0, m}, ctx = off + m, row = m - 1;
    pd_batch b = {.n_tokens = m, .tokens = ids + off, .positions = pos, .slots = slots,
                  .n_seqs = 1, .q_start = qs, .ctx_len = &ctx, .block_tables = bt,
                  .max_blocks = nb, .n_logits = 1, .logit_rows = &row};
    if (pd_engine_forward(rt->eng, &b, logits, e) != PD_OK) rc = pdctl_fail("%s", e->msg);
  }
  if (!rc) rc = dump_logits(path, logits, V);
  free(bt);
  free(pos);
  free(slots);
  free(logits);
  return rc;
}

int cmd_generate(int argc, char **argv) {
  for (int i = 2; i < argc; i++)
    if (!strcmp(argv[i], "--input") || !strncmp(argv[i], "--input=", 8))
      return cmd_generate_batch(argc, argv);
  gen_args a = {.max_tokens = 256, .temperature = 1.0, .top_p = 1.0, .top_k = 0};
  pd_runtime_opts ro;
  pd_runtime_opts_default(&ro);
  pd_opt opts[64] = {
      {"model", PD_OPT_STR, &a.model, "DIR", "Hugging Face model folder", NULL},
      {"prompt", PD_OPT_STR, &a.prompt, "TEXT", "prompt text (no special tokens added)", NULL},
      {"prompt-ids", PD_OPT_STR, &a.prompt_ids, "IDS", "prompt as comma-separated token ids",
       NULL},
      {"chat", PD_OPT_STR, &a.chat, "TEXT", "a user message, through the chat template", NULL},
      {"max-tokens", PD_OPT_INT, &a.max_tokens, "N", "tokens to generate (256)", NULL},
      {"temperature", PD_OPT_DOUBLE, &a.temperature, "T", "0 = greedy (1.0)", NULL},
      {"top-p", PD_OPT_DOUBLE, &a.top_p, "P", "nucleus sampling (1.0 = off)", NULL},
      {"top-k", PD_OPT_INT, &a.top_k, "K", "top-k sampling (0 = off)", NULL},
      {"min-p", PD_OPT_DOUBLE, &a.min_p, "P", "min-p sampling (0 = off)", NULL},
      {"seed", PD_OPT_U64, &a.seed, "S", "random seed", &a.seed_set},
      {"ignore-eos", PD_OPT_BOOL, &a.ignore_eos, NULL, "do not stop at end of text", NULL},
      {"json", PD_OPT_BOOL, &a.json, NULL, "print {input_ids, output_ids, text}", NULL},
      {"dump-logits", PD_OPT_STR, &a.dump_logits, "FILE",
       "write the last prompt position's logits (float32 LE)", NULL},
      {"help", PD_OPT_BOOL, &a.help, NULL, "show this help", NULL},
  };
  int n0 = 0;
  while (opts[n0].name) n0++;
  if (pd_runtime_opts_table(&ro, opts + n0, 64 - n0) < 0) return pdctl_fail("option table");
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 2, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (a.help) {
    fputs("usage: pdctl generate --model DIR (--prompt TEXT | --prompt-ids IDS | --chat TEXT) "
          "[options]\n",
          stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  if (!a.model) return pdctl_fail("generate needs --model DIR");
  if (!!a.prompt + !!a.prompt_ids + !!a.chat != 1)
    return pdctl_fail("give exactly one of --prompt, --prompt-ids, --chat");
  if (a.max_tokens < 1) return pdctl_fail("--max-tokens must be at least 1");

  pd_sampling_params sp;
  pd_sampling_params_init(&sp);
  sp.temperature = (float)a.temperature;
  sp.top_p = (float)a.top_p;
  sp.top_k = a.top_k;
  sp.min_p = (float)a.min_p;
  sp.max_tokens = a.max_tokens;
  sp.ignore_eos = a.ignore_eos;
  if (a.seed_set) {
    sp.seed = (uint64_t)a.seed;
    sp.has_seed = true;
  }

  ro.model_dir = a.model;
  gen_out g = {.json = a.json};
  pd_runtime rt;
  if (pd_runtime_open(&rt, &ro, on_event, &g, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  int32_t *ids = NULL;
  size_t n_ids = 0;
  int rc = 0;
  if (a.prompt_ids) {
    ids = pdctl_parse_ids(a.prompt_ids, &n_ids, &e);
  } else if (a.prompt) {
    if (pd_tokenizer_encode(rt.tok, a.prompt, strlen(a.prompt), false, &ids, &n_ids, &e) != PD_OK)
      ids = NULL;
  } else {
    pd_chat_msg msg = {"user", a.chat};
    char *text = NULL;
    if (pd_tokenizer_apply_chat(rt.tok, &msg, 1, true, &text, &e) == PD_OK) {
      if (pd_tokenizer_encode(rt.tok, text, strlen(text), false, &ids, &n_ids, &e) != PD_OK)
        ids = NULL;
      free(text);
    }
  }
  if (!ids) {
    rc = pdctl_fail("%s", e.msg);
    goto out;
  }
  if (n_ids == 0) {
    rc = pdctl_fail("the prompt is empty");
    goto out;
  }
  if (a.dump_logits && (rc = prompt_logits(&rt, ids, (int)n_ids, a.dump_logits, &e)) != 0)
    goto out;
  g.dt = pd_detok_new(rt.tok, true);
  if (!g.dt) {
    rc = pdctl_fail("out of memory");
    goto out;
  }
  /* the scheduler checks the ids against the vocabulary and the length against the context */
  if (pd_sched_add(rt.sched, 0, ids, (int)n_ids, &sp, &e) != PD_OK) {
    rc = pdctl_fail("%s", e.msg);
    goto out;
  }
  while (!g.done && !g.failed && pd_sched_has_work(rt.sched)) {
    if (pd_sched_step(rt.sched, &e) != PD_OK) {
      rc = pdctl_fail("%s", e.msg);
      goto out;
    }
  }
  if (g.failed) {
    rc = pdctl_fail("%s", g.err);
    goto out;
  }
  {
    const char *piece;
    size_t plen;
    if (pd_detok_flush(g.dt, &piece, &plen, &e) == PD_OK && plen) {
      if (a.json) append_text(&g, piece, plen);
      else fwrite(piece, 1, plen, stdout);
    }
  }
  if (a.json) {
    cJSON *o = cJSON_CreateObject();
    cJSON *in = cJSON_AddArrayToObject(o, "input_ids"), *outa = cJSON_AddArrayToObject(o, "output_ids");
    for (size_t i = 0; i < n_ids; i++) cJSON_AddItemToArray(in, cJSON_CreateNumber(ids[i]));
    for (size_t i = 0; i < g.n; i++) cJSON_AddItemToArray(outa, cJSON_CreateNumber(g.ids[i]));
    cJSON_AddStringToObject(o, "text", g.text ? g.text : "");
    char *s = cJSON_PrintUnformatted(o);
    puts(s);
    free(s);
    cJSON_Delete(o);
  } else {
    putchar('\n');
  }
out:
  pd_detok_free(g.dt);
  free(g.ids);
  free(g.text);
  free(ids);
  pd_runtime_close(&rt);
  return rc;
}
