/* pdctl client --endpoint tcp://HOST:PORT (--prompt T | --chat T | --prompt-ids 1,2,3) [...]
 *
 * Sends one request to a router's ZeroMQ client API (pd/client.h) and prints the answer as it
 * streams (--stream) or at the end. Ctrl-C cancels the request on the router. */
#include <cjson/cJSON.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/client.h"
#include "pdctl.h"

static volatile sig_atomic_t g_interrupted;
static void on_sigint(int sig) { (void)sig; g_interrupted = 1; }

/* Text and token ids of one choice, grown as chunks arrive. */
typedef struct choice_buf {
  char *text;
  size_t len, cap;
  int32_t *ids;
  size_t n_ids, cap_ids;
  const char *finish;
  char stop[128];
} choice_buf;

typedef struct client_state {
  choice_buf *ch;
  uint32_t n;
  bool stream_print; /* print choice 0's text as it arrives */
  bool oom;
} client_state;

static bool buf_append(choice_buf *b, const char *s, size_t n) {
  if (b->len + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n + 1) cap *= 2;
    char *t = realloc(b->text, cap);
    if (!t) return false;
    b->text = t;
    b->cap = cap;
  }
  memcpy(b->text + b->len, s, n);
  b->len += n;
  b->text[b->len] = 0;
  return true;
}

static bool ids_append(choice_buf *b, const int32_t *ids, size_t n) {
  if (n == 0) return true;
  if (b->n_ids + n > b->cap_ids) {
    size_t cap = b->cap_ids ? b->cap_ids : 64;
    while (cap < b->n_ids + n) cap *= 2;
    int32_t *t = realloc(b->ids, cap * sizeof *t);
    if (!t) return false;
    b->ids = t;
    b->cap_ids = cap;
  }
  memcpy(b->ids + b->n_ids, ids, n * sizeof *ids);
  b->n_ids += n;
  return true;
}

static bool on_chunk(const Pd__GenerateChunk *c, void *ud) {
  client_state *s = ud;
  if (c->index < s->n) {
    choice_buf *b = &s->ch[c->index];
    size_t tl = c->text ? strlen(c->text) : 0;
    if ((tl && !buf_append(b, c->text, tl)) || !ids_append(b, c->token_ids, c->n_token_ids))
      s->oom = true;
    if (s->stream_print && c->index == 0 && tl) {
      fwrite(c->text, 1, tl, stdout);
      fflush(stdout);
    }
    if (c->finish_reason != PD__FINISH_REASON__FINISH_REASON_NONE)
      b->finish = pd_client_finish_reason_str(c->finish_reason);
    if (c->stop_reason_case == PD__GENERATE_CHUNK__STOP_REASON_STOP_STRING && c->stop_string)
      snprintf(b->stop, sizeof b->stop, "%s", c->stop_string);
    else if (c->stop_reason_case == PD__GENERATE_CHUNK__STOP_REASON_STOP_TOKEN_ID)
      snprintf(b->stop, sizeof b->stop, "token %d", c->stop_token_id);
  }
  return !g_interrupted && !s->oom;
}

