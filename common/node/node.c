/* pd_node: the part of pd-prefill and pd-decode that is not about their role (node.h). */
#include <malloc.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>
#include <zmq.h>

#include "node.h"
#include "pd/kvcache.h"

/* ---- flags ---- */

/* What a node lacks to prove its membership: ", --flag (why)" for each, "" when nothing. */
static void membership_missing(const pd_node_opts *o, bool decode, char *out, size_t cap) {
  out[0] = 0;
  size_t k = 0;
  if ((!o->curve_secret_file || !*o->curve_secret_file) &&
      (!o->curve_secret_key || !*o->curve_secret_key))
    k += (size_t)snprintf(out + k, cap - k, ", --curve-secret-file FILE (this node's keypair)");
  if ((!o->router_public_key || !*o->router_public_key) && k < cap)
    k += (size_t)snprintf(out + k, cap - k, ", --router-public-key KEY|FILE");
  if (decode && (!o->curve_allow_file || !*o->curve_allow_file) && k < cap)
    snprintf(out + k, cap - k, ", --curve-allow-file FILE (the keys its KV port admits)");
}

int pd_node_opts_parse(pd_node_opts *o, Pd__Role role, int argc, char **argv) {
  memset(o, 0, sizeof *o);
  pd_runtime_opts_default(&o->rt);
  o->router_ep = "tcp://127.0.0.1:5600";
  o->bind = "127.0.0.1";
  o->kv_chunk_mb = 4;
  o->kv_pinned_mb = 256;
  o->kv_crc_threads = 4;
  o->kv_budget_ms = -1.0;
  bool decode = role == PD__ROLE__ROLE_DECODE;
  pd_opt opts[64] = {
      {"model", PD_OPT_STR, &o->model_dir, "DIR", "Hugging Face model folder (required)", NULL},
      {"served-model-name", PD_OPT_STR, &o->served_name, "NAME",
       "model name clients use (default: the folder's name)", NULL},
      {"router", PD_OPT_STR, &o->router_ep, "ENDPOINT",
       "the router's cluster port (tcp://127.0.0.1:5600)", NULL},
      {"node-id", PD_OPT_STR, &o->node_id, "ID", "unique node name (default <role>-<host>-<pid>)",
       NULL},
      {"bind", PD_OPT_STR, &o->bind, "HOST", "bind address of the KV and metrics ports (127.0.0.1)",
       NULL},
      {"advertise-host", PD_OPT_STR, &o->advertise, "HOST",
       "host others use to reach this node (default: --bind)", NULL},
      {"kv-port", PD_OPT_INT, &o->kv_port, "N", "decode: KV port (0 = a free one)", NULL},
      {"metrics-port", PD_OPT_INT, &o->metrics_port, "N",
       "HTTP /metrics and /health port (0 = a free one, -1 = off)", NULL},
      {"kv-chunk-mb", PD_OPT_INT, &o->kv_chunk_mb, "MB", "prefill: KV bytes per message (4)",
       NULL},
      {"kv-pinned-mb", PD_OPT_INT, &o->kv_pinned_mb, "MB",
       "on a GPU: page-locked memory for KV messages: prefill: outgoing frames; decode: one "
       "receive buffer as large as the largest message (256, 0 = off)",
       NULL},
      {"kv-crc-threads", PD_OPT_INT, &o->kv_crc_threads, "N",
       "threads that checksum a KV message, the loop's included (4; 0 or 1 = the loop only)",
       NULL},
      {"kv-budget-ms", PD_OPT_DOUBLE, &o->kv_budget_ms, "MS",
       "decode: time a loop turn spends on received KV pages while sequences decode (default: "
       "about one step, 2-20 ms; 0 = everything queued)", NULL},
      {"curve-secret-file", PD_OPT_STR, &o->curve_secret_file, "FILE",
       "this node's CURVE keypair (zcert format)", NULL},
      {"curve-secret-key", PD_OPT_STR, &o->curve_secret_key, "Z85",
       "this node's CURVE secret key (visible in ps: prefer --curve-secret-file or "
       "PD_CURVE_SECRET_KEY)", NULL},
      {"router-public-key", PD_OPT_STR, &o->router_public_key, "Z85|FILE",
       "the router's CURVE public key, or a key file holding it (router.pub)", NULL},
      {"curve-allow-file", PD_OPT_STR, &o->curve_allow_file, "FILE",
       "decode: the keys admitted on the KV port, one Z85 public key per line (nodes.allow)",
       NULL},
      {"insecure", PD_OPT_BOOL, &o->insecure, NULL,
       "run without the cluster's keys (no keypair, router key or, on a decode node, allow "
       "list): the router cannot tell this node from another process, and any process can "
       "send KV pages to a decode node (logs a warning)", NULL},
      {"ready-file", PD_OPT_STR, &o->ready_file, "PATH",
       "write a JSON status file once registered", NULL},
      {"unified", PD_OPT_BOOL, &o->unified, NULL,
       "decode: also prefill the prompts it decodes, in its own batch (a unified node: the "
       "router sends it whole requests when local prefill pays, see --remote-prefill-min-tokens)",
       NULL},
      {"fail-device-after", PD_OPT_INT, &o->fail_device_after, "N",
       "testing: make the device fail after N steps (a trapping kernel on a GPU), to exercise "
       "what follows: the node leaves the cluster and exits with status 3 (0 = never)",
       NULL},
      {"verbose", PD_OPT_BOOL, &o->verbose, NULL, "debug logs", NULL},
      {"help", PD_OPT_BOOL, &o->help, NULL, "show this help", NULL},
  };
  int n0 = 0;
  while (opts[n0].name) n0++;
  if (pd_runtime_opts_table(&o->rt, opts + n0, 64 - n0) < 0) {
    fprintf(stderr, "%s: the option table is too small\n", decode ? "pd-decode" : "pd-prefill");
    return 1;
  }
  const char *prog = decode ? "pd-decode" : "pd-prefill";
  pd_err e = {0};
  if (pd_opts_parse(opts, argc, argv, 1, &e) != PD_OK) {
    fprintf(stderr, "%s: %s (see --help)\n", prog, e.msg);
    return 1;
  }
  if (o->help) {
    printf("usage: %s --model DIR [--router tcp://HOST:PORT] [options]\n", prog);
    pd_opts_usage(stdout, opts);
    return 2;
  }
  if (!o->model_dir) {
    fprintf(stderr, "%s: --model DIR is required\n", prog);
    return 1;
  }
  if (o->kv_port < 0 || o->kv_port > 65535 || o->metrics_port < -1 || o->metrics_port > 65535) {
    fprintf(stderr, "%s: ports must be in [0, 65535] (--metrics-port -1 = off)\n", prog);
    return 1;
  }
  if (o->fail_device_after < 0) {
    fprintf(stderr, "%s: --fail-device-after must be at least 0\n", prog);
    return 1;
  }
  if (o->kv_chunk_mb < 1 || o->kv_chunk_mb > 64) {
    fprintf(stderr, "%s: --kv-chunk-mb must be in [1, 64]\n", prog);
    return 1;
  }
  if (o->kv_pinned_mb < 0 || o->kv_pinned_mb > 1048576) {
    fprintf(stderr, "%s: --kv-pinned-mb must be in [0, 1048576]\n", prog);
    return 1;
  }
  if (!(o->kv_budget_ms == -1.0 || (o->kv_budget_ms >= 0.0 && o->kv_budget_ms <= 10000.0))) {
    fprintf(stderr, "%s: --kv-budget-ms must be in [0, 10000]\n", prog);
    return 1;
  }
  if (o->unified && !decode) {
    fprintf(stderr, "%s: --unified is a decode node's flag\n", prog);
    return 1;
  }
  if (o->kv_crc_threads < 0 || o->kv_crc_threads > 64) {
    fprintf(stderr, "%s: --kv-crc-threads must be in [0, 64]\n", prog);
    return 1;
  }
  if (o->node_id && !pd_wire_id_ok(o->node_id)) {
    fprintf(stderr, "%s: --node-id must be 1..128 bytes of [A-Za-z0-9._:/@+-]\n", prog);
    return 1;
  }
  /* membership: a keypair, the router's key and (decode) the keys its KV port admits */
  char missing[256];
  membership_missing(o, decode, missing, sizeof missing);
  if (missing[0] && !o->insecure) {
    fprintf(stderr, "%s: refusing to start: a node proves it belongs to the cluster with%s "
            "(`pdctl keys generate` writes them); --insecure runs without\n", prog, missing + 1);
    return 1;
  }
  return 0;
}

