/* Fuzz target (b): an OpenAI request body through the strict JSON parser (pd/json.h) and the
 * router's validation of completions, chat completions and /generate requests into sampling
 * parameters, stop strings, prompts and chat messages (api_parse_generation, router/api.c),
 * tools and response_format included, as the HTTP API runs it, with a bare router: the bundled
 * model's tokenizer and chat template, the default options, no event loop, server or node.
 *
 * Input: [kind: completions, chat, generate] body...
 * Properties: the parser and the validation never crash or leak; a document the strict parser
 * accepts, printed by cJSON and parsed again, is accepted again (the tree is a faithful JSON
 * value); a refusal is a 4xx/500 with a message; an accepted request's parameters pass the
 * sampling validator. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "pd/json.h"
#include "router.h"

static router *g_router;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc;
  (void)argv;
  pd_log_init("fuzz_openai", false);
  router *r = calloc(1, sizeof *r);
  FUZZ_CHECK(r);
  pd_err e = {0};
  r->tok = pd_tokenizer_load(PD_TEST_DATA "/models/pycoder-12m", &e);
  if (!r->tok) {
    fprintf(stderr, "fuzz_openai: %s\n", e.msg);
    abort();
  }
  /* pd-router's defaults (router/main.c) */
  r->o.max_queue = 256;
  r->o.max_n = 16;
  r->o.default_max_tokens = 16;
  r->o.max_prompt_mb = 4;
  r->o.request_timeout_s = 600;
  snprintf(r->model_name, sizeof r->model_name, "pycoder-12m");
  r->vocab_size = pd_tokenizer_vocab_size(r->tok);
  r->max_model_len = 2048;
  g_router = r;
  return 0;
}

static void refuse_unused(router *r, rreq *q, int status, const char *msg, const char *code) {
  (void)r, (void)q, (void)status, (void)msg, (void)code;
  FUZZ_CHECK(!"a job that is never submitted refuses nothing");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!g_router) LLVMFuzzerInitialize(NULL, NULL);
  router *r = g_router;
  fuzz_in in = {data, size};
  static const api_kind kinds[] = {API_COMPLETIONS, API_CHAT, API_GENERATE};
  api_kind kind = kinds[fuzz_byte(&in) % 3];

  pd_json_error je;
  cJSON *body = pd_json_parse((const char *)in.p, in.n, &je);
  if (!body) {
    FUZZ_CHECK(je.code == PD_EINVAL || je.code == PD_ENOMEM);
    FUZZ_CHECK(je.msg[0] && je.offset <= in.n);
    return 0;
  }
  char *printed = cJSON_PrintUnformatted(body);
  FUZZ_CHECK(printed);
  cJSON *again = pd_json_parse(printed, strlen(printed), &je);
  if (!again) fprintf(stderr, "reparse of %s: %s at %zu\n", printed, je.msg, je.offset);
  FUZZ_CHECK(again);
  cJSON_Delete(again);
  free(printed);
  if (!cJSON_IsObject(body)) {
    cJSON_Delete(body);
    return 0;
  }

  rreq *q = api_req_new(r, kind);
  FUZZ_CHECK(q);
  api_prep *p = api_prep_new(r, q, refuse_unused);
  FUZZ_CHECK(p);
  api_prep_own_json(p, body);
  char msg[1024] = "";
  int st = api_parse_generation(r, q, p, body, msg, sizeof msg);
  if (st) {
    FUZZ_CHECK(st == 400 || st == 404 || st == 500);
    FUZZ_CHECK(msg[0] || st == 500);
  } else {
    pd_sampling_params one = q->op.p;
    one.n = 1;
    /* chat: decided once the prompt is known (the context left), and refused then when
     * min_tokens does not fit it; here any value min_tokens fits */
    if (one.max_tokens < 0) one.max_tokens = one.min_tokens > 1 ? one.min_tokens : 1;
    const char *param = NULL;
    pd_err e = {0};
    FUZZ_CHECK(pd_oai_params_validate(&one, r->vocab_size, &param, &e) == PD_OK);
    FUZZ_CHECK(q->n_stop >= 0 && q->n_stop <= 16);
    FUZZ_CHECK(q->op.p.n <= r->o.max_n);
  }
  api_prep_free(p);
  api_req_free(r, q);
  return 0;
}
