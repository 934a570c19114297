/* pd-router internals: the state shared by its parts.
 *
 *   main.c         flags, sockets, the event loop, ZeroMQ socket watching
 *   registry.c     nodes: Register / Heartbeat / Deregister, liveness, load, node choice
 *   route.c        one choice's path through the cluster: queue, Reserve, Prefill, FirstToken,
 *                  TokenStream, failures (retry, migration), deadlines
 *   api.c          HTTP: OpenAI completions and chat, /generate, /v1/models, /health, /metrics
 *   api_prep.c     tokenization and chat templates of new requests, in the worker pool
 *   api_text.c     output text: incremental detokenization, stop strings, logprobs JSON
 *   api_zmq.c      the ZeroMQ client API (GenerateRequest in, GenerateChunk out)
 *   metrics_router.c  the router's Prometheus series
 *
 * Everything runs on the one event-loop thread: no locks. The one exception is the worker pool
 * (r->pool), which tokenizes prompts and renders chat templates of new requests on other
 * threads; a job there touches only what it owns (api_prep.c). Objects are freed only at "safe
 * points" (router_gc at the end of each top-level callback), so a callback that finishes a
 * request can never pull it out from under the code that called it. */
#ifndef PD_ROUTER_H
#define PD_ROUTER_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdint.h>

#include "evloop.h"
#include "http.h"
#include "pd/log.h"
#include "pd/kvcache.h"
#include "pd/liveness.h"
#include "pd/metrics.h"
#include "pd/net.h"
#include "pd/oai.h"
#include "pd/tokenizer.h"
#include "pd/wire.h"
#include "pd/map.h"
#include "workpool.h"

typedef struct router router;
typedef struct rnode rnode;
typedef struct rreq rreq;
typedef struct rsub rsub;
typedef struct api_prep api_prep;

/* ---- options ---- */

typedef struct router_opts {
  const char *model_dir, *served_name, *host, *bind, *ready_file;
  const char *api_key;      /* the key clients must give (resolved from --api-key or
                               --api-key-file at start); NULL: none */
  const char *api_key_file;
  const char *curve_secret_file, *curve_secret_key, *curve_allow_file;
  const char *allowed_origins; /* CORS: NULL = off */
  bool insecure;            /* run without node authentication */
  int port, cluster_port, client_port;
  int max_queue, max_n, default_max_tokens, max_body_mb, max_connections, max_model_len;
  int max_connections_per_ip, busy_timeout_ms, max_prompt_mb, tokenizer_threads;
  int request_timeout_s, kv_ttl_ms, heartbeat_interval_ms, heartbeat_timeout_ms;
  /* conditional disaggregation (route.c): a unified node prefills a request itself unless it
   * has at least remote_prefill_min_tokens to compute (after the prefix the router expects in
   * that node's cache) and a prefill node has at most remote_prefill_max_queue tokens queued */
  int remote_prefill_min_tokens, remote_prefill_max_queue;
  bool verbose, help;
} router_opts;

/* ---- nodes (registry.c) ---- */

#define AFFINITY_SLOTS 4096 /* block hashes remembered per prefill node */