/* ---- helpers ---- */


static void pages_geometry(const pd_kv_pages *p, Pd__KvGeometry *g) {
  pd__kv_geometry__init(g);
  g->num_layers = (uint32_t)p->num_layers;
  g->num_kv_heads = (uint32_t)p->num_kv_heads;
  g->head_dim = (uint32_t)p->head_dim;
  g->block_size = (uint32_t)p->block_size;
  g->dtype = pd_wire_dtype_from_pd(p->dtype);
  g->total_blocks = (uint32_t)p->num_blocks;
  g->kv_head_begin = (uint32_t)p->head_offset;
  g->kv_head_end = (uint32_t)(p->head_offset + p->num_kv_heads);
}

void pd_node_geometry(const pd_node *n, Pd__KvGeometry *g) { pages_geometry(&n->pages, g); }
void pd_node_draft_geometry(const pd_node *n, Pd__KvGeometry *g) {
  pages_geometry(&n->draft_pages, g);
}

void pd_node_logprob(const pd_logprobs *lp, Pd__TokenLogprob *out, Pd__TopLogprob **top_buf,
                     Pd__TopLogprob *top_store) {
  pd__token_logprob__init(out);
  out->token_id = lp->token;
  out->logprob = lp->logprob > 0 ? 0 : lp->logprob;
  out->rank = (uint32_t)(lp->rank > 0 ? lp->rank : 1);
  int k = lp->n_top < 0 ? 0 : lp->n_top > PD_SAMPLE_MAX_LOGPROBS ? PD_SAMPLE_MAX_LOGPROBS : lp->n_top;
  for (int i = 0; i < k; i++) {
    pd__top_logprob__init(&top_store[i]);
    top_store[i].token_id = lp->top[i].id;
    top_store[i].logprob = lp->top[i].logprob > 0 ? 0 : lp->top[i].logprob;
    top_buf[i] = &top_store[i];
  }
  out->n_top = (size_t)k;
  out->top = k ? top_buf : NULL;
}

/* Measured on a 2-core VM (glibc 2.36), 4 MiB frames memcpy'd into and freed by another thread
 * in bursts of 16: 40 page faults and 0.45 ms a frame with glibc's defaults, 24 (the heap's
 * first growth) and 0.38 ms with these; a frame mmapped each time (above the threshold) takes
 * 1025 faults and 2.0 ms, against 0.09 ms for a reused buffer. */
void pd_node_tune_malloc(void) {
  if (!mallopt(M_MMAP_THRESHOLD, 32 << 20) || !mallopt(M_TRIM_THRESHOLD, 256 << 20))
    pd_log(PD_LOG_DEBUG, "mallopt refused (not glibc's malloc?): KV frames may be mmapped");
}

pd_status pd_node_kv_pack(pd_node *n, const pd_kv_slice *s, const int32_t *ids, int nb,
                          size_t off, void *buf, size_t len, pd_err *e) {
  if (n->kvstage)
    return pd_kvstage_pack_range(n->kvstage, &n->pages, s, ids, nb, off, buf, len, e);
  return pd_kvpack_pack_range(&n->pages, s, ids, nb, off, buf, len, e);
}

pd_status pd_node_kv_unpack(pd_node *n, const pd_kv_slice *s, const int32_t *ids, int nb,
                            size_t off, const void *buf, size_t len, pd_err *e) {
  if (n->kvstage)
    return pd_kvstage_unpack_range(n->kvstage, &n->pages, s, ids, nb, off, buf, len, e);
  return pd_kvpack_unpack_range(&n->pages, s, ids, nb, off, buf, len, e);
}

pd_status pd_node_draft_kv_pack(pd_node *n, const pd_kv_slice *s, const int32_t *ids, int nb,
                                size_t off, void *buf, size_t len, pd_err *e) {
  if (!n->draft_pages.num_layers) return pd_err_set(e, PD_EINVAL, "no draft model");
  if (n->draft_kvstage)
    return pd_kvstage_pack_range(n->draft_kvstage, &n->draft_pages, s, ids, nb, off, buf, len, e);
  return pd_kvpack_pack_range(&n->draft_pages, s, ids, nb, off, buf, len, e);
}

