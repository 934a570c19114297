/* pdctl generate: text from a model on this machine, one prompt.
 *   pdctl generate --model DIR (--prompt TEXT | --prompt-ids 1,2,3 | --chat TEXT)
 *                  [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
 *                  [--ignore-eos] [--json] [--dump-logits FILE]
 * --prompt adds no special tokens; --chat applies the model's chat template. Text streams to
 * stdout as it is generated unless --json, which prints one object at the end. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/sample.h"
#include "pdctl.h"

typedef struct gen_args {
  const char *model, *prompt, *prompt_ids, *chat, *dump_logits;
  int max_tokens, top_k, threads;
  double temperature, top_p, min_p;
  unsigned long long seed;
  bool seed_set, ignore_eos, json, help;
} gen_args;

static int dump_logits(const char *path, const float *logits, int V) {
  FILE *f = fopen(path, "wb");
  if (!f) return pdctl_fail("cannot write %s", path);
  /* little-endian float32: the host order on every platform pdserve builds for */
  size_t w = fwrite(logits, sizeof(float), (size_t)V, f);
  if (fclose(f) != 0 || w != (size_t)V) return pdctl_fail("cannot write %s", path);
  return 0;
}

/* The model's end-of-text ids: config.json's eos_token_id(s) and the tokenizer's eos_token. */
static size_t eos_ids(const pd_model_config *c, const pd_tokenizer *t, int32_t *out) {
  size_t n = 0;
  for (int i = 0; i < c->n_eos; i++) out[n++] = c->eos_token_ids[i];
  int32_t te = pd_tokenizer_eos_id(t);
  bool dup = te < 0;
  for (size_t i = 0; i < n; i++) dup |= out[i] == te;
  if (!dup) out[n++] = te;
  return n;
}

