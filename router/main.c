/* pd-router: the OpenAI HTTP API and the ZeroMQ client API in front of prefill and decode
 * nodes (docs/cluster.md for flags, docs/api.md for the API).
 *
 * One thread, one event loop (router/evloop.h) drives the HTTP server, the ZeroMQ cluster port
 * (nodes) and client port (clients), and a 100 ms tick (liveness, deadlines, dispatch).
 * ZeroMQ sockets are watched through ZMQ_FD, which is edge-triggered and only says "look at
 * ZMQ_EVENTS": on each edge the sockets are drained until ZMQ_EVENTS shows no input, and since
 * any send can consume an edge, every send schedules another drain (a zero-delay timer). The
 * tick drains too, as a safety net. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/signalfd.h>
#include <unistd.h>
#include <zmq.h>

#include "pd/model.h"
#include "pd/opts.h"
#include "router.h"

/* ---- safe points ---- */

void router_retire(router *r, rreq *q) {
  if (q->retired) return;
  q->retired = true;
  q->next_gc = r->gc;
  r->gc = q;
}

void router_gc(router *r) {
  while (r->gc) {
    rreq *q = r->gc;
    r->gc = q->next_gc;
    api_req_free(r, q);
  }
}

char *router_error_json(int status, const char *msg, const char *code) {
  return pd_http_error_json(msg, pd_http_error_type(status), code, NULL);
}

/* ---- ZeroMQ on the event loop ---- */

static void drain_all(router *r);

static void drain_timer(pd_evloop *loop, uint64_t id, void *ud) {
  (void)loop;
  (void)id;
  router *r = ud;
  r->drain_scheduled = false;
  drain_all(r);
  router_gc(r);
}

void router_after_send(router *r) {
  if (r->drain_scheduled) return;
  uint64_t id;
  if (pd_evloop_timer_add(r->loop, 0, drain_timer, r, &id, NULL) == PD_OK) r->drain_scheduled = true;
}

static void send_stale_abort(router *r, const pd_net_msg *m, const char *id) {
  if (!id || !pd_wire_id_ok(id)) return;
  Pd__Abort a;
  pd__abort__init(&a);
  a.request_id = (char *)id;
  a.code = PD__ERROR_CODE__ERROR_CODE_NOT_FOUND;
  a.reason = "unknown to this router";
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_ABORT;
  env.abort = &a;
  env.sender = "router";
  pd_net_send(r->cluster_sock, m->routing_id, m->routing_id_len, &env, NULL, 0, NULL);
  router_after_send(r);
}

static void on_cluster_msg(router *r, const pd_net_msg *m) {
  const Pd__Envelope *env = m->wire.env;
  rnode *n = registry_find_rid(r, m->routing_id, m->routing_id_len);
  if (n && n->has_key &&
      (!m->has_peer_key || memcmp(m->peer_key, n->key, PD_CURVE_KEY_BYTES) != 0)) {
    /* the node's connection, another key: never expected (the routing id is the node's
     * secret), so dropped and reported */
    if (pd_log_limit_ok(&r->deny_log, "refusals"))
      pd_log(PD_LOG_WARN, "dropped a %s on node %s's connection: not sent with its key",
             pd_wire_body_name(env->body_case), n->id);
    return;
  }
  if (n) {
    pd_liveness_seen(r->live, n->id, pd_liveness_now_ms(), NULL);
    n->last_seen_ms = pd_now_ms();
  }
  switch (env->body_case) {
    case PD__ENVELOPE__BODY_REGISTER_NODE:
    case PD__ENVELOPE__BODY_HEARTBEAT:
    case PD__ENVELOPE__BODY_DEREGISTER:
      registry_on_message(r, m);
      break;
    case PD__ENVELOPE__BODY_RESERVE_REPLY:
    case PD__ENVELOPE__BODY_FIRST_TOKEN:
    case PD__ENVELOPE__BODY_TOKEN_STREAM:
    case PD__ENVELOPE__BODY_ERROR:
      if (n) {
        route_on_message(r, n, m);
      } else if (env->body_case == PD__ENVELOPE__BODY_FIRST_TOKEN) {
        send_stale_abort(r, m, env->first_token->request_id);
      } else if (env->body_case == PD__ENVELOPE__BODY_TOKEN_STREAM) {
        send_stale_abort(r, m, env->token_stream->request_id);
      } else if (env->body_case == PD__ENVELOPE__BODY_RESERVE_REPLY && env->reserve_reply->ok) {
        send_stale_abort(r, m, env->reserve_reply->request_id);
      }
      break;
    default:
      pd_net_send_error(r->cluster_sock, m->routing_id, m->routing_id_len,
                        PD__ERROR_CODE__ERROR_CODE_PROTOCOL, NULL, false,
                        "unexpected message on the cluster port", NULL);
      router_after_send(r);
      break;
  }
}