pd_status pd_node_draft_kv_unpack(pd_node *n, const pd_kv_slice *s, const int32_t *ids, int nb,
                                  size_t off, const void *buf, size_t len, pd_err *e) {
  if (!n->draft_pages.num_layers) return pd_err_set(e, PD_EINVAL, "no draft model");
  if (n->draft_kvstage)
    return pd_kvstage_unpack_range(n->draft_kvstage, &n->draft_pages, s, ids, nb, off, buf, len,
                                   e);
  return pd_kvpack_unpack_range(&n->draft_pages, s, ids, nb, off, buf, len, e);
}

void *pd_node_kv_rx_buf(pd_node *n, size_t len) {
  if (len == 0 || len > n->kv_rx_cap) return NULL;
  if (len <= n->kv_rx_bytes) return n->kv_rx;
  pd_backend *be = n->rt.be;
  const size_t mib = (size_t)1 << 20;
  size_t want = (len + mib - 1) & ~(mib - 1); /* whole MiB: fewer regrowths */
  if (want > n->kv_rx_cap) want = n->kv_rx_cap; /* >= len */
  void *p = be->ops.host_alloc(be, want);
  if (!p) {
    pd_log(PD_LOG_WARN, "page-locked KV receive buffer: host_alloc of %zu bytes refused; "
           "messages over %zu bytes are unpacked from their frames", want, n->kv_rx_bytes);
    n->kv_rx_cap = n->kv_rx_bytes;
    return NULL;
  }
  if (n->kv_rx) be->ops.host_free(be, n->kv_rx);
  n->kv_rx = p;
  n->kv_rx_bytes = want;
  return p;
}

/* ---- sending ---- */

void pd_node_send(pd_node *n, Pd__Envelope *env) {
  pd_err e = {0};
  if (pd_outbox_send(&n->router, env, NULL, NULL, 0, &e) != PD_OK)
    pd_log(PD_LOG_ERROR, "cannot send %s to the router: %s", pd_wire_body_name(env->body_case),
           e.msg);
}

void pd_node_send_error(pd_node *n, Pd__ErrorCode code, const char *request_id, bool retryable,
                        const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  /* keep the message printable ASCII (the wire wants UTF-8; engine messages are ASCII) */
  for (char *p = msg; *p; p++)
    if ((unsigned char)*p < 0x20 || (unsigned char)*p > 0x7e) *p = '?';
  Pd__Error err;
  pd__error__init(&err);
  err.code = code;
  err.message = msg;
  err.request_id = (char *)(request_id && pd_wire_id_ok(request_id) ? request_id : "");
  err.retryable = retryable;
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_ERROR;
  env.error = &err;
  pd_node_send(n, &env);
}

static void send_register(pd_node *n) {
  Pd__Register r;
  pd__register__init(&r);
  r.node_id = n->node_id;
  r.role = n->role;
  r.model = n->model_name;
  r.model_fingerprint = n->fingerprint;
  r.incarnation = n->incarnation;
  r.kv_endpoint = n->kv_endpoint;
  if (n->kv_curve) {
    r.kv_curve_public_key.data = n->kv_public_key;
    r.kv_curve_public_key.len = PD_CURVE_KEY_BYTES;
  }
  Pd__KvGeometry g;
  pd_node_geometry(n, &g);
  r.kv = &g;
  r.vocab_size = (uint32_t)n->rt.model->cfg.vocab_size;
  r.max_model_len = (uint32_t)pd_engine_get_opts(n->rt.eng)->max_model_len;
  r.tp_size = 1;
  r.max_batch_tokens = (uint32_t)pd_engine_get_opts(n->rt.eng)->max_batch_tokens;
  r.unified = n->o.unified;
  Pd__KvGeometry dg;
  if (n->draft_pages.num_layers) {
    pd_node_draft_geometry(n, &dg);
    r.draft_kv = &dg;
    r.draft_fingerprint = n->draft_fingerprint;
  }
  Pd__Load load;
  pd__load__init(&load);
  if (n->hooks.fill_load) n->hooks.fill_load(n, &load);
  r.load = &load;
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_REGISTER_NODE;
  env.register_node = &r;
  pd_node_send(n, &env);
}

/* ---- the heartbeat thread ---- */

static void *hb_main(void *ud) {
  pd_node *n = ud;
  pd_err e = {0};
  char rid[sizeof n->rid + 3];
  snprintf(rid, sizeof rid, "%s/hb", n->rid);
  pd_net_sock_opts so;
  pd_net_sock_opts_init(&so, ZMQ_DEALER);
  so.routing_id = rid;
  so.send_timeout_ms = 0;
  so.sndhwm = 4; /* a heartbeat that cannot leave now is stale by the next one */
  if (n->router_key[0]) {
    so.curve_keys = &n->keys;
    so.curve_server_key = n->router_key;
  }
  void *sock = pd_net_socket(n->zctx, &so, &e);
  if (!sock || pd_net_connect(sock, n->o.router_ep, &e) != PD_OK) {
    pd_log(PD_LOG_ERROR, "heartbeat socket: %s", e.msg);
    pd_net_close(sock);
    return NULL;
  }
  pd_wire_limits lim;
  pd_wire_limits_init(&lim);
  pd_net_msg m;
  pd_net_msg_init(&m);
  uint64_t seq = 0;
  int64_t next = 0;
  while (!atomic_load(&n->hb_stop)) {
    int64_t now = pd_now_ms();
    if (atomic_load(&n->hb_registered) && now >= next) {
      next = now + atomic_load(&n->hb_interval_ms);
      if (now - atomic_load(&n->hb_progress_ms) < PD_NODE_STALL_MS) {
        Pd__Heartbeat h;
        pd__heartbeat__init(&h);
        h.node_id = n->node_id;
        h.seq = ++seq;
        Pd__Load load;
        pthread_mutex_lock(&n->hb_mu);
        load = n->hb_load;
        pthread_mutex_unlock(&n->hb_mu);
        h.load = &load;
        Pd__Envelope env;
        pd_wire_envelope_init(&env);
        env.body_case = PD__ENVELOPE__BODY_HEARTBEAT;
        env.heartbeat = &h;
        env.sender = n->node_id;
        env.seq = seq;
        pd_net_send(sock, NULL, 0, &env, NULL, 0, NULL); /* PD_EFULL: the next one will do */
      }
    }
    bool got = false;
    pd_status st = pd_net_recv(sock, 50, &lim, &m, &got, &e);
    if (got && st == PD_OK && m.wire.env->body_case == PD__ENVELOPE__BODY_HEARTBEAT_ACK) {
      atomic_store(&n->hb_last_ack_ms, pd_now_ms());
      if (m.wire.env->heartbeat_ack->reregister) atomic_store(&n->hb_reregister, true);
    } else if (!got && st != PD_OK) {
      break; /* the context is going away */
    }
  }
  pd_net_msg_clear(&m);
  pd_net_close(sock);
  return NULL;
}

