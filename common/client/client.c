/* The C client of the router's ZeroMQ client API (pd/client.h). */
#include "pd/client.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "pd/opts.h"

/* A request sent on this client whose choices have not all finished: what pd_client_close
 * cancels. */
typedef struct active_req {
  char id[PD_WIRE_ID_MAX_BYTES + 1];
  uint32_t n_choices, n_finished;
} active_req;

struct pd_client {
  void *ctx, *sock;
  pd_client_opts opts;
  char name[64];
  pd_curve_keypair keys;
  char server_key[PD_CURVE_Z85_LEN + 1];
  char *api_key;     /* a copy of opts.api_key (NULL: none) */
  pd_wire_limits lim;
  pd_net_msg msg;
  uint64_t seq;      /* Envelope.seq of the next message */
  uint64_t next_id;  /* request id counter */
  uint32_t nonce;    /* random part of generated request ids */
  /* An Error envelope presented as a chunk (pd_client_recv). */
  Pd__GenerateChunk err_chunk;
  Pd__Error err_body;
  active_req *active;
  size_t n_active, cap_active;
};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void pd_client_opts_init(pd_client_opts *o) {
  memset(o, 0, sizeof *o);
  o->connect_timeout_ms = 5000;
  o->idle_timeout_ms = 120000;
  o->name = "pdclient";
}

/* ---- connection ---- */

/* Reads one monitor event (ZMQ_EVENT_*) from the monitor PAIR socket mon, waiting up to
 * timeout_ms. Returns the event, 0 when nothing came, -1 on a libzmq failure. The first
 * frame is 6 bytes (uint16 event, uint32 value); the second the endpoint, ignored. */
static int monitor_event(void *mon, int timeout_ms) {
  zmq_pollitem_t it = {.socket = mon, .events = ZMQ_POLLIN};
  int r = zmq_poll(&it, 1, timeout_ms);
  if (r < 0) return errno == EINTR ? 0 : -1;
  if (r == 0) return 0;
  zmq_msg_t f;
  zmq_msg_init(&f);
  if (zmq_msg_recv(&f, mon, 0) < 0) {
    zmq_msg_close(&f);
    return -1;
  }
  int ev = 0;
  if (zmq_msg_size(&f) >= 2) {
    uint16_t v;
    memcpy(&v, zmq_msg_data(&f), sizeof v);
    ev = v;
  }
  while (zmq_msg_more(&f)) { /* the endpoint frame */
    zmq_msg_close(&f);
    zmq_msg_init(&f);
    if (zmq_msg_recv(&f, mon, 0) < 0) break;
  }
  zmq_msg_close(&f);
  return ev;
}