/* Receives one message from sock if there is one; returns whether one was consumed. */
static bool recv_one(router *r, void *sock, bool cluster) {
  int ev = 0;
  size_t sz = sizeof ev;
  if (zmq_getsockopt(sock, ZMQ_EVENTS, &ev, &sz) != 0 || !(ev & ZMQ_POLLIN)) return false;
  pd_net_msg m;
  pd_net_msg_init(&m);
  bool got = false;
  pd_err e = {0};
  pd_status st = pd_net_recv(sock, 0, &r->lim, &m, &got, &e);
  if (got && st != PD_OK) {
    pd_log(PD_LOG_WARN, "malformed message on the %s port: %s", cluster ? "cluster" : "client",
           e.msg);
    if (m.routing_id_len)
      pd_net_send_error(sock, m.routing_id, m.routing_id_len, pd_wire_error_code(st), NULL, false,
                        e.msg, NULL);
    router_after_send(r);
  } else if (got) {
    if (cluster) on_cluster_msg(r, &m);
    else zapi_on_message(r, &m);
  }
  pd_net_msg_clear(&m);
  return got;
}

static void drain_all(router *r) {
  for (int i = 0; i < 1024; i++) {
    bool any = recv_one(r, r->cluster_sock, true);
    if (r->client_sock) any |= recv_one(r, r->client_sock, false);
    if (!any) return;
  }
  router_after_send(r); /* more waiting: continue in the next iteration, after HTTP I/O */
}

static void on_zmq_fd(pd_evloop *loop, int fd, unsigned events, void *ud) {
  (void)loop;
  (void)fd;
  (void)events;
  router *r = ud;
  drain_all(r);
  router_gc(r);
}

/* ---- the tick ---- */

static void tick(pd_evloop *loop, uint64_t id, void *ud) {
  (void)id;
  router *r = ud;
  pd_curve_log_denials(r->auth, &r->deny_log);
  pd_hs_watch_drain(r->cluster_watch, &r->deny_log);
  pd_hs_watch_drain(r->client_watch, &r->deny_log);
  /* messages that waited while the loop was busy count as sightings before the sweep */
  drain_all(r);
  registry_sweep(r);
  for (rreq *q = r->all; q; q = q->next_all)
    if (q->cancelled && !q->finished) api_cancel(r, q);
  route_tick(r);
  router_gc(r);
  uint64_t tid;
  pd_evloop_timer_add(loop, 100, tick, r, &tid, NULL);
}

static int g_sigfd = -1;

static void on_signal(pd_evloop *loop, int fd, unsigned events, void *ud) {
  (void)events;
  (void)ud;
  struct signalfd_siginfo si;
  while (read(fd, &si, sizeof si) == (ssize_t)sizeof si) {
  }
  pd_log(PD_LOG_INFO, "signal received: shutting down");
  pd_evloop_stop(loop);
}

/* ---- flags ---- */

/* What a router without node authentication (no keypair, or no allow list) lets happen. */
static const char *unauthenticated(bool have_keys) {
  return have_keys ? "any process that knows the router's public key can join the cluster (no "
                     "--curve-allow-file)"
                   : "any process that reaches the cluster port can join the cluster and read "
                     "and change its requests (no CURVE keys)";
}