int cmd_generate(int argc, char **argv) {
  for (int i = 2; i < argc; i++)
    if (!strcmp(argv[i], "--input") || !strncmp(argv[i], "--input=", 8))
      return cmd_generate_batch(argc, argv);
  gen_args a = {.max_tokens = 256, .temperature = 1.0, .top_p = 1.0, .top_k = 0};
  pd_opt opts[] = {
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
      {"threads", PD_OPT_INT, &a.threads, "N", "CPU threads (0 = all cores)", NULL},
      {"help", PD_OPT_BOOL, &a.help, NULL, "show this help", NULL},
      {0}};
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
  if (a.threads < 0) return pdctl_fail("--threads must not be negative");

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

  pd_tokenizer *tok = pd_tokenizer_load(a.model, &e);
  if (!tok) return pdctl_fail("%s", e.msg);
  int32_t *ids = NULL;
  size_t n_ids = 0;
  int rc = 0;
  if (a.prompt_ids) {
    ids = pdctl_parse_ids(a.prompt_ids, &n_ids, &e);
  } else if (a.prompt) {
    if (pd_tokenizer_encode(tok, a.prompt, strlen(a.prompt), false, &ids, &n_ids, &e) != PD_OK)
      ids = NULL;
  } else {
    pd_chat_msg msg = {"user", a.chat};
    char *text = NULL;
    if (pd_tokenizer_apply_chat(tok, &msg, 1, true, &text, &e) == PD_OK) {
      if (pd_tokenizer_encode(tok, text, strlen(text), false, &ids, &n_ids, &e) != PD_OK)
        ids = NULL;
      free(text);
    }
  }
  if (!ids) {
    pd_tokenizer_free(tok);
    return pdctl_fail("%s", e.msg);
  }
  if (n_ids == 0) {
    free(ids);
    pd_tokenizer_free(tok);
    return pdctl_fail("the prompt is empty");
  }

  pdctl_runner r;
  if (pdctl_runner_open(&r, a.model, 1, (int)n_ids + a.max_tokens, 512, a.threads, &e)) {
    free(ids);
    pd_tokenizer_free(tok);
    return pdctl_fail("%s", e.msg);
  }
  if (pd_sampling_params_validate(&sp, r.V, &e) != PD_OK) {
    rc = pdctl_fail("%s", e.msg);
    goto out;
  }
  for (size_t i = 0; i < n_ids; i++)
    if (ids[i] >= r.V) {
      rc = pdctl_fail("token id %d is outside the vocabulary (%d)", ids[i], r.V);
      goto out;
    }

  const pd_model_config *c = &r.model->cfg;
  int32_t eos[PD_MAX_EOS + 1];
  size_t n_eos = eos_ids(c, tok, eos);
  pd_sampler *smp = pd_sampler_new(&sp, r.V, eos, n_eos, 0, &e);
  pd_sample_ws *ws = smp ? pd_sample_ws_new(r.V, &e) : NULL;
  pd_detok *dt = pd_detok_new(tok, true);
  int32_t *out_ids = malloc((size_t)a.max_tokens * sizeof *out_ids);
  size_t n_out = 0;
  char *text = NULL;
  size_t text_len = 0, text_cap = 0;
  if (!smp || !ws || !dt || !out_ids) {
    rc = pdctl_fail("%s", smp && ws ? "out of memory" : e.msg);
    goto done;
  }
  if (pdctl_runner_feed(&r, 0, ids, (int)n_ids, &e) != PD_OK) {
    rc = pdctl_fail("%s", e.msg);
    goto done;
  }
  if (a.dump_logits && dump_logits(a.dump_logits, r.logits, r.V)) {
    rc = 1;
    goto done;
  }
  while (n_out < (size_t)a.max_tokens) {
    int32_t next;
    pd_finish_reason fin = PD_FINISH_NONE;
    if (pd_sample_token(smp, ws, r.logits, &next, NULL, &e) != PD_OK ||
        pd_sampler_accept(smp, next, &fin, &e) != PD_OK) {
      rc = pdctl_fail("%s", e.msg);
      goto done;
    }
    out_ids[n_out++] = next;
    bool stop = fin == PD_FINISH_STOP;
    if (!stop) {
      const char *piece;
      size_t plen;
      if (pd_detok_push(dt, next, &piece, &plen, &e) != PD_OK) {
        rc = pdctl_fail("%s", e.msg);
        goto done;
      }
      if (a.json) {
        if (text_len + plen + 1 > text_cap) {
          text_cap = 2 * (text_len + plen + 1);
          char *t = realloc(text, text_cap);
          if (!t) {
            rc = pdctl_fail("out of memory");
            goto done;
          }
          text = t;
        }
        memcpy(text + text_len, piece, plen);
        text_len += plen;
        text[text_len] = 0;
      } else {
        fwrite(piece, 1, plen, stdout);
        fflush(stdout);
      }
    }
    if (fin != PD_FINISH_NONE) break;
    if (pdctl_runner_feed(&r, 0, &next, 1, &e) != PD_OK) {
      rc = pdctl_fail("%s", e.msg);
      goto done;
    }
  }
  {
    const char *piece;
    size_t plen;
    if (pd_detok_flush(dt, &piece, &plen, &e) == PD_OK && plen) {
      if (a.json) {
        char *t = realloc(text, text_len + plen + 1);
        if (t) {
          text = t;
          memcpy(text + text_len, piece, plen);
          text_len += plen;
          text[text_len] = 0;
        }
      } else {
        fwrite(piece, 1, plen, stdout);
      }
    }
  }
  if (a.json) {
    cJSON *o = cJSON_CreateObject();
    cJSON *in = cJSON_AddArrayToObject(o, "input_ids"), *outa = cJSON_AddArrayToObject(o, "output_ids");
    for (size_t i = 0; i < n_ids; i++) cJSON_AddItemToArray(in, cJSON_CreateNumber(ids[i]));
    for (size_t i = 0; i < n_out; i++) cJSON_AddItemToArray(outa, cJSON_CreateNumber(out_ids[i]));
    cJSON_AddStringToObject(o, "text", text ? text : "");
    char *s = cJSON_PrintUnformatted(o);
    puts(s);
    free(s);
    cJSON_Delete(o);
  } else {
    putchar('\n');
  }
done:
  free(text);
  free(out_ids);
  pd_detok_free(dt);
  pd_sample_ws_free(ws);
  pd_sampler_free(smp);
out:
  pdctl_runner_close(&r);
  free(ids);
  pd_tokenizer_free(tok);
  return rc;
}