struct rnode {
  char id[PD_WIRE_ID_MAX_BYTES + 1];
  /* its connection: the routing id its DEALER chose (the node id and 128 random bits, so no
   * other process can take the connection over) and its CURVE key when authenticated */
  uint8_t rid[PD_NET_ROUTING_ID_MAX];
  size_t rid_len;
  uint8_t key[PD_CURVE_KEY_BYTES];
  bool has_key;
  Pd__Role role;
  bool unified; /* decode: also prefills (Prefill with decode_here) */
  uint64_t incarnation, fingerprint;
  char kv_endpoint[256];
  uint8_t kv_key[PD_CURVE_KEY_BYTES];
  bool kv_curve;
  /* geometry of its KV cache */
  uint32_t num_layers, num_kv_heads, head_dim, block_size, total_blocks, kv_head_begin,
      kv_head_end;
  Pd__KvDtype dtype;
  /* its draft model's cache (speculative decoding with a draft; has_draft false: none) and
   * the draft's files, so that draft KV goes only between nodes with the same draft */
  bool has_draft;
  uint64_t draft_fingerprint;
  uint32_t draft_num_layers, draft_num_kv_heads, draft_head_dim, draft_total_blocks;
  uint32_t vocab_size, max_model_len, max_batch_tokens;
  pd_wire_limits lim; /* the router's limits with this node's resources */
  /* load: the last heartbeat, and what the router sent since */
  uint64_t queued_tokens;
  uint32_t free_blocks, running, waiting, reserved_blocks;
  float spec_acceptance; /* tokens per speculative verification (0: none reported) */
  int64_t est_free_blocks;   /* free_blocks minus what was reserved since the heartbeat */
  int64_t est_queued_tokens; /* queued_tokens plus what was sent since the heartbeat */
  int n_subs;                /* choices currently using this node */
  bool dead;                 /* removed: kept only until no choice refers to it */
  /* prefill: hashes of prompt blocks recently sent here (prefix-cache affinity) */
  uint64_t *affinity;        /* [AFFINITY_SLOTS], 0 = empty; direct-mapped by hash */
  int64_t registered_ms, last_seen_ms;
};

void registry_init(router *r);
void registry_free(router *r);
void registry_on_message(router *r, const pd_net_msg *m); /* Register/Heartbeat/Deregister */
rnode *registry_find(router *r, const char *id);
/* The live node whose connection has routing id rid (its main socket). */
rnode *registry_find_rid(router *r, const uint8_t *rid, size_t len);
/* Liveness sweep: nodes silent for heartbeat_timeout_ms die (their choices get an outcome). */
void registry_sweep(router *r);
int registry_count(router *r, Pd__Role role, bool usable_only);
/* Node choice. decode: most free blocks (estimated), then fewest running; needs at least
 * need_blocks free. prefill: fewest queued tokens after crediting prefix-cache affinity;
 * geometry compatible with dest (NULL: any). NULL when none is usable. exclude may be NULL. */
rnode *registry_choose_decode(router *r, int need_blocks, const rnode *exclude);
rnode *registry_choose_prefill(router *r, const rnode *dest, const int32_t *ids, int n,
                               uint64_t cache_salt);
/* Whether prefill node p can compute the KV of decode node d's draft model (the same draft
 * files and cache geometry). */
bool registry_same_draft(const rnode *p, const rnode *d);
/* Whether a usable prefill node can compute decode node d's draft KV. */
bool registry_draft_prefill_for(router *r, const rnode *d);
/* Records that a prompt was sent to prefill node p (affinity, queued tokens). */
void registry_note_prefill(router *r, rnode *p, const int32_t *ids, int n, uint64_t cache_salt);
/* The usable unified node with room for n_ctx tokens that has the most of the prompt cached
 * (then the most free blocks); *hit_tokens: the prompt tokens it is expected to have. NULL:
 * none. */
rnode *registry_choose_unified(router *r, int n_ctx, const int32_t *ids, int n,
                               uint64_t cache_salt, int *hit_tokens);
int registry_count_unified(router *r);
/* Mean tokens per speculative verification over the usable decode nodes that report one;
 * 0 when none does. */
double registry_spec_acceptance(router *r);
/* The fewest prompt tokens queued on a usable prefill node, -1 when there is none. */
int64_t registry_min_prefill_queue(router *r);
/* Effective context length: the router's, capped by every registered node's. */
int registry_max_model_len(router *r);
/* Sends env to node n on the cluster port. PD_ENOTFOUND (not connected), PD_EFULL. */
pd_status router_send_node(router *r, rnode *n, Pd__Envelope *env);
cJSON *registry_json(router *r);

/* ---- one choice's path (route.c) ---- */

typedef enum sub_state {
  SUB_QUEUED = 0,  /* waiting for node capacity */
  SUB_RESERVING,   /* Reserve sent to decode */
  SUB_PREFILLING,  /* Prefill sent; first token pending */
  SUB_DECODING,    /* tokens stream from decode */
  SUB_DONE
} sub_state;