int cmd_client(int argc, char **argv) {
  const char *endpoint = NULL, *prompt = NULL, *chat = NULL, *system_msg = NULL, *ids_s = NULL,
             *model = NULL, *stop = NULL, *server_key = NULL, *client_key = NULL,
             *api_key = NULL, *api_key_file = NULL;
  int max_tokens = 128, top_k = 0, n = 1, connect_ms = 5000, timeout_ms = 120000;
  double temperature = 1.0, top_p = 1.0, min_p = 0.0;
  unsigned long long seed = 0;
  bool seed_set = false, temp_set = false, stream = false, ignore_eos = false, json = false,
       help = false, quiet = false;
  pd_opt opts[] = {
      {"endpoint", PD_OPT_STR, &endpoint, "URL", "router client port, tcp://HOST:PORT", NULL},
      {"prompt", PD_OPT_STR, &prompt, "TEXT", "raw prompt text", NULL},
      {"chat", PD_OPT_STR, &chat, "TEXT", "a user message, rendered with the chat template",
       NULL},
      {"system", PD_OPT_STR, &system_msg, "TEXT", "with --chat: a system message first", NULL},
      {"prompt-ids", PD_OPT_STR, &ids_s, "IDS", "prompt as comma-separated token ids", NULL},
      {"model", PD_OPT_STR, &model, "NAME", "served model name (default: the only one)", NULL},
      {"max-tokens", PD_OPT_INT, &max_tokens, "N", "output tokens (default 128)", NULL},
      {"temperature", PD_OPT_DOUBLE, &temperature, "T", "0 = greedy (default 1)", &temp_set},
      {"top-p", PD_OPT_DOUBLE, &top_p, "P", "nucleus sampling (default 1 = off)", NULL},
      {"top-k", PD_OPT_INT, &top_k, "K", "top-k sampling (default 0 = off)", NULL},
      {"min-p", PD_OPT_DOUBLE, &min_p, "P", "min-p sampling (default 0 = off)", NULL},
      {"seed", PD_OPT_U64, &seed, "S", "sampling seed", &seed_set},
      {"stop", PD_OPT_STR, &stop, "TEXT", "a stop string", NULL},
      {"n", PD_OPT_INT, &n, "N", "choices (default 1)", NULL},
      {"ignore-eos", PD_OPT_BOOL, &ignore_eos, NULL, "keep going past end-of-sequence", NULL},
      {"stream", PD_OPT_BOOL, &stream, NULL, "print the text as it is generated", NULL},
      {"json", PD_OPT_BOOL, &json, NULL, "print the result as JSON", NULL},
      {"quiet", PD_OPT_BOOL, &quiet, NULL, "no summary line on stderr", NULL},
      {"server-key", PD_OPT_STR, &server_key, "KEY|FILE",
       "router client-port CURVE public key (Z85 or certificate file): encrypt", NULL},
      {"client-key", PD_OPT_STR, &client_key, "KEY|FILE",
       "own CURVE secret key (Z85 or certificate file); default: a random one", NULL},
      {"api-key", PD_OPT_STR, &api_key, "KEY",
       "the router's API key (visible in ps: prefer --api-key-file or PD_API_KEY)", NULL},
      {"api-key-file", PD_OPT_STR, &api_key_file, "FILE", "the API key from a file", NULL},
      {"connect-timeout", PD_OPT_INT, &connect_ms, "MS", "connection timeout (default 5000)",
       NULL},
      {"timeout", PD_OPT_INT, &timeout_ms, "MS",
       "give up when the router is silent this long (default 120000)", NULL},
      {"help", PD_OPT_BOOL, &help, NULL, "show this help", NULL},
      {0}};
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 2, &e) != PD_OK) return pdctl_fail("%s", e.msg);
  if (help) {
    fputs("usage: pdctl client --endpoint tcp://HOST:PORT (--prompt T | --chat T | "
          "--prompt-ids IDS) [options]\n",
          stdout);
    pd_opts_usage(stdout, opts);
    return 0;
  }
  if (!endpoint) return pdctl_fail("client needs --endpoint tcp://HOST:PORT");
  if (!!prompt + !!chat + !!ids_s != 1)
    return pdctl_fail("give exactly one of --prompt, --chat, --prompt-ids");
  if (system_msg && !chat) return pdctl_fail("--system goes with --chat");
  if (max_tokens <= 0) return pdctl_fail("--max-tokens must be positive");
  if (n < 1 || n > PD_SAMPLE_MAX_N) return pdctl_fail("--n must be in 1..%d", PD_SAMPLE_MAX_N);
  if (client_key && !server_key) return pdctl_fail("--client-key needs --server-key");

  pd_curve_keypair skey, ckey;
  memset(&ckey, 0, sizeof ckey);
  pd_client_opts co;
  pd_client_opts_init(&co);
  co.connect_timeout_ms = connect_ms;
  co.idle_timeout_ms = timeout_ms;
  co.name = "pdctl";
  if (server_key) {
    if (pd_curve_key_arg(server_key, false, &skey, &e) != PD_OK)
      return pdctl_fail("--server-key: %s", e.msg);
    co.server_public_key = skey.public_z85;
    if (client_key) {
      if (pd_curve_key_arg(client_key, true, &ckey, &e) != PD_OK)
        return pdctl_fail("--client-key: %s", e.msg);
      co.client_keys = &ckey;
    }
  }

  /* The request. Unset sampling fields keep the router's defaults. */
  Pd__SamplingParams sp = PD__SAMPLING_PARAMS__INIT;
  if (temp_set) {
    sp.temperature_opt_case = PD__SAMPLING_PARAMS__TEMPERATURE_OPT_TEMPERATURE;
    sp.temperature = (float)temperature;
  }
  sp.top_p = (float)top_p;
  sp.top_k = top_k;
  sp.min_p = (float)min_p;
  if (seed_set) {
    sp.seed_opt_case = PD__SAMPLING_PARAMS__SEED_OPT_SEED;
    sp.seed = seed;
  }
  sp.max_tokens = (uint32_t)max_tokens;
  sp.n = (uint32_t)n;
  sp.ignore_eos = ignore_eos;
  char *stops[1] = {(char *)stop};
  if (stop) {
    sp.n_stop = 1;
    sp.stop = stops;
  }
  Pd__GenerateRequest req = PD__GENERATE_REQUEST__INIT;
  req.model = (char *)(model ? model : "");
  req.sampling = &sp;
  req.stream = stream;
  req.include_usage = true;
  req.timeout_ms = 0;
  Pd__ChatMessage msgs[2], *msgp[2];
  int32_t *ids = NULL;
  if (prompt) {
    req.prompt = (char *)prompt;
  } else if (ids_s) {
    size_t k = 0;
    ids = pdctl_parse_ids(ids_s, &k, &e);
    if (!ids) return pdctl_fail("--prompt-ids: %s", e.msg);
    req.prompt_token_ids = ids;
    req.n_prompt_token_ids = k;
  } else {
    size_t k = 0;
    if (system_msg) {
      pd__chat_message__init(&msgs[k]);
      msgs[k].role = (char *)"system";
      msgs[k].content = (char *)system_msg;
      msgp[k] = &msgs[k];
      k++;
    }
    pd__chat_message__init(&msgs[k]);
    msgs[k].role = (char *)"user";
    msgs[k].content = (char *)chat;
    msgp[k] = &msgs[k];
    k++;
    req.messages = msgp;
    req.n_messages = k;
  }

  client_state st = {.n = (uint32_t)n, .stream_print = stream && n == 1 && !json};
  st.ch = calloc((size_t)n, sizeof *st.ch);
  if (!st.ch) {
    free(ids);
    return pdctl_fail("out of memory");
  }
  int rc = 0;
  pd_client_result res;
  memset(&res, 0, sizeof res);
  pd_client *c = NULL;
  char *key = NULL; /* the API key, from --api-key, PD_API_KEY or --api-key-file */
  if (pd_secret_opt("api-key", api_key, api_key_file, &key, &e) != PD_OK) {
    rc = pdctl_fail("%s", e.msg);
    goto done;
  }
  co.api_key = key;
  c = pd_client_connect(endpoint, &co, &e);
  pd_secret_free(key); /* the client keeps its own copy */
  if (!c) {
    rc = pdctl_fail("%s", e.msg);
    goto done;
  }
  struct sigaction sa, old_sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_sigint;
  sigaction(SIGINT, &sa, &old_sa);
  pd_status s = pd_client_generate(c, &req, on_chunk, &st, &res, &e);
  sigaction(SIGINT, &old_sa, NULL);
  if (st.stream_print && st.ch[0].len) fputc('\n', stdout);
  if (s != PD_OK) {
    rc = pdctl_fail("%s", e.msg);
    goto done;
  }
  if (st.oom) {
    rc = pdctl_fail("out of memory");
    goto done;
  }
  if (json) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "id", res.request_id);
    cJSON *arr = cJSON_AddArrayToObject(o, "choices");
    for (int i = 0; i < n; i++) {
      cJSON *ch = cJSON_CreateObject();
      cJSON_AddNumberToObject(ch, "index", i);
      cJSON_AddStringToObject(ch, "text", st.ch[i].text ? st.ch[i].text : "");
      cJSON *ids_j = cJSON_AddArrayToObject(ch, "token_ids");
      for (size_t k = 0; k < st.ch[i].n_ids; k++)
        cJSON_AddItemToArray(ids_j, cJSON_CreateNumber(st.ch[i].ids[k]));
      cJSON_AddStringToObject(ch, "finish_reason", st.ch[i].finish ? st.ch[i].finish : "");
      if (st.ch[i].stop[0]) cJSON_AddStringToObject(ch, "stop", st.ch[i].stop);
      cJSON_AddItemToArray(arr, ch);
    }
    if (res.have_usage) {
      cJSON *u = cJSON_AddObjectToObject(o, "usage");
      cJSON_AddNumberToObject(u, "prompt_tokens", res.prompt_tokens);
      cJSON_AddNumberToObject(u, "completion_tokens", res.usage_completion_tokens);
      cJSON_AddNumberToObject(u, "cached_tokens", res.cached_tokens);
    }
    if (res.error_code) {
      cJSON *er = cJSON_AddObjectToObject(o, "error");
      cJSON_AddStringToObject(er, "code", pd_client_error_code_str(res.error_code));
      cJSON_AddStringToObject(er, "message", res.error);
    }
    cJSON_AddNumberToObject(o, "ttft_s", res.ttft_s);
    cJSON_AddNumberToObject(o, "total_s", res.total_s);
    char *txt = cJSON_PrintUnformatted(o);
    if (txt) puts(txt);
    free(txt);
    cJSON_Delete(o);
  } else if (!st.stream_print) {
    for (int i = 0; i < n; i++) {
      if (n > 1) printf("--- choice %d ---\n", i);
      if (st.ch[i].len) {
        fwrite(st.ch[i].text, 1, st.ch[i].len, stdout);
        fputc('\n', stdout);
      }
    }
  }
  fflush(stdout);
  if (res.error_code) {
    rc = pdctl_fail("request %s failed: %s (%s)", res.request_id, res.error,
                    pd_client_error_code_str(res.error_code));
  } else if (!quiet) {
    uint32_t toks = res.have_usage ? res.usage_completion_tokens : res.completion_tokens;
    fprintf(stderr, "[%s: finish %s, prompt %u tokens, %u output tokens, ", res.request_id,
            pd_client_finish_reason_str(res.finish_reason), res.prompt_tokens, toks);
    if (stream) { /* the first chunk's time is the time to first token */
      double gen_s = res.total_s - res.ttft_s;
      fprintf(stderr, "TTFT %.3f s, %.3f s, %.1f tokens/s after the first]\n", res.ttft_s,
              res.total_s, toks > 1 && gen_s > 0 ? (toks - 1) / gen_s : 0.0);
    } else {
      fprintf(stderr, "%.3f s, %.1f tokens/s]\n", res.total_s,
              res.total_s > 0 ? toks / res.total_s : 0.0);
    }
  }
  if (g_interrupted) rc = 130;
done:
  pd_client_close(c);
  for (int i = 0; i < n; i++) {
    free(st.ch[i].text);
    free(st.ch[i].ids);
  }
  free(st.ch);
  free(ids);
  memset(&ckey, 0, sizeof ckey);
  return rc;
}