static int parse_opts(router_opts *o, int argc, char **argv) {
  memset(o, 0, sizeof *o);
  o->host = "127.0.0.1";
  o->bind = "127.0.0.1";
  o->port = 8000;
  o->cluster_port = 5600;
  o->client_port = 5601;
  o->max_queue = 256;
  o->max_n = 16;
  o->default_max_tokens = 16;
  o->max_body_mb = 8;
  o->max_prompt_mb = 4;
  o->tokenizer_threads = 4;
  o->max_connections = 4096;
  o->max_connections_per_ip = 1024;
  o->busy_timeout_ms = 2000;
  o->request_timeout_s = 600;
  o->kv_ttl_ms = 30000;
  o->remote_prefill_min_tokens = 1024;
  o->remote_prefill_max_queue = 16384;
  o->heartbeat_interval_ms = 500;
  o->heartbeat_timeout_ms = 2500;
  pd_opt opts[] = {
      {"model", PD_OPT_STR, &o->model_dir, "DIR", "model folder: tokenizer, chat template, "
       "context length (required)", NULL},
      {"served-model-name", PD_OPT_STR, &o->served_name, "NAME",
       "model name clients use (default: the folder's name)", NULL},
      {"host", PD_OPT_STR, &o->host, "HOST", "HTTP bind address (127.0.0.1)", NULL},
      {"port", PD_OPT_INT, &o->port, "N", "HTTP port (8000; 0 = a free one)", NULL},
      {"bind", PD_OPT_STR, &o->bind, "HOST", "ZeroMQ bind address (127.0.0.1)", NULL},
      {"cluster-port", PD_OPT_INT, &o->cluster_port, "N", "port nodes connect to (5600)", NULL},
      {"client-port", PD_OPT_INT, &o->client_port, "N",
       "ZeroMQ client API port (5601; -1 = off)", NULL},
      {"api-key", PD_OPT_STR, &o->api_key, "KEY",
       "require this key of clients: Authorization: Bearer KEY on HTTP, api_key in ZeroMQ "
       "requests (visible in ps: prefer --api-key-file or PD_API_KEY)", NULL},
      {"api-key-file", PD_OPT_STR, &o->api_key_file, "FILE",
       "the API key from a file (its first line)", NULL},
      {"allowed-origins", PD_OPT_STR, &o->allowed_origins, "LIST",
       "CORS: origins allowed to call the HTTP API from a browser, comma-separated, or * for "
       "any (off)", NULL},
      {"max-queue", PD_OPT_INT, &o->max_queue, "N", "choices waiting for capacity, and prompts "
       "waiting for the tokenizer, before 429; a request of more choices is a 400 (256)", NULL},
      {"max-n", PD_OPT_INT, &o->max_n, "N", "largest n (16)", NULL},
      {"default-max-tokens", PD_OPT_INT, &o->default_max_tokens, "N",
       "max_tokens of completions when absent (16)", NULL},
      {"max-model-len", PD_OPT_INT, &o->max_model_len, "N",
       "context length (default: the model's, capped by the nodes')", NULL},
      {"max-body-mb", PD_OPT_INT, &o->max_body_mb, "MB", "largest request body (8)", NULL},
      {"max-prompt-mb", PD_OPT_INT, &o->max_prompt_mb, "MB",
       "largest prompt text (or chat messages) per request, refused before tokenizing (4)", NULL},
      {"tokenizer-threads", PD_OPT_INT, &o->tokenizer_threads, "N",
       "threads that tokenize prompts and render chat templates off the event loop (4)", NULL},
      {"max-connections", PD_OPT_INT, &o->max_connections, "N", "open HTTP connections; when "
       "full, a new one takes the place of the oldest idle one (4096)", NULL},
      {"max-connections-per-ip", PD_OPT_INT, &o->max_connections_per_ip, "N",
       "open HTTP connections of one client address; 0 = no limit (1024)", NULL},
      {"busy-timeout-ms", PD_OPT_INT, &o->busy_timeout_ms, "MS",
       "header and keep-alive idle timeout while over 75% of --max-connections are open; 0 = "
       "off (2000)", NULL},
      {"request-timeout", PD_OPT_INT, &o->request_timeout_s, "S",
       "whole-request deadline in seconds (600)", NULL},
      {"kv-ttl-ms", PD_OPT_INT, &o->kv_ttl_ms, "MS",
       "lifetime of a decode reservation whose KV has not arrived (30000)", NULL},
      {"remote-prefill-min-tokens", PD_OPT_INT, &o->remote_prefill_min_tokens, "N",
       "with unified nodes: prompts with fewer tokens to compute (after the expected prefix-cache "
       "hit) are prefilled by the unified node that decodes them (1024; 0 = always remote while "
       "a prefill node has room)", NULL},
      {"remote-prefill-max-queue", PD_OPT_INT, &o->remote_prefill_max_queue, "N",
       "with unified nodes: prefill locally when every prefill node has more prompt tokens "
       "queued than this (16384)", NULL},
      {"heartbeat-interval-ms", PD_OPT_INT, &o->heartbeat_interval_ms, "MS",
       "heartbeat period asked of nodes (500)", NULL},
      {"heartbeat-timeout-ms", PD_OPT_INT, &o->heartbeat_timeout_ms, "MS",
       "silence after which a node is dead (2500)", NULL},
      {"curve-secret-file", PD_OPT_STR, &o->curve_secret_file, "FILE",
       "the router's CURVE keypair (zcert format)", NULL},
      {"curve-secret-key", PD_OPT_STR, &o->curve_secret_key, "Z85",
       "the router's CURVE secret key (visible in ps: prefer --curve-secret-file or "
       "PD_CURVE_SECRET_KEY)", NULL},
      {"curve-allow-file", PD_OPT_STR, &o->curve_allow_file, "FILE",
       "the nodes admitted on the cluster port: their public keys, one Z85 key per line "
       "(pdctl keys generate writes nodes.allow)", NULL},
      {"insecure", PD_OPT_BOOL, &o->insecure, NULL,
       "run without node authentication when no keypair or no allow list is given: any process "
       "that reaches the cluster port can join the cluster (logs a warning)", NULL},
      {"ready-file", PD_OPT_STR, &o->ready_file, "PATH",
       "write a JSON status file once listening", NULL},
      {"verbose", PD_OPT_BOOL, &o->verbose, NULL, "debug logs", NULL},
      {"help", PD_OPT_BOOL, &o->help, NULL, "show this help", NULL},
      {0}};
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 1, &e) != PD_OK) {
    fprintf(stderr, "pd-router: %s (see --help)\n", e.msg);
    return 1;
  }
  if (o->help) {
    printf("usage: pd-router --model DIR [--port N] [--cluster-port N] [options]\n");
    pd_opts_usage(stdout, opts);
    return 2;
  }
  const char *bad = NULL;
  if (!o->model_dir) bad = "--model DIR is required";
  else if (o->port < 0 || o->port > 65535 || o->cluster_port < 0 || o->cluster_port > 65535 ||
           o->client_port < -1 || o->client_port > 65535)
    bad = "ports must be in [0, 65535] (--client-port -1 = off)";
  else if (o->max_queue < 1 || o->max_n < 1 || o->max_n > PD_SAMPLE_MAX_N ||
           o->default_max_tokens < 1 || o->max_body_mb < 1 || o->max_connections < 1 ||
           o->max_prompt_mb < 1 || o->tokenizer_threads < 1 || o->tokenizer_threads > 64 ||
           o->max_connections_per_ip < 0 || o->busy_timeout_ms < 0 ||
           o->request_timeout_s < 1 || o->kv_ttl_ms < 100 || o->heartbeat_interval_ms < 10 ||
           o->heartbeat_timeout_ms < 2 * o->heartbeat_interval_ms || o->max_model_len < 0 ||
           o->remote_prefill_min_tokens < 0 || o->remote_prefill_max_queue < 0)
    bad = "a limit is out of range (see --help; --heartbeat-timeout-ms must be at least twice "
          "the interval, --max-n at most 128, --tokenizer-threads 1 to 64)";
  if (bad) {
    fprintf(stderr, "pd-router: %s\n", bad);
    return 1;
  }
  bool keys = (o->curve_secret_file && *o->curve_secret_file) ||
              (o->curve_secret_key && *o->curve_secret_key);
  if (!o->insecure && (!keys || !o->curve_allow_file || !*o->curve_allow_file)) {
    fprintf(stderr, "pd-router: refusing to start: %s; give --curve-secret-file FILE and "
            "--curve-allow-file FILE (`pdctl keys generate` writes both), or --insecure for a "
            "cluster without authentication\n", unauthenticated(keys));
    return 1;
  }
  return 0;
}