void pd_node_deregister(pd_node *n, const char *reason, int timeout_ms) {
  if (!n->router_sock) return;
  Pd__Deregister d;
  pd__deregister__init(&d);
  d.node_id = n->node_id;
  d.reason = (char *)reason;
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_DEREGISTER;
  env.deregister = &d;
  pd_node_send(n, &env);
  int64_t end = pd_now_ms() + timeout_ms;
  while (pd_outbox_flush(&n->router) > 0 && pd_now_ms() < end) usleep(5000);
  usleep(20000); /* let the I/O thread put the last message on the wire (linger is 0) */
}

/* ---- the loop's share ---- */

static void write_ready(pd_node *n) {
  if (n->ready_written || !n->o.ready_file) return;
  cJSON *o = cJSON_CreateObject();
  cJSON_AddNumberToObject(o, "pid", (double)getpid());
  cJSON_AddStringToObject(o, "node_id", n->node_id);
  cJSON_AddStringToObject(o, "role", n->role == PD__ROLE__ROLE_DECODE ? "decode" : "prefill");
  cJSON_AddNumberToObject(o, "metrics_port", n->metrics_srv ? pd_metrics_server_port(n->metrics_srv) : -1);
  cJSON_AddStringToObject(o, "kv_endpoint", n->kv_endpoint);
  pd_err e = {0};
  if (pd_ready_file_write(n->o.ready_file, o, &e) != PD_OK) pd_log(PD_LOG_ERROR, "%s", e.msg);
  else n->ready_written = true;
  cJSON_Delete(o);
}

static void on_register_ack(pd_node *n, const Pd__RegisterAck *a) {
  int64_t now = pd_now_ms();
  if (!a->accepted) {
    pd_log(PD_LOG_ERROR, "the router refused the registration: %s",
           a->error && a->error->message ? a->error->message : "(no reason)");
    n->next_register_ms = now + 5000;
    return;
  }
  if (n->router_incarnation && a->router_incarnation != n->router_incarnation &&
      n->hooks.on_router_reset) {
    pd_log(PD_LOG_WARN, "the router restarted: dropping the requests of its predecessor");
    n->hooks.on_router_reset(n);
  }
  bool again = n->router_incarnation != 0;
  n->router_incarnation = a->router_incarnation;
  n->registered = true;
  n->hb_timeout_ms = a->heartbeat_timeout_ms ? a->heartbeat_timeout_ms : 2500;
  atomic_store(&n->hb_interval_ms, a->heartbeat_interval_ms ? a->heartbeat_interval_ms : 500);
  atomic_store(&n->hb_last_ack_ms, now);
  atomic_store(&n->hb_reregister, false);
  atomic_store(&n->hb_registered, true);
  atomic_store(&n->healthy, true);
  pd_metric_set(n->m_registered, 1);
  pd_log(PD_LOG_INFO, "registered with the router at %s as %s (heartbeat %u ms)%s",
         n->o.router_ep, n->node_id, atomic_load(&n->hb_interval_ms), again ? "" : "; ready");
  write_ready(n);
}

void pd_node_drain_router(pd_node *n) {
  pd_net_msg m;
  pd_net_msg_init(&m);
  for (int i = 0; i < 10000; i++) {
    bool got = false;
    pd_err e = {0};
    pd_status st = pd_net_recv(n->router_sock, 0, &n->lim, &m, &got, &e);
    if (!got) {
      if (st != PD_OK) pd_log(PD_LOG_ERROR, "router socket: %s", e.msg);
      break;
    }
    if (st != PD_OK) {
      pd_log(PD_LOG_WARN, "dropped a malformed message from the router: %s", e.msg);
      continue;
    }
    const Pd__Envelope *env = m.wire.env;
    switch (env->body_case) {
      case PD__ENVELOPE__BODY_REGISTER_ACK:
        on_register_ack(n, env->register_ack);
        break;
      case PD__ENVELOPE__BODY_HEARTBEAT_ACK: /* heartbeats go on their own socket */
        break;
      default:
        if (n->hooks.on_router_msg) n->hooks.on_router_msg(n, env);
        break;
    }
  }
  pd_net_msg_clear(&m);
}

int64_t pd_node_tick(pd_node *n) {
  int64_t now = pd_now_ms();
  atomic_store(&n->hb_progress_ms, now);
  pd_curve_log_denials(n->auth, &n->deny_log);
  if (now >= n->next_load_ms) { /* the snapshot the heartbeat thread sends */
    Pd__Load load;
    pd__load__init(&load);
    if (n->hooks.fill_load) n->hooks.fill_load(n, &load);
    pthread_mutex_lock(&n->hb_mu);
    n->hb_load = load;
    pthread_mutex_unlock(&n->hb_mu);
    n->next_load_ms = now + 100;
  }
  if (atomic_exchange(&n->hb_reregister, false) && n->registered) {
    pd_log(PD_LOG_WARN, "the router does not know this node: registering again");
    if (n->hooks.on_router_reset) n->hooks.on_router_reset(n);
    n->registered = false;
    n->next_register_ms = 0;
    atomic_store(&n->hb_registered, false);
    pd_metric_set(n->m_registered, 0);
  }
  if (!n->registered) {
    atomic_store(&n->healthy, false);
    if (now >= n->next_register_ms) {
      /* a Register stuck behind an absent router would only pile up: send when the queue is
       * empty (the DEALER refuses messages while it has no connection) */
      if (n->router.n_msgs == 0) send_register(n);
      n->next_register_ms = now + 1000;
    }
  } else {
    bool ok = now - atomic_load(&n->hb_last_ack_ms) < (int64_t)n->hb_timeout_ms;
    atomic_store(&n->healthy, ok);
  }
  pd_outbox_flush(&n->router);
  int64_t wait = n->registered ? 100 : n->next_register_ms - now;
  if (n->router.n_msgs) wait = wait < 5 ? wait : 5;
  return wait < 0 ? 0 : wait;
}