#ifdef ZMQ_EVENT_HANDSHAKE_SUCCEEDED
#define EV_READY ZMQ_EVENT_HANDSHAKE_SUCCEEDED
#define EV_FAILED \
  (ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | \
   ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
#else /* libzmq < 4.3: the TCP connection is the best signal there is */
#define EV_READY ZMQ_EVENT_CONNECTED
#define EV_FAILED 0
#endif

/* Waits until the socket's connection to endpoint is usable (handshake done). */
static pd_status wait_ready(pd_client *c, const char *endpoint, pd_err *e) {
  char mon_ep[96];
  snprintf(mon_ep, sizeof mon_ep, "inproc://pdclient-monitor-%p", (void *)c);
  int mask = EV_READY | EV_FAILED | ZMQ_EVENT_CONNECT_RETRIED | ZMQ_EVENT_DISCONNECTED |
             ZMQ_EVENT_CONNECTED;
  if (zmq_socket_monitor(c->sock, mon_ep, mask) != 0)
    return pd_err_set(e, PD_EIO, "zmq_socket_monitor: %s", zmq_strerror(zmq_errno()));
  void *mon = zmq_socket(c->ctx, ZMQ_PAIR);
  if (!mon || zmq_connect(mon, mon_ep) != 0) {
    pd_status st = pd_err_set(e, PD_EIO, "monitor socket: %s", zmq_strerror(zmq_errno()));
    if (mon) zmq_close(mon);
    zmq_socket_monitor(c->sock, NULL, 0);
    return st;
  }
  pd_status st = pd_net_connect(c->sock, endpoint, e);
  const char *last = "no answer";
  double deadline = now_s() + c->opts.connect_timeout_ms / 1000.0;
  while (st == PD_OK) {
    int left = (int)((deadline - now_s()) * 1000.0);
    if (left <= 0) {
      st = pd_err_set(e, PD_EIO, "connecting to %s: timed out after %d ms (%s)", endpoint,
                      c->opts.connect_timeout_ms, last);
      break;
    }
    int ev = monitor_event(mon, left);
    if (ev < 0) {
      st = pd_err_set(e, PD_EIO, "connecting to %s: monitor: %s", endpoint,
                      zmq_strerror(zmq_errno()));
    } else if (ev & EV_READY) {
      break;
    } else if (ev & EV_FAILED) {
      st = pd_err_set(e, PD_EIO,
                      "connecting to %s: the %s handshake failed (%s)", endpoint,
                      c->server_key[0] ? "CURVE" : "ZMTP",
                      c->server_key[0] ? "wrong server key, or this client is not allowed"
                                       : "the server expects CURVE keys, or is not pd-router");
    } else if (ev == ZMQ_EVENT_CONNECT_RETRIED) {
      last = "connection refused, retrying";
    } else if (ev == ZMQ_EVENT_DISCONNECTED) {
      last = "disconnected during the handshake";
    } else if (ev == ZMQ_EVENT_CONNECTED) {
      last = "connected, handshake not finished";
    }
  }
  zmq_socket_monitor(c->sock, NULL, 0);
  zmq_close(mon);
  return st;
}

pd_client *pd_client_connect(const char *endpoint, const pd_client_opts *o, pd_err *e) {
  if (!endpoint || !*endpoint) {
    pd_err_set(e, PD_EINVAL, "pd_client_connect: no endpoint");
    return NULL;
  }
  pd_client *c = calloc(1, sizeof *c);
  if (!c) {
    pd_err_set(e, PD_ENOMEM, "out of memory");
    return NULL;
  }
  if (o) c->opts = *o;
  else pd_client_opts_init(&c->opts);
  if (c->opts.connect_timeout_ms <= 0) c->opts.connect_timeout_ms = 5000;
  snprintf(c->name, sizeof c->name, "%s", c->opts.name && *c->opts.name ? c->opts.name : "pdclient");
  c->opts.name = c->name;
  c->opts.client_keys = NULL; /* copied below; the caller's struct need not outlive us */
  c->opts.server_public_key = NULL;
  c->opts.api_key = NULL;
  if (o && o->api_key && *o->api_key && !(c->api_key = strdup(o->api_key))) {
    pd_err_set(e, PD_ENOMEM, "out of memory");
    goto fail;
  }
  pd_wire_limits_init(&c->lim);
  pd_net_msg_init(&c->msg);
  c->nonce = (uint32_t)getpid() * 2654435761u ^ (uint32_t)(now_s() * 1e6);

  if (o && o->server_public_key) {
    if (pd_curve_key_parse(o->server_public_key, NULL, c->server_key, e) != PD_OK) {
      pd_err_prefix(e, "server public key");
      goto fail;
    }
    if (o->client_keys) {
      c->keys = *o->client_keys;
      if (!c->keys.secret_z85[0]) {
        pd_err_set(e, PD_EINVAL, "the client keypair has no secret key");
        goto fail;
      }
    } else if (pd_curve_keypair_generate(&c->keys, e) != PD_OK) {
      goto fail;
    }
  }

  c->ctx = pd_net_ctx_new(1, e);
  if (!c->ctx) goto fail;
  pd_net_sock_opts so;
  pd_net_sock_opts_init(&so, ZMQ_DEALER);
  so.handshake_ivl_ms = c->opts.connect_timeout_ms;
  if (c->server_key[0]) {
    so.curve_keys = &c->keys;
    so.curve_server_key = c->server_key;
  }
  c->sock = pd_net_socket(c->ctx, &so, e);
  if (!c->sock) goto fail;
  if (wait_ready(c, endpoint, e) != PD_OK) goto fail;
  return c;
fail:
  pd_client_close(c);
  return NULL;
}

static void send_cancel_nowait(pd_client *c, const char *id) {
  Pd__CancelRequest cr = PD__CANCEL_REQUEST__INIT;
  cr.request_id = (char *)id;
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.sender = c->name;
  env.seq = c->seq++;
  env.body_case = PD__ENVELOPE__BODY_CANCEL;
  env.cancel = &cr;
  pd_net_send(c->sock, NULL, 0, &env, NULL, 0, NULL);
}

void pd_client_close(pd_client *c) {
  if (!c) return;
  if (c->sock && c->n_active) {
    /* Best effort and without blocking: a router that is gone gets nothing. */
    int zero = 0, linger = 200;
    zmq_setsockopt(c->sock, ZMQ_SNDTIMEO, &zero, sizeof zero);
    zmq_setsockopt(c->sock, ZMQ_LINGER, &linger, sizeof linger);
    for (size_t i = 0; i < c->n_active; i++) send_cancel_nowait(c, c->active[i].id);
  }
  pd_net_msg_clear(&c->msg);
  pd_net_close(c->sock);
  pd_net_ctx_free(c->ctx);
  free(c->active);
  memset(&c->keys, 0, sizeof c->keys);
  pd_secret_free(c->api_key);
  free(c);
}

/* ---- requests ---- */

static active_req *find_active(pd_client *c, const char *id) {
  for (size_t i = 0; i < c->n_active; i++)
    if (!strcmp(c->active[i].id, id)) return &c->active[i];
  return NULL;
}

static void drop_active(pd_client *c, active_req *a) {
  size_t i = (size_t)(a - c->active);
  c->active[i] = c->active[--c->n_active];
}

pd_status pd_client_send(pd_client *c, Pd__GenerateRequest *req,
                         char id[PD_WIRE_ID_MAX_BYTES + 1], pd_err *e) {
  if (!c || !req) return pd_err_set(e, PD_EINVAL, "pd_client_send: no client or request");
  char gen[PD_WIRE_ID_MAX_BYTES + 1];
  char *saved = req->request_id, *saved_key = req->api_key;
  if (c->api_key && (!req->api_key || !req->api_key[0])) req->api_key = c->api_key;
  if (!req->request_id || !req->request_id[0]) {
    snprintf(gen, sizeof gen, "pdc-%08x-%llu", c->nonce, (unsigned long long)++c->next_id);
    req->request_id = gen;
  }
  pd_status st = pd_wire_validate_generate(req, &c->lim, e);
  if (st == PD_OK && find_active(c, req->request_id))
    st = pd_err_set(e, PD_EINVAL, "request id '%s' is already in flight on this client",
                    req->request_id);
  if (st == PD_OK && c->n_active == c->cap_active) {
    size_t cap = c->cap_active ? 2 * c->cap_active : 8;
    active_req *t = realloc(c->active, cap * sizeof *t);
    if (!t) st = pd_err_set(e, PD_ENOMEM, "out of memory");
    else {
      c->active = t;
      c->cap_active = cap;
    }
  }
  if (st == PD_OK) {
    Pd__Envelope env;
    pd_wire_envelope_init(&env);
    env.sender = c->name;
    env.seq = c->seq++;
    env.body_case = PD__ENVELOPE__BODY_GENERATE;
    env.generate = req;
    st = pd_net_send(c->sock, NULL, 0, &env, NULL, 0, e);
    if (st == PD_EFULL)
      pd_err_set(e, PD_EFULL, "the router is not reachable (no connection within the send "
                              "timeout)");
  }
  if (st == PD_OK) {
    active_req *a = &c->active[c->n_active++];
    snprintf(a->id, sizeof a->id, "%s", req->request_id);
    a->n_choices = req->sampling && req->sampling->n > 0 ? req->sampling->n : 1;
    a->n_finished = 0;
    if (id) snprintf(id, PD_WIRE_ID_MAX_BYTES + 1, "%s", req->request_id);
  }
  req->request_id = saved;
  req->api_key = saved_key;
  return st;
}

pd_status pd_client_cancel(pd_client *c, const char *request_id, pd_err *e) {
  if (!c || !request_id || !pd_wire_id_ok(request_id))
    return pd_err_set(e, PD_EINVAL, "pd_client_cancel: not a request id");
  Pd__CancelRequest cr = PD__CANCEL_REQUEST__INIT;
  cr.request_id = (char *)request_id;
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.sender = c->name;
  env.seq = c->seq++;
  env.body_case = PD__ENVELOPE__BODY_CANCEL;
  env.cancel = &cr;
  return pd_net_send(c->sock, NULL, 0, &env, NULL, 0, e);
}

/* Whether an error chunk ends the whole request rather than one choice: an error without a
 * finish reason (a refusal, proto/pd.proto), or a code that can only concern the request as a
 * whole (it was refused before any choice ran), whatever finish reason came with it. */
static bool ends_request(const Pd__GenerateChunk *ch) {
  if (!ch->error) return false;
  if (ch->finish_reason == PD__FINISH_REASON__FINISH_REASON_NONE) return true;
  switch (ch->error->code) {
    case PD__ERROR_CODE__ERROR_CODE_INVALID_REQUEST:
    case PD__ERROR_CODE__ERROR_CODE_CONTEXT_TOO_LONG:
    case PD__ERROR_CODE__ERROR_CODE_NOT_FOUND:
    case PD__ERROR_CODE__ERROR_CODE_UNSUPPORTED:
    case PD__ERROR_CODE__ERROR_CODE_PROTOCOL:
      return true;
    default:
      return false;
  }
}

/* Books a chunk against its request: a choice is over when it carries a finish reason; an
 * error that ends the request (ends_request) finishes all of them. */
static void account(pd_client *c, const Pd__GenerateChunk *ch) {
  active_req *a = ch->request_id ? find_active(c, ch->request_id) : NULL;
  if (!a) return;
  if (ends_request(ch)) {
    drop_active(c, a);
    return;
  }
  if (ch->finish_reason != PD__FINISH_REASON__FINISH_REASON_NONE &&
      ++a->n_finished >= a->n_choices)
    drop_active(c, a);
}

pd_status pd_client_recv(pd_client *c, int timeout_ms, const Pd__GenerateChunk **chunk,
                         pd_err *e) {
  *chunk = NULL;
  if (!c) return pd_err_set(e, PD_EINVAL, "pd_client_recv: no client");
  double deadline = timeout_ms < 0 ? -1 : now_s() + timeout_ms / 1000.0;
  for (;;) {
    int left = -1;
    if (deadline >= 0) {
      left = (int)((deadline - now_s()) * 1000.0 + 0.5);
      if (left < 0) left = 0;
    }
    bool got = false;
    pd_err re = {0};
    pd_status st = pd_net_recv(c->sock, left, &c->lim, &c->msg, &got, &re);
    if (st == PD_EIO) return pd_err_set(e, PD_EIO, "%s", re.msg);
    if (!got) return PD_OK;
    if (st != PD_OK) /* consumed; the socket stays in step */
      return pd_err_set(e, st, "malformed message from the router: %s", re.msg);
    const Pd__Envelope *env = c->msg.wire.env;
    if (env->body_case == PD__ENVELOPE__BODY_CHUNK) {
      account(c, env->chunk);
      *chunk = env->chunk;
      return PD_OK;
    }
    if (env->body_case == PD__ENVELOPE__BODY_ERROR) {
      Pd__GenerateChunk *g = &c->err_chunk;
      pd__generate_chunk__init(g);
      c->err_body = *env->error;
      g->request_id = env->error->request_id ? env->error->request_id : (char *)"";
      g->error = &c->err_body;
      g->finish_reason = PD__FINISH_REASON__FINISH_REASON_NONE; /* ends the whole request */
      account(c, g);
      g->finish_reason = PD__FINISH_REASON__FINISH_REASON_ERROR;
      *chunk = g;
      return PD_OK;
    }
    /* Anything else is not for a client: skip it and keep waiting. */
    if (deadline >= 0 && now_s() >= deadline) return PD_OK;
  }
}

pd_status pd_client_generate(pd_client *c, Pd__GenerateRequest *req, pd_client_chunk_fn fn,
                             void *ud, pd_client_result *res, pd_err *e) {
  pd_client_result local;
  if (!res) res = &local;
  memset(res, 0, sizeof *res);
  double t0 = now_s();
  pd_status st = pd_client_send(c, req, res->request_id, e);
  if (st) return st;
  uint32_t n = req->sampling && req->sampling->n > 0 ? req->sampling->n : 1;
  uint8_t done[PD_SAMPLE_MAX_N] = {0};
  bool cancelled = false;
  int idle = c->opts.idle_timeout_ms > 0 ? c->opts.idle_timeout_ms : -1;
  while (res->n_choices < n) {
    const Pd__GenerateChunk *ch = NULL;
    pd_err re = {0};
    st = pd_client_recv(c, idle, &ch, &re);
    if (st == PD_EIO) {
      pd_err_set(e, PD_EIO, "%s", re.msg);
      break;
    }
    if (st != PD_OK) { /* a malformed message: report it, the request may be lost */
      snprintf(res->error, sizeof res->error, "%.255s", re.msg);
      res->error_code = PD__ERROR_CODE__ERROR_CODE_PROTOCOL;
      continue;
    }
    if (!ch) {
      if (!cancelled) pd_client_cancel(c, res->request_id, NULL);
      active_req *a = find_active(c, res->request_id);
      if (a) drop_active(c, a);
      st = pd_err_set(e, PD_EIO, "request %s: no answer from the router for %d ms",
                      res->request_id, idle);
      break;
    }
    if (!ch->request_id || strcmp(ch->request_id, res->request_id) != 0) {
      /* A bare error with no request id answers a message the router could not even read
       * (ours, since this client sends one request at a time here). */
      if (!(ch->error && (!ch->request_id || !ch->request_id[0]))) continue;
    }
    res->n_chunks++;
    res->completion_tokens += (uint32_t)ch->n_token_ids;
    if (res->ttft_s == 0 && (ch->n_token_ids > 0 || (ch->text && ch->text[0])))
      res->ttft_s = now_s() - t0;
    if (ch->usage) {
      res->have_usage = true;
      res->prompt_tokens = ch->usage->prompt_tokens;
      res->usage_completion_tokens = ch->usage->completion_tokens;
      res->cached_tokens = ch->usage->cached_tokens;
    }
    if (ch->error && res->error_code == PD__ERROR_CODE__ERROR_CODE_UNSPECIFIED) {
      res->error_code = ch->error->code ? ch->error->code : PD__ERROR_CODE__ERROR_CODE_INTERNAL;
      snprintf(res->error, sizeof res->error, "%s",
               ch->error->message && ch->error->message[0] ? ch->error->message : "error");
    }
    if (fn && !cancelled && !fn(ch, ud)) {
      cancelled = true;
      pd_client_cancel(c, res->request_id, NULL);
    }
    bool bare_error = ch->error && (ends_request(ch) || !ch->request_id ||
                                    !ch->request_id[0] || &c->err_chunk == ch);
    if (bare_error) {
      res->n_choices = n;
      if (res->finish_reason == PD__FINISH_REASON__FINISH_REASON_NONE)
        res->finish_reason = PD__FINISH_REASON__FINISH_REASON_ERROR;
      active_req *a = find_active(c, res->request_id);
      if (a) drop_active(c, a);
      break;
    }
    if (ch->finish_reason != PD__FINISH_REASON__FINISH_REASON_NONE && ch->index < n &&
        !done[ch->index]) {
      done[ch->index] = 1;
      res->n_choices++;
      if (ch->index == 0) res->finish_reason = ch->finish_reason;
    }
  }
  res->total_s = now_s() - t0;
  return st;
}

const char *pd_client_finish_reason_str(Pd__FinishReason r) {
  switch (r) {
    case PD__FINISH_REASON__FINISH_REASON_STOP: return "stop";
    case PD__FINISH_REASON__FINISH_REASON_LENGTH: return "length";
    case PD__FINISH_REASON__FINISH_REASON_ABORT: return "abort";
    case PD__FINISH_REASON__FINISH_REASON_ERROR: return "error";
    default: return "";
  }
}

const char *pd_client_error_code_str(Pd__ErrorCode c) {
  switch (c) {
    case PD__ERROR_CODE__ERROR_CODE_INVALID_REQUEST: return "invalid_request";
    case PD__ERROR_CODE__ERROR_CODE_CONTEXT_TOO_LONG: return "context_too_long";
    case PD__ERROR_CODE__ERROR_CODE_NOT_FOUND: return "not_found";
    case PD__ERROR_CODE__ERROR_CODE_OVERLOADED: return "overloaded";
    case PD__ERROR_CODE__ERROR_CODE_TIMEOUT: return "timeout";
    case PD__ERROR_CODE__ERROR_CODE_NODE_FAILED: return "node_failed";
    case PD__ERROR_CODE__ERROR_CODE_ABORTED: return "aborted";
    case PD__ERROR_CODE__ERROR_CODE_PROTOCOL: return "protocol";
    case PD__ERROR_CODE__ERROR_CODE_UNSUPPORTED: return "unsupported";
    case PD__ERROR_CODE__ERROR_CODE_INTERNAL: return "internal";
    case PD__ERROR_CODE__ERROR_CODE_UNAUTHORIZED: return "unauthorized";
    default: return "unknown";
  }
}