/* domain: the socket's ZAP domain ("cluster": member keys only; "client": any key). */
static pd_status bind_sock(router *r, int port, const char *domain, void **sock, char *ep,
                           size_t cap, pd_err *e) {
  pd_net_sock_opts so;
  pd_net_sock_opts_init(&so, ZMQ_ROUTER);
  so.sndhwm = so.rcvhwm = 100000;
  if (r->have_keys) {
    so.curve_keys = &r->keys;
    so.curve_server = true;
    so.zap_domain = r->auth ? domain : NULL;
  }
  *sock = pd_net_socket(r->zctx, &so, e);
  if (!*sock) return e->code;
  char want[300];
  snprintf(want, sizeof want, "tcp://%s:%s", r->o.bind, port ? "" : "*");
  if (port) snprintf(want, sizeof want, "tcp://%s:%d", r->o.bind, port);
  return pd_net_bind(*sock, want, ep, cap, e);
}

static pd_status watch(router *r, void *sock, int *fd, pd_err *e) {
  size_t sz = sizeof *fd;
  if (zmq_getsockopt(sock, ZMQ_FD, fd, &sz) != 0)
    return pd_err_set(e, PD_EIO, "ZMQ_FD: %s", zmq_strerror(zmq_errno()));
  return pd_evloop_add_fd(r->loop, *fd, PD_EV_READ | PD_EV_EDGE, on_zmq_fd, r, e);
}