bool pd_node_check_device(pd_node *n) {
  if (n->device_failed) return true;
  pd_backend *be = n->rt.be;
  if (n->o.fail_device_after > 0 && !n->fault_injected && be->ops.inject_fault) {
    pd_sched_stats s;
    pd_sched_get_stats(n->rt.sched, &s);
    if (s.steps >= (uint64_t)n->o.fail_device_after) {
      pd_log(PD_LOG_WARN, "--fail-device-after %d: failing the device now", n->o.fail_device_after);
      n->fault_injected = true;
      be->ops.inject_fault(be);
    }
  }
  pd_err e = {0};
  if (pd_backend_status(be, &e) == PD_OK) return false;
  n->device_failed = true;
  atomic_store(&n->healthy, false);
  pd_log(PD_LOG_ERROR, "the device failed: %s; leaving the cluster (exit status %d)", e.msg,
         PD_NODE_EXIT_DEVICE);
  char why[PD_ERR_MSG_MAX + 32];
  snprintf(why, sizeof why, "device failed: %s", e.msg);
  for (char *p = why; *p; p++) /* the wire wants UTF-8; keep the reason printable ASCII */
    if ((unsigned char)*p < 0x20 || (unsigned char)*p > 0x7e) *p = '?';
  pd_node_deregister(n, why, 1000);
  pd_node_stop_flag = 1;
  return true;
}

void pd_node_update_metrics(pd_node *n) {
  pd_sched_stats s;
  pd_sched_get_stats(n->rt.sched, &s);
  pd_kv_stats ks;
  pd_kv_pool_stats(n->rt.pool, &ks);
  pd_metric_set(n->m_running, s.running);
  pd_metric_set(n->m_waiting, s.waiting);
  pd_metric_set(n->m_kv_usage, ks.usage);
  pd_metric_set(n->m_kv_free, ks.free + ks.evictable);
  pd_metric_set(n->m_kv_total, ks.num_blocks);
  pd_metric_add(n->m_gen_tokens, (double)(s.generated_tokens - n->last_stats.generated_tokens));
  pd_metric_add(n->m_prompt_tokens, (double)(s.prompt_tokens - n->last_stats.prompt_tokens));
  pd_metric_add(n->m_steps, (double)(s.steps - n->last_stats.steps));
  pd_metric_add(n->m_preemptions, (double)(s.preemptions - n->last_stats.preemptions));
  double q = pd_metric_value(n->m_prefix_queries), h = pd_metric_value(n->m_prefix_hits);
  pd_metric_add(n->m_prefix_queries, (double)ks.prefix_queries - q);
  pd_metric_add(n->m_prefix_hits, (double)ks.prefix_hits - h);
  pd_metric_set(n->m_prefix_rate, ks.prefix_queries ? (double)ks.prefix_hits / (double)ks.prefix_queries : 0);
  uint64_t replays = 0;
  pd_engine_graph_stats(n->rt.eng, &replays, NULL);
  pd_metric_add(n->m_graph_replays, (double)replays - pd_metric_value(n->m_graph_replays));
  if (n->m_spec_len) {
    const pd_sched_stats *o = &n->last_stats;
    pd_metric_add(n->m_spec_proposed, (double)(s.spec_proposed - o->spec_proposed));
    pd_metric_add(n->m_spec_accepted, (double)(s.spec_accepted - o->spec_accepted));
    pd_metric_add(n->m_spec_verify_s, s.spec_verify_seconds - o->spec_verify_seconds);
    pd_metric_add(n->m_spec_draft_s, s.spec_draft_seconds - o->spec_draft_seconds);
    pd_metric_add(n->m_spec_draft_steps, (double)(s.spec_draft_steps - o->spec_draft_steps));
    for (int j = 1; j < PD_SPEC_MAX_K + 2; j++)
      for (uint64_t c = o->spec_emitted_hist[j]; c < s.spec_emitted_hist[j]; c++)
        pd_metric_observe(n->m_spec_len, j);
  }
  n->last_stats = s;
}

/* ---- open / close ---- */

static void default_node_id(pd_node *n) {
  char host[64] = "local";
  gethostname(host, sizeof host - 1);
  host[sizeof host - 1] = 0;
  for (char *p = host; *p; p++) {
    char c = *p;
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '-' || c == '_';
    if (!ok) *p = '_';
  }
  snprintf(n->node_id, sizeof n->node_id, "%s-%.60s-%d",
           n->role == PD__ROLE__ROLE_DECODE ? "decode" : "prefill", host, (int)getpid());
}