typedef struct stash_msg { /* a TokenStream that overtook its FirstToken */
  int32_t *ids;
  pd_logprobs *lps; /* NULL or [n] */
  int n;
  uint32_t n_generated;
  Pd__FinishReason finish;
} stash_msg;

struct rsub {
  rreq *req;
  int index;          /* choice index in the response */
  int prompt_i;       /* which prompt of the request */
  uint32_t sample_index;
  sub_state state;
  int attempt;
  char wire_id[PD_WIRE_ID_MAX_BYTES + 1];
  rnode *prefill, *decode;
  uint64_t reservation_id;
  uint8_t reservation_token[PD_WIRE_TOKEN_BYTES];
  int32_t *blocks;
  int nb;
  int32_t *draft_blocks; /* the decode node's draft blocks for the same tokens (or NULL) */
  /* output tokens received so far (all attempts) */
  int32_t *gen;
  int n_gen, cap_gen;
  bool got_first;     /* the current attempt's first token arrived */
  int n_from_decode;  /* TokenStream tokens of this attempt */
  stash_msg stash[4];
  int n_stash;
  int64_t t_enqueued, t_first, t_last;
  uint32_t cached_tokens;
  bool in_queue;
  rsub *qprev, *qnext;
  /* outcome */
  bool finished;
  const char *finish_reason; /* "stop", "length", "abort", "error" */
  int32_t stop_token;        /* -1 unless a stop token ended it */
  char *stop_string;         /* the stop string that ended it */
  Pd__ErrorCode err_code;
  char err_msg[512];
  /* output text (api_text.c) */
  pd_detok *detok;
  char *hold;  /* decoded text not yet emitted (it may begin a stop string) */
  size_t n_hold, cap_hold;
  char *text;  /* everything emitted */
  size_t n_text, cap_text;
  int n_out_tokens;     /* tokens counted as output (up to a stop string) */
  bool role_sent, echo_sent; /* stream: chat role delta / completion echo went out */
  bool finish_sent;          /* stream: the chunk with finish_reason went out */
  pd_logprobs *lp_store;     /* ZeroMQ non-stream: logprobs of the output tokens */
  int n_lp_store, cap_lp_store;
  cJSON *lp_acc;        /* non-stream logprobs under construction */
  cJSON *prompt_lp;     /* prompt logprobs (vLLM format), first chunk */
};