static int endpoint_port(const char *ep) {
  const char *c = strrchr(ep, ':');
  return c ? atoi(c + 1) : -1;
}

int main(int argc, char **argv) {
  static router R;
  router *r = &R;
  int rc = parse_opts(&r->o, argc, argv);
  if (rc) return rc == 2 ? 0 : 1;
  pd_log_init("pd-router", r->o.verbose);
  signal(SIGPIPE, SIG_IGN);
  pd_crash_handlers_install("pd-router");
  pd_err e = {0};
  pd_model_config cfg;
  if (pd_model_config_load(r->o.model_dir, &cfg, &e) != PD_OK ||
      pd_model_fingerprint(r->o.model_dir, &r->fingerprint, &e) != PD_OK ||
      !(r->tok = pd_tokenizer_load(r->o.model_dir, &e))) {
    pd_log(PD_LOG_ERROR, "%s", e.msg);
    return 1;
  }
  if (pd_secret_opt("api-key", r->o.api_key, r->o.api_key_file, &r->api_key_owned, &e) != PD_OK) {
    pd_log(PD_LOG_ERROR, "%s", e.msg);
    return 1;
  }
  r->o.api_key = r->api_key_owned;
  if (r->o.served_name) snprintf(r->model_name, sizeof r->model_name, "%s", r->o.served_name);
  else pd_basename(r->o.model_dir, r->model_name, sizeof r->model_name);
  r->vocab_size = cfg.vocab_size;
  if (pd_tokenizer_vocab_size(r->tok) > r->vocab_size) r->vocab_size = pd_tokenizer_vocab_size(r->tok);
  r->max_model_len = r->o.max_model_len && r->o.max_model_len < cfg.max_position_embeddings
                         ? r->o.max_model_len
                         : cfg.max_position_embeddings;
  if (getrandom(&r->incarnation, sizeof r->incarnation, 0) != sizeof r->incarnation)
    r->incarnation = (uint64_t)pd_now_ms() ^ ((uint64_t)getpid() << 32);
  pd_wire_limits_init(&r->lim);
  r->lim.vocab_size = r->vocab_size;

  rmetrics_init(r);
  registry_init(r);
  route_init(r);
  pd_map_init(&r->zreqs, 0, PD_MAP_COPY_KEYS);
  r->loop = pd_evloop_new(&e);
  if (!r->loop) {
    pd_log(PD_LOG_ERROR, "%s", e.msg);
    return 1;
  }
  sigset_t ss;
  sigemptyset(&ss);
  sigaddset(&ss, SIGINT);
  sigaddset(&ss, SIGTERM);
  sigprocmask(SIG_BLOCK, &ss, NULL);
  g_sigfd = signalfd(-1, &ss, SFD_NONBLOCK | SFD_CLOEXEC);
  if (g_sigfd < 0 || pd_evloop_add_fd(r->loop, g_sigfd, PD_EV_READ, on_signal, r, &e) != PD_OK) {
    pd_log(PD_LOG_ERROR, "signalfd: %s", strerror(errno));
    return 1;
  }

  /* ZeroMQ: CURVE keys and the allow list come before any bind */
  if (pd_curve_keys_from_flags(r->o.curve_secret_file, r->o.curve_secret_key, &r->keys,
                               &r->have_keys, &e) != PD_OK ||
      !(r->zctx = pd_net_ctx_new(1, &e))) {
    pd_log(PD_LOG_ERROR, "%s", e.msg);
    return 1;
  }
  if (r->o.curve_allow_file && !r->have_keys) {
    pd_log(PD_LOG_ERROR, "--curve-allow-file needs the router's keypair (--curve-secret-file)");
    return 1;
  }
  if (r->o.curve_allow_file) {
    /* nodes: listed keys only (domain "cluster"); clients: any key (domain "client"), they
     * show the API key instead */
    if (!(r->auth = pd_curve_auth_start(r->zctx, &e)) ||
        pd_curve_allow_file(r->auth, r->o.curve_allow_file, &e) != PD_OK ||
        pd_curve_auth_open_domain(r->auth, "client", &e) != PD_OK) {
      pd_log(PD_LOG_ERROR, "%s", e.msg);
      return 1;
    }
  } else { /* --insecure (parse_opts refused the rest) */
    pd_log(PD_LOG_WARN, "--insecure: %s", unauthenticated(r->have_keys));
  }
  int status = 1;
  if (bind_sock(r, r->o.cluster_port, "cluster", &r->cluster_sock, r->cluster_ep,
                sizeof r->cluster_ep, &e) ||
      watch(r, r->cluster_sock, &r->cluster_fd, &e)) {
    pd_log(PD_LOG_ERROR, "cluster port: %s", e.msg);
    goto out;
  }
  if (r->o.client_port >= 0 &&
      (bind_sock(r, r->o.client_port, "client", &r->client_sock, r->client_ep,
                 sizeof r->client_ep, &e) ||
       watch(r, r->client_sock, &r->client_fd, &e))) {
    pd_log(PD_LOG_ERROR, "client port: %s", e.msg);
    goto out;
  }
  if (r->have_keys &&
      (!(r->cluster_watch = pd_hs_watch_start(r->zctx, r->cluster_sock, "cluster", &e)) ||
       (r->client_sock &&
        !(r->client_watch = pd_hs_watch_start(r->zctx, r->client_sock, "client", &e))))) {
    pd_log(PD_LOG_ERROR, "%s", e.msg);
    goto out;
  }
  if (!(r->pool = pd_workpool_new(r->loop, r->o.tokenizer_threads, &e))) {
    pd_log(PD_LOG_ERROR, "%s", e.msg);
    goto out;
  }
  pd_http_config hc;
  pd_http_config_default(&hc);
  hc.host = r->o.host;
  hc.port = r->o.port;
  hc.max_connections = r->o.max_connections;
  hc.max_connections_per_ip = r->o.max_connections_per_ip;
  hc.busy_timeout_ms = (uint32_t)r->o.busy_timeout_ms;
  hc.limits.max_body_bytes = (size_t)r->o.max_body_mb << 20;
  hc.allowed_origins = r->o.allowed_origins;
  hc.on_request = api_http_handler;
  hc.ud = r;
  r->http = pd_http_server_new(r->loop, &hc, &e);
  if (!r->http) {
    pd_log(PD_LOG_ERROR, "HTTP %s:%d: %s", r->o.host, r->o.port, e.msg);
    goto out;
  }
  uint64_t tid;
  pd_evloop_timer_add(r->loop, 100, tick, r, &tid, NULL);
  if (r->have_keys)
    pd_log(PD_LOG_INFO, "CURVE on: router public key %s; cluster port: %s", r->keys.public_z85,
           r->auth ? "listed node keys only" : "any key (encryption only)");
  if (r->client_sock)
    pd_log(PD_LOG_INFO, "client port: %s", r->o.api_key ? "requests must carry the API key"
                                                         : "open (no --api-key)");
  if (r->o.ready_file) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "pid", (double)getpid());
    cJSON_AddNumberToObject(o, "http_port", pd_http_server_port(r->http));
    cJSON_AddStringToObject(o, "cluster_endpoint", r->cluster_ep);
    cJSON_AddStringToObject(o, "client_endpoint", r->client_sock ? r->client_ep : "");
    if (r->have_keys) cJSON_AddStringToObject(o, "curve_public_key", r->keys.public_z85);
    if (pd_ready_file_write(r->o.ready_file, o, &e) != PD_OK) pd_log(PD_LOG_ERROR, "%s", e.msg);
    cJSON_Delete(o);
  }
  pd_log(PD_LOG_INFO, "ready: model %s (context %d), HTTP %s:%d, cluster port %d, client port %d",
         r->model_name, r->max_model_len, r->o.host, pd_http_server_port(r->http),
         endpoint_port(r->cluster_ep), r->client_sock ? endpoint_port(r->client_ep) : -1);
  if (pd_evloop_run(r->loop, &e) != PD_OK) pd_log(PD_LOG_ERROR, "event loop: %s", e.msg);
  status = 0;