static void init_metrics(pd_node *n) {
  pd_metrics *m = n->metrics;
  n->m_registered = pd_metrics_gauge(m, "pd_node_registered",
                                     "1 while the router has accepted this node", NULL);
  n->m_running = pd_metrics_gauge(m, "pd_node_running_seqs", "Sequences in the running batch.",
                                  NULL);
  n->m_waiting = pd_metrics_gauge(m, "pd_node_waiting_seqs",
                                  "Sequences admitted but not running (queued, preempted).", NULL);
  n->m_kv_usage = pd_metrics_gauge(m, "pd_node_kv_cache_usage_ratio",
                                   "Fraction of KV blocks in use (0..1).", NULL);
  n->m_kv_free = pd_metrics_gauge(m, "pd_node_kv_blocks_free",
                                  "KV blocks free or evictable.", NULL);
  n->m_kv_total = pd_metrics_gauge(m, "pd_node_kv_blocks_capacity", "KV blocks in the cache.",
                                   NULL);
  n->m_graph_replays = pd_metrics_counter(m, "pd_node_graph_replays_total",
                                          "Decode steps replayed from recorded device graphs.",
                                          NULL);
  n->m_prefix_queries = pd_metrics_counter(m, "pd_node_prefix_cache_queries_total",
                                           "Prompt tokens looked up in the prefix cache.", NULL);
  n->m_prefix_hits = pd_metrics_counter(m, "pd_node_prefix_cache_hits_total",
                                        "Prompt tokens served from the prefix cache.", NULL);
  n->m_prefix_rate = pd_metrics_gauge(m, "pd_node_prefix_cache_hit_rate",
                                      "Prefix-cache hits over queries since start (0..1).", NULL);
  n->m_gen_tokens = pd_metrics_counter(m, "pd_node_generation_tokens_total",
                                       "Tokens sampled by this node.", NULL);
  n->m_prompt_tokens = pd_metrics_counter(m, "pd_node_prompt_tokens_total",
                                          "Context tokens admitted for prefill.", NULL);
  n->m_steps = pd_metrics_counter(m, "pd_node_steps_total", "Forward passes run.", NULL);
  n->m_step_seconds = pd_metrics_histogram(m, "pd_node_step_seconds",
                                           "Duration of one scheduler step.", NULL,
                                           pd_metrics_fine_buckets, pd_metrics_fine_buckets_n);
  n->m_preemptions = pd_metrics_counter(m, "pd_node_preemptions_total",
                                        "Sequences preempted for lack of KV blocks.", NULL);
  if (n->rt.spec.method != PD_SPEC_NONE) {
    char l[64];
    snprintf(l, sizeof l, "method=\"%s\"", pd_spec_method_name(n->rt.spec.method));
    static const double len_bounds[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17};
    n->m_spec_proposed = pd_metrics_counter(m, "pd_node_spec_proposed_tokens_total",
                                            "Speculative tokens proposed.", l);
    n->m_spec_accepted = pd_metrics_counter(m, "pd_node_spec_accepted_tokens_total",
                                            "Speculative tokens accepted by verification.", l);
    n->m_spec_len = pd_metrics_histogram(
        m, "pd_node_spec_acceptance_length",
        "Tokens one verification emitted: accepted proposals + 1.", l, len_bounds,
        (int)(sizeof len_bounds / sizeof len_bounds[0]));
    n->m_spec_verify_s = pd_metrics_counter(m, "pd_node_spec_verify_seconds_total",
                                            "Engine time of the steps that verified proposals.", l);
    n->m_spec_draft_s = pd_metrics_counter(m, "pd_node_spec_draft_seconds_total",
                                           "Time spent proposing (draft forwards, n-gram lookup).", l);
    n->m_spec_draft_steps = pd_metrics_counter(m, "pd_node_spec_draft_steps_total",
                                               "Forward passes of the draft model.", l);
  }
}