void route_init(router *r);
void route_free(router *r);
/* Queues every choice of a new request. */
void route_submit(router *r, rreq *q);
/* Dispatches queued choices to nodes while capacity allows. */
void route_dispatch(router *r);
/* Request-path messages from node n (ReserveReply, FirstToken, TokenStream, Error). */
void route_on_message(router *r, rnode *n, const pd_net_msg *m);
/* Node n is gone: each choice on it is retried, migrated or failed. */
void route_node_failed(router *r, rnode *n, const char *why);
/* Ends a choice now (stop string, cancel, deadline): aborts it on its nodes. No output. */
void route_sub_stop(router *r, rsub *s);
/* Ends a choice with an error (aborts it on its nodes and reports it). */
void route_sub_fail(router *r, rsub *s, Pd__ErrorCode code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Deadlines, queue timeouts. */
void route_tick(router *r);
int route_queue_length(router *r);
int route_active_subs(router *r);

/* ---- requests and output (api*.c) ---- */

typedef enum api_kind {
  API_COMPLETIONS = 0,
  API_CHAT,
  API_GENERATE,
  API_ZMQ,
  API_TOKENIZE,   /* POST /tokenize: answered from the worker pool, never routed */
  API_DETOKENIZE, /* POST /detokenize: likewise */
} api_kind;

typedef struct prompt {
  int32_t *ids;
  int n;
  char *text; /* the prompt as text (echo, /generate); may be NULL */
  size_t text_len;
} prompt;

struct rreq {
  router *r;
  uint64_t num;
  char id[64];       /* response id: "cmpl-...", "chatcmpl-..." */
  char wire[2 * PD_WIRE_TOKEN_BYTES + 1]; /* 128 random bits, hex: the base of its wire ids */
  api_kind kind;
  bool stream, include_usage, echo, skip_special, include_stop_str, continuous_usage;
  int lp_top;        /* -1: no logprobs; else alternatives per token */
  bool want_prompt_lp;
  pd_oai_params op;  /* sampling parameters (seed always set) */
  Pd__SamplingParams *wire_sp; /* the same for the nodes */
  char **stop;
  int n_stop;
  uint64_t cache_salt;
  char cache_salt_str[257];
  prompt *prompts;
  int n_prompts, n_per_prompt;
  rsub *subs;
  int n_subs, n_done;
  int64_t t_start, deadline;
  double created;
  /* where the answer goes */
  pd_http_req *http;
  bool started;      /* a streamed response has begun */
  bool error_sent;   /* a stream error event went out */
  uint8_t zrid[PD_NET_ROUTING_ID_MAX];
  size_t zrid_len;
  char client_id[PD_WIRE_ID_MAX_BYTES + 1];
  uint32_t timeout_ms; /* ZeroMQ: the client's deadline (0: --request-timeout) */
  api_prep *prep;      /* its prompts are being made in the worker pool (api_prep.c) */
  char err_param[128]; /* a refusal's "param": the request field at fault ("" for none) */
  /* lifecycle */
  bool cancelled, finished, retired;
  rreq *next_all, *prev_all;
  rreq *next_gc;
};

/* From route.c to the output side, for a choice s of request q. */
void out_tokens(router *r, rsub *s, const int32_t *ids, const pd_logprobs *lps, int n,
                Pd__FinishReason node_finish);
void out_sub_done(router *r, rsub *s); /* s->finished is set; error or not */

/* api_text.c: feeds tokens into s's text state; returns bytes appended to s->text (from
 * *delta_off). *stopped when a stop string matched (text cut there); *used = tokens consumed
 * (the rest come after the stop string). final: the node said the choice is over. */
void text_feed(router *r, rsub *s, const int32_t *ids, int n, bool final, size_t *delta_off,
               size_t *delta_len, bool *stopped, int *used);
void text_free(rsub *s);
/* Prompt logprobs from a FirstToken in vLLM's shape: [null, {"<id>": {logprob, rank,
 * decoded_token}}, ...], the prompt token first in each position. */
cJSON *prompt_lp_json(router *r, rsub *s, Pd__TokenLogprob *const *lps, int n);
/* Token strings for logprobs output. */
char *token_str(router *r, int32_t id); /* malloc'ed */
/* Logprobs of n tokens in the OpenAI shape of q->kind (completions: {tokens, token_logprobs,
 * top_logprobs, text_offset}; chat: {content: [...]}) appended to acc (created when NULL).
 * Completions' top_logprobs hold the chosen token and then the most likely others, at most
 * logprobs + 1 entries (vLLM; so logprobs 0 gives the chosen token alone); chat's hold the
 * top_logprobs most likely tokens (OpenAI). */
cJSON *lp_append(router *r, rreq *q, cJSON *acc, const pd_logprobs *lps, int n, size_t offset0);
/* echo with logprobs (completions): the prompt's tokens in the completions shape, built from
 * s->prompt_lp (the first token has null logprob and top_logprobs, as in vLLM). */
cJSON *echo_lp_json(router *r, rsub *s);

/* api_prep.c: preparing prompts off the loop.
 * Tokenizing costs about 0.2 s per MB of prompt and rendering a chat template about as much, so
 * both run in the worker pool: the loop parses and validates a request (cheap), collects its
 * prompt texts, token ids or chat messages into an api_prep and submits it; a worker builds the
 * prompts; back on the loop done() continues the request. The job reads only what it owns (the
 * parsed JSON body, or copies) and writes only its own output: the worker never touches a
 * request. The request keeps its HTTP hold meanwhile, so a client that goes away cancels it as
 * usual; freeing a request whose job is out detaches the job (api_prep_detach, from
 * api_req_free), whose result is then dropped when it comes back: the request is freed once, by
 * router_gc, and the job once, by its own completion. */
/* When the prompts are back (and q neither finished nor freed meanwhile), the request goes on:
 * the context check (api_req_prepare), admission (api_req_admit), then route_submit. A request
 * that cannot go on (its prompts could not be made, 400 / 500 / 503 at shutdown; or prepare or
 * admit refused it) is handed to refuse, which answers the client (msg, an OpenAI error code or
 * NULL) and retires it. */
typedef void (*api_refuse_fn)(router *r, rreq *q, int status, const char *msg, const char *code);
api_prep *api_prep_new(router *r, rreq *q, api_refuse_fn refuse); /* NULL: out of memory */
void api_prep_free(api_prep *p); /* a job never submitted */
/* What the job reads must live as long as the job: the parsed body (taken over), blocks it
 * adopts (malloc'ed; freed at once on failure) or copies it keeps. */
void api_prep_own_json(api_prep *p, cJSON *json);
bool api_prep_adopt(api_prep *p, void *mem);
const char *api_prep_keep(api_prep *p, const char *s, size_t n); /* NULL: out of memory */
/* Inputs, in prompt order: a text to tokenize, or token ids (taken over); false: no memory. */
bool api_prep_text(api_prep *p, const char *text, size_t len, bool add_special);
bool api_prep_ids(api_prep *p, int32_t *ids, int n);
/* Or chat messages (array taken over) for the chat template: 0, or 400 with msg when the model
 * has none. add_special: the tokenizer's own special tokens on top of the template's
 * (/tokenize only; generation never adds them). */
int api_prep_chat(api_prep *p, pd_chat_msg *msgs, int n, bool add_gen, bool cont,
                  bool add_special, char *msg, size_t cap);
/* For API_TOKENIZE and API_DETOKENIZE requests: the job also renders the answer (the token ids
 * and, with token_strs, their vocabulary strings, and max_model_len; or the decoded text of its
 * token ids), which goes out through api_http_reply. */
void api_prep_reply(api_prep *p, bool token_strs, int max_model_len);
/* Submits p (always consumed). 0: the request goes on from the pool, or before this returns
 * when there is nothing to tokenize (the caller must not touch q after 0). Otherwise an HTTP
 * status with msg and *code (and q->err_param) for the caller to refuse the request with,
 * decided before any tokenizing: 400 when the prompt text (or the roles and contents of the
 * messages) is over --max-prompt-mb, or when n x prompts is over --max-queue (the request could
 * never be admitted); 429 when --max-queue jobs are already waiting for the pool (retrying
 * later can succeed). */
int api_prep_submit(api_prep *p, char *msg, size_t cap, const char **code);
void api_prep_detach(rreq *q);
int api_prep_in_flight(router *r); /* jobs in the pool */

/* api.c */
void api_http_handler(pd_http_req *req, const pd_http_request *msg, void *ud);
/* Validates the body of a generation request (q->kind: completions, chat or /generate) as the
 * HTTP API does, after its "model": sampling parameters, stream options, stop, tools,
 * response_format and the rest into q, then the prompts or messages into p, which must own body
 * already (api_prep_own_json). 0, or an HTTP status with msg and q->err_param (the parameter at
 * fault). Needs no event loop, server or node: the fuzz target tests/fuzz/fuzz_openai.c calls it
 * with a bare router. */
int api_parse_generation(router *r, rreq *q, api_prep *p, const cJSON *body, char *msg,
                         size_t cap);
void api_req_free(router *r, rreq *q);
/* Drops q's reference to its HTTP exchange together with the cancel callback (no-op when none
 * is held). */
void api_http_release(rreq *q);
/* Ends every choice of q now (client gone or cancelled): aborts them on the nodes, no more
 * output. Safe to call at a safe point only. */
void api_cancel(router *r, rreq *q);
rreq *api_req_new(router *r, api_kind kind);
/* Whether given (may be NULL) is the router's API key (always true without one); constant time
 * in the key. */
bool api_key_ok(router *r, const char *given);
/* Maps an ErrorCode to an HTTP status. */
int api_http_status(Pd__ErrorCode c);
const char *api_error_code_str(Pd__ErrorCode c);
/* Builds prompts/params shared by HTTP and ZMQ: checks context, fills seed, wire params,
 * subs, deadline (q->timeout_ms, else --request-timeout). Returns 0 or an HTTP status with msg
 * set. */
int api_req_prepare(router *r, rreq *q, char *msg, size_t cap, const char **code);
/* Refuses a new request with 429 when the queue is full for now, 400 when its choices could
 * never fit the queue, 503 when no node can take it: 0 or the status with msg. */
int api_req_admit(router *r, rreq *q, char *msg, size_t cap);
/* Output side for HTTP requests (api.c) and ZMQ requests (api_zmq.c). */
void api_http_tokens(router *r, rsub *s, size_t off, size_t len, const pd_logprobs *lps, int n);
void api_http_sub_done(router *r, rsub *s);
void api_http_req_done(router *r, rreq *q);
/* Answers q (taken from the worker pool: /tokenize, /detokenize) with 200 and json[0, len),
 * and lets it go. */
void api_http_reply(router *r, rreq *q, const char *json, size_t len);

/* api_zmq.c */
void zapi_on_message(router *r, const pd_net_msg *m);
void zapi_tokens(router *r, rsub *s, size_t off, size_t len, const int32_t *ids,
                 const pd_logprobs *lps, int n);
void zapi_sub_done(router *r, rsub *s);
void zapi_req_done(router *r, rreq *q);
void zapi_forget(router *r, rreq *q); /* drops q from the client-id map */

/* ---- metrics (metrics_router.c) ---- */

typedef struct router_metrics {
  pd_metrics *reg;
  pd_metric *ttft, *itl, *e2e, *queue_len, *running, *gen_tokens, *prompt_tokens, *migrations,
      *retries, *prefill_local, *prefill_remote, *nodes_prefill, *nodes_decode, *spec_acceptance, *http_conns, *cached_tokens, *live, *preparing,
      *http_evicted, *http_refused;
} router_metrics;

void rmetrics_init(router *r);
void rmetrics_request(router *r, const char *api, int status); /* requests by status */
void rmetrics_error(router *r, const char *kind);               /* errors by kind */

/* ---- the router ---- */

struct router {
  router_opts o;
  char model_name[256];
  uint64_t fingerprint, incarnation;
  pd_tokenizer *tok;
  int vocab_size, max_model_len;
  pd_evloop *loop;
  pd_http_server *http;
  pd_workpool *pool; /* tokenization and chat templates (api_prep.c) */
  void *zctx;
  pd_curve_auth *auth;       /* the cluster port admits member keys only; NULL: --insecure */
  pd_curve_keypair keys;
  bool have_keys;
  pd_map node_keys;          /* node id -> the key it first registered with (uint8_t[32],
                                malloc'ed): an id stays bound to its key for the router's
                                lifetime */
  pd_log_limit deny_log;     /* refused handshakes and messages: at most a few lines per 10 s */
  pd_hs_watch *cluster_watch, *client_watch; /* handshakes that failed before ZAP */
  char *api_key_owned;       /* o.api_key's storage */
  void *cluster_sock, *client_sock;
  int cluster_fd, client_fd;
  char cluster_ep[256], client_ep[256];
  bool drain_scheduled;
  pd_wire_limits lim;
  uint64_t seq;
  /* registry */
  rnode **nodes;
  int n_nodes, cap_nodes;
  pd_liveness *live;
  /* requests */
  rreq *all;
  rreq *gc;
  int n_live; /* request objects not yet freed (the list `all`) */
  uint64_t next_req;
  pd_map subs_by_wire; /* wire id -> rsub */
  pd_map zreqs;        /* "<hex routing id>/<client id>" -> rreq */
  rsub *q_head, *q_tail;
  int q_len;
  int n_active_subs;
  router_metrics m;
};

/* Frees finished requests (safe point). */
void router_gc(router *r);
/* Marks q for freeing at the next safe point (idempotent). */
void router_retire(router *r, rreq *q);
/* Sends on the cluster/client socket and schedules a drain (ZMQ_FD edge semantics). */
void router_after_send(router *r);
/* Errors as JSON text for responses ({"error": {...}}), malloc'ed. */
char *router_error_json(int status, const char *msg, const char *code);

#endif