out:
  for (rreq *q = r->all; q; q = q->next_all)
    if (!q->finished) api_cancel(r, q);
  router_gc(r); /* detaches the jobs of the requests it frees */
  pd_workpool_free(r->pool); /* waits for running jobs; their results are dropped */
  r->pool = NULL;
  router_gc(r);
  if (r->http) pd_http_server_free(r->http);
  router_gc(r);
  if (r->cluster_sock) pd_evloop_del_fd(r->loop, r->cluster_fd);
  if (r->client_sock) pd_evloop_del_fd(r->loop, r->client_fd);
  pd_hs_watch_stop(r->cluster_watch);
  pd_hs_watch_stop(r->client_watch);
  pd_net_close(r->cluster_sock);
  pd_net_close(r->client_sock);
  pd_curve_auth_stop(r->auth);
  pd_net_ctx_free(r->zctx);
  if (g_sigfd >= 0) {
    pd_evloop_del_fd(r->loop, g_sigfd);
    close(g_sigfd);
  }
  pd_evloop_free(r->loop);
  registry_free(r);
  route_free(r);
  pd_map_free(&r->zreqs);
  pd_metrics_free(r->m.reg);
  pd_tokenizer_free(r->tok);
  pd_secret_free(r->api_key_owned);
  return status;
}