pd_status pd_node_open(pd_node *n, const pd_node_opts *o, Pd__Role role,
                       pd_sched_event_fn on_event, void *ev_user, const pd_node_hooks *hooks,
                       pd_err *e) {
  memset(n, 0, sizeof *n);
  n->o = *o;
  n->role = role;
  n->hooks = *hooks;
  atomic_init(&n->healthy, false);
  if (o->node_id) snprintf(n->node_id, sizeof n->node_id, "%s", o->node_id);
  else default_node_id(n);
  char missing[256];
  membership_missing(o, role == PD__ROLE__ROLE_DECODE, missing, sizeof missing);
  if (missing[0] && o->insecure)
    pd_log(PD_LOG_WARN, "--insecure: running without%s: the router cannot tell this node from "
           "another process%s", missing + 1,
           role == PD__ROLE__ROLE_DECODE ? ", and any process can send KV pages to it" : "");
  char rnd[2 * PD_WIRE_TOKEN_BYTES + 1];
  pd_status st = pd_wire_random_hex(rnd, e);
  if (st) return st;
  snprintf(n->rid, sizeof n->rid, "%s#%s", n->node_id, rnd);
  if (o->served_name) snprintf(n->model_name, sizeof n->model_name, "%s", o->served_name);
  else pd_basename(o->model_dir, n->model_name, sizeof n->model_name);
  if (getrandom(&n->incarnation, sizeof n->incarnation, 0) != sizeof n->incarnation)
    n->incarnation = (uint64_t)pd_now_ms() ^ ((uint64_t)getpid() << 32);
  st = pd_model_fingerprint(o->model_dir, &n->fingerprint, e);
  if (st) return st;
  n->rt.sched = NULL;
  pd_runtime_opts ro = o->rt;
  ro.model_dir = o->model_dir;
  if (ro.decode_prefill_tokens < 0)
    ro.decode_prefill_tokens = o->unified ? PD_UNIFIED_DECODE_PREFILL_TOKENS : 0;
  ro.draft_prefill = role == PD__ROLE__ROLE_PREFILL; /* it ships the draft's KV */
  if ((st = pd_runtime_open(&n->rt, &ro, on_event, ev_user, e)) != PD_OK) return st;

  /* the KV cache: host pages on the CPU backend (memcpy), device pages on a GPU (staged through
   * the backend's kv_gather / kv_scatter and pinned host buffers) */
  if (!n->rt.be->host_memory) {
    n->kvstage = pd_kvstage_new(n->rt.be, 0, e);
    if (!n->kvstage) {
      pd_err_prefix(e, "--device %s", ro.device ? ro.device : "?");
      return e->code;
    }
  }
  /* outgoing KV frames in page-locked memory: one DMA from the device instead of a copy
   * through the backend's bounce chunks (backends without host_alloc: malloc, as before) */
  if (role == PD__ROLE__ROLE_PREFILL && o->kv_pinned_mb > 0 && n->rt.be->ops.host_alloc &&
      n->rt.be->ops.host_free) {
    n->kv_frames = pd_framepool_new(n->rt.be, (size_t)o->kv_chunk_mb << 20,
                                    (size_t)o->kv_pinned_mb << 20, e);
    if (!n->kv_frames) return e->code;
  }
  /* received KV messages copied into page-locked memory (pd_node_kv_rx_buf, allocated on
   * demand): one DMA to the device instead of a copy through the backend's bounce chunks */
  if (role == PD__ROLE__ROLE_DECODE && n->rt.be->ops.host_alloc && n->rt.be->ops.host_free)
    n->kv_rx_cap = (size_t)o->kv_pinned_mb << 20;
  /* the KV messages' CRC-32 (the loop thread plus kv_crc_threads - 1 workers) */
  n->kv_crc = pd_crcpool_new(o->kv_crc_threads, e);
  if (!n->kv_crc) return e->code;
  const pd_model_config *c = &n->rt.model->cfg;
  n->layers = calloc((size_t)c->num_layers, sizeof *n->layers);
  if (!n->layers) return pd_err_set(e, PD_ENOMEM, "out of memory");
  pd_kv_shape shape = {0};
  for (int l = 0; l < c->num_layers; l++)
    if ((st = pd_engine_kv(n->rt.eng, l, &n->layers[l], &shape, e)) != PD_OK) return st;
  n->pages = (pd_kv_pages){.layers = n->layers, .num_layers = c->num_layers,
                           .num_blocks = pd_kv_pool_num_blocks(n->rt.pool),
                           .num_kv_heads = shape.num_kv_heads, .head_offset = 0,
                           .block_size = shape.block_size, .head_dim = shape.head_dim,
                           .dtype = shape.dtype};
  if (n->rt.draft_eng) { /* the draft's cache, shipped (prefill) or received (decode) */
    const pd_model_config *dc = &n->rt.draft_model->cfg;
    if ((st = pd_model_fingerprint(o->rt.speculative_model, &n->draft_fingerprint, e)) != PD_OK)
      return st;
    n->draft_layers = calloc((size_t)dc->num_layers, sizeof *n->draft_layers);
    if (!n->draft_layers) return pd_err_set(e, PD_ENOMEM, "out of memory");
    pd_kv_shape ds = {0};
    for (int l = 0; l < dc->num_layers; l++)
      if ((st = pd_engine_kv(n->rt.draft_eng, l, &n->draft_layers[l], &ds, e)) != PD_OK)
        return st;
    n->draft_pages = (pd_kv_pages){.layers = n->draft_layers, .num_layers = dc->num_layers,
                                   .num_blocks = pd_kv_pool_num_blocks(n->rt.draft_pool),
                                   .num_kv_heads = ds.num_kv_heads, .head_offset = 0,
                                   .block_size = ds.block_size, .head_dim = ds.head_dim,
                                   .dtype = ds.dtype};
    pd_backend *dbe = n->rt.draft_be ? n->rt.draft_be : n->rt.be;
    if (!dbe->host_memory && !(n->draft_kvstage = pd_kvstage_new(dbe, 0, e))) return e->code;
  }
  pd_wire_limits_init(&n->lim);
  n->lim.vocab_size = c->vocab_size;
  n->lim.total_blocks = n->pages.num_blocks;
  n->lim.block_size = n->pages.block_size;
  n->lim.num_layers = n->pages.num_layers;
  n->lim.num_kv_heads = n->pages.num_kv_heads;
  n->lim.head_dim = n->pages.head_dim;
  n->lim.kv_dtype = (int)n->pages.dtype;
  n->lim.draft_total_blocks = n->draft_pages.num_blocks;
  n->lim.draft_num_layers = n->draft_pages.num_layers;
  n->lim.draft_num_kv_heads = n->draft_pages.num_kv_heads;
  n->lim.draft_head_dim = n->draft_pages.head_dim;

  n->metrics = pd_metrics_new(e);
  if (!n->metrics) return e->code;
  init_metrics(n);

  if ((st = pd_curve_keys_from_flags(o->curve_secret_file, o->curve_secret_key, &n->keys,
                                     &n->have_keys, e)) != PD_OK)
    return st;
  if (o->router_public_key && *o->router_public_key) {
    pd_curve_keypair rk;
    if ((st = pd_curve_key_arg(o->router_public_key, false, &rk, e)) != PD_OK) {
      pd_err_prefix(e, "--router-public-key");
      return st;
    }
    memcpy(n->router_key, rk.public_z85, sizeof n->router_key);
    if (!n->have_keys) { /* --insecure: a key of its own that no allow list has */
      if ((st = pd_curve_keypair_generate(&n->keys, e)) != PD_OK) return st;
      n->have_keys = true;
    }
  }
  n->zctx = pd_net_ctx_new(1, e);
  if (!n->zctx) return e->code;
  if (o->curve_allow_file && n->have_keys && role == PD__ROLE__ROLE_DECODE) {
    n->auth = pd_curve_auth_start(n->zctx, e);
    if (!n->auth) return e->code;
    if ((st = pd_curve_allow_file(n->auth, o->curve_allow_file, e)) != PD_OK) return st;
  }
  pd_net_sock_opts so;
  pd_net_sock_opts_init(&so, ZMQ_DEALER);
  so.routing_id = n->rid;
  so.send_timeout_ms = 0;
  if (n->router_key[0]) {
    so.curve_keys = &n->keys;
    so.curve_server_key = n->router_key;
  }
  n->router_sock = pd_net_socket(n->zctx, &so, e);
  if (!n->router_sock) return e->code;
  if ((st = pd_net_connect(n->router_sock, o->router_ep, e)) != PD_OK) return st;
  pd_outbox_init(&n->router, n->router_sock, n->node_id);
  pthread_mutex_init(&n->hb_mu, NULL);
  pd__load__init(&n->hb_load);
  atomic_init(&n->hb_registered, false);
  atomic_init(&n->hb_reregister, false);
  atomic_init(&n->hb_stop, false);
  atomic_init(&n->hb_interval_ms, 500);
  atomic_init(&n->hb_last_ack_ms, 0);
  atomic_init(&n->hb_progress_ms, pd_now_ms());
  if (pthread_create(&n->hb_thread, NULL, hb_main, n) != 0)
    return pd_err_set(e, PD_EIO, "cannot start the heartbeat thread");
  n->hb_started = true;

  if (o->metrics_port >= 0) {
    n->metrics_srv = pd_metrics_server_start(o->bind, o->metrics_port, n->metrics, &n->healthy,
                                &n->hb_progress_ms, e);
    if (!n->metrics_srv) return e->code;
  }
  return PD_OK;
}

void pd_node_close(pd_node *n) {
  if (n->hb_started) {
    atomic_store(&n->hb_stop, true);
    pthread_join(n->hb_thread, NULL);
    n->hb_started = false;
    pthread_mutex_destroy(&n->hb_mu);
  }
  pd_metrics_server_stop(n->metrics_srv);
  n->metrics_srv = NULL;
  if (n->router_sock) pd_outbox_clear(&n->router);
  pd_net_close(n->router_sock);
  n->router_sock = NULL;
  pd_curve_auth_stop(n->auth);
  n->auth = NULL;
  pd_net_ctx_free(n->zctx); /* joins ZeroMQ's threads: every frame it held is released */
  n->zctx = NULL;
  pd_framepool_free(n->kv_frames); /* after zmq_ctx_term, before the backend (framepool.h) */
  n->kv_frames = NULL;
  if (n->kv_rx) n->rt.be->ops.host_free(n->rt.be, n->kv_rx); /* before the backend */
  n->kv_rx = NULL;
  n->kv_rx_bytes = n->kv_rx_cap = 0;
  pd_crcpool_free(n->kv_crc);
  n->kv_crc = NULL;
  pd_kvstage_free(n->kvstage); /* before its backend */
  n->kvstage = NULL;
  pd_kvstage_free(n->draft_kvstage);
  n->draft_kvstage = NULL;
  pd_runtime_close(&n->rt);
  free(n->layers);
  n->layers = NULL;
  free(n->draft_layers);
  n->draft_layers = NULL;
  memset(&n->draft_pages, 0, sizeof n->draft_pages);
  pd_metrics_free(n->metrics);
  n->metrics = NULL;
}

void pd_node_send_first_token(pd_node *n, const char *id, const pd_sched_event *ev, int n_prompt,
                              Pd__TokenLogprob *lp, Pd__TopLogprob **top_p,
                              Pd__TopLogprob *top_s) {
  Pd__FirstToken ft;
  pd__first_token__init(&ft);
  ft.request_id = (char *)id;
  ft.token_id = ev->token;
  if (ev->logprobs) {
    pd_node_logprob(ev->logprobs, lp, top_p, top_s);
    ft.logprob = lp;
  }
  ft.finish_reason = ev->finish == PD_FINISH_STOP     ? PD__FINISH_REASON__FINISH_REASON_STOP
                     : ev->finish == PD_FINISH_LENGTH ? PD__FINISH_REASON__FINISH_REASON_LENGTH
                                                      : PD__FINISH_REASON__FINISH_REASON_NONE;
  ft.prompt_tokens = (uint32_t)n_prompt;
  ft.cached_tokens = (uint32_t)(ev->num_cached_tokens < n_prompt ? ev->num_cached_tokens
                                                                     : n_prompt);
  if (ft.cached_tokens > ft.prompt_tokens) ft.cached_tokens = ft.prompt_tokens;
  /* prompt logprobs of positions 1..n_prompt-1 (the first one has none) */
  Pd__TokenLogprob *plp = NULL, **plp_p = NULL;
  Pd__TopLogprob *ptop = NULL, **ptop_p = NULL;
  int npl = 0;
  if (ev->prompt_logprobs && ev->n_prompt_logprobs > 0) {
    npl = ev->n_prompt_logprobs < n_prompt ? ev->n_prompt_logprobs : n_prompt - 1;
    plp = calloc((size_t)npl, sizeof *plp);
    plp_p = calloc((size_t)npl, sizeof *plp_p);
    ptop = calloc((size_t)npl * PD_SAMPLE_MAX_LOGPROBS, sizeof *ptop);
    ptop_p = calloc((size_t)npl * PD_SAMPLE_MAX_LOGPROBS, sizeof *ptop_p);
    if (plp && plp_p && ptop && ptop_p) {
      for (int i = 0; i < npl; i++) {
        pd_node_logprob(&ev->prompt_logprobs[i], &plp[i], ptop_p + i * PD_SAMPLE_MAX_LOGPROBS,
                        ptop + i * PD_SAMPLE_MAX_LOGPROBS);
        plp_p[i] = &plp[i];
      }
      ft.n_prompt_logprobs = (size_t)npl;
      ft.prompt_logprobs = plp_p;
    }
  }
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_FIRST_TOKEN;
  env.first_token = &ft;
  pd_node_send(n, &env);
  free(plp);
  free(plp_p);
  free(ptop);
  free(ptop_p);
}

pd_status pd_node_sampling(pd_node *n, const char *id, const Pd__SamplingParams *w,
                           pd_sampling_params *p, pd_logit_bias **bias) {
  const size_t nbias = w ? w->n_logit_bias : 0;
  *bias = calloc(nbias ? nbias : 1, sizeof **bias);
  if (!*bias) {
    pd_node_send_error(n, PD__ERROR_CODE__ERROR_CODE_INTERNAL, id, true, "out of memory");
    return PD_ENOMEM;
  }
  pd_err e = {0};
  Pd__SamplingParams defaults = PD__SAMPLING_PARAMS__INIT;
  pd_status st = pd_wire_sampling_params(w ? w : &defaults, p, *bias, nbias ? nbias : 1, &e);
  if (st != PD_OK) {
    free(*bias);
    *bias = NULL;
    pd_node_send_error(n, PD__ERROR_CODE__ERROR_CODE_INVALID_REQUEST, id, false, "%s", e.msg);
    return st;
  }
  p->n = 1; /* the router fans n out (sample_index) */
  return PD_OK;
}

pd_status pd_node_sched_prefill(pd_node *n, const Pd__Prefill *m, uint64_t sid,
                                const pd_sampling_params *p) {
  pd_err e = {0};
  pd_sched_req sr = {.id = sid, .prompt = m->prompt_token_ids,
                     .n_prompt = (int)m->n_prompt_token_ids,
                     .generated = m->generated_token_ids,
                     .n_generated = (int)m->n_generated_token_ids, .params = p,
                     .sample_index = m->sample_index,
                     .cache_salt = pd_kv_cache_salt(m->cache_salt)};
  pd_status st = pd_sched_add_req(n->rt.sched, &sr, &e);
  if (st != PD_OK)
    pd_node_send_error(n,
                       st == PD_ERANGE ? PD__ERROR_CODE__ERROR_CODE_CONTEXT_TOO_LONG
                                       : PD__ERROR_CODE__ERROR_CODE_INVALID_REQUEST,
                       m->request_id, false, "%s", e.msg);
  return st;
}
