/* ZeroMQ context and sockets with checked options, and the multipart framing of Envelopes
 * (pd/net.h). */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "pd/net.h"

/* Records a failed libzmq call with file:line, the call and zmq_strerror. */
#define ZERR(e, code, ...) zerr_at((e), (code), __FILE__, __LINE__, __VA_ARGS__)

__attribute__((format(printf, 5, 6))) static pd_status zerr_at(pd_err *e, pd_status code,
                                                              const char *file, int line,
                                                              const char *fmt, ...) {
  int err = zmq_errno();
  char what[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(what, sizeof what, fmt, ap);
  va_end(ap);
  return pd_err_set(e, code, "%s: %s (%s:%d)", what, zmq_strerror(err), file, line);
}

/* ---- context ---- */

void *pd_net_ctx_new(int io_threads, pd_err *e) {
  void *ctx = zmq_ctx_new();
  if (!ctx) {
    ZERR(e, PD_EIO, "zmq_ctx_new");
    return NULL;
  }
  if (zmq_ctx_set(ctx, ZMQ_IO_THREADS, io_threads > 0 ? io_threads : 1) != 0 ||
      zmq_ctx_set(ctx, ZMQ_BLOCKY, 0) != 0) {
    ZERR(e, PD_EIO, "zmq_ctx_set");
    zmq_ctx_term(ctx);
    return NULL;
  }
  return ctx;
}

void pd_net_ctx_free(void *ctx) {
  if (!ctx) return;
  while (zmq_ctx_term(ctx) != 0 && zmq_errno() == EINTR) {
  }
}

/* ---- sockets ---- */

void pd_net_sock_opts_init(pd_net_sock_opts *o, int type) {
  memset(o, 0, sizeof *o);
  pd_wire_limits l;
  pd_wire_limits_init(&l);
  o->type = type;
  o->linger_ms = 0;
  o->sndhwm = o->rcvhwm = 1000;
  o->max_msg_size = (int64_t)(l.max_payload_frame_bytes > l.max_frame_bytes
                                  ? l.max_payload_frame_bytes
                                  : l.max_frame_bytes);
  o->send_timeout_ms = type == ZMQ_ROUTER ? 0 : 5000;
  o->reconnect_ivl_ms = 100;
  o->reconnect_ivl_max_ms = 5000;
  o->router_mandatory = type == ZMQ_ROUTER;
  o->router_handover = type == ZMQ_ROUTER;
  o->immediate = type == ZMQ_DEALER || type == ZMQ_PUSH;
  o->tcp_keepalive_idle_s = 30;
  o->tcp_keepalive_intvl_s = 10;
  o->tcp_keepalive_cnt = 3;
  o->heartbeat_ivl_ms = 1000;
  o->handshake_ivl_ms = 5000;
}

static pd_status set_int(void *s, int opt, const char *name, int v, pd_err *e) {
  if (zmq_setsockopt(s, opt, &v, sizeof v) != 0)
    return ZERR(e, PD_EIO, "zmq_setsockopt(%s=%d)", name, v);
  return PD_OK;
}

#define SET_INT(s, OPT, v)                                        \
  do {                                                            \
    pd_status st_ = set_int((s), OPT, #OPT, (v), e);              \
    if (st_) goto fail;                                           \
  } while (0)

void *pd_net_socket(void *ctx, const pd_net_sock_opts *o_in, pd_err *e) {
  pd_net_sock_opts def;
  if (!o_in) pd_net_sock_opts_init(&def, ZMQ_DEALER);
  const pd_net_sock_opts *o = o_in ? o_in : &def;
  if (!ctx) {
    pd_err_set(e, PD_EINVAL, "pd_net_socket: no context");
    return NULL;
  }
  void *s = zmq_socket(ctx, o->type);
  if (!s) {
    ZERR(e, PD_EIO, "zmq_socket(type %d)", o->type);
    return NULL;
  }
  SET_INT(s, ZMQ_LINGER, o->linger_ms);
  SET_INT(s, ZMQ_SNDHWM, o->sndhwm);
  SET_INT(s, ZMQ_RCVHWM, o->rcvhwm);
  if (zmq_setsockopt(s, ZMQ_MAXMSGSIZE, &o->max_msg_size, sizeof o->max_msg_size) != 0) {
    ZERR(e, PD_EIO, "zmq_setsockopt(ZMQ_MAXMSGSIZE=%lld)", (long long)o->max_msg_size);
    goto fail;
  }
  SET_INT(s, ZMQ_SNDTIMEO, o->send_timeout_ms);
  SET_INT(s, ZMQ_RECONNECT_IVL, o->reconnect_ivl_ms);
  SET_INT(s, ZMQ_RECONNECT_IVL_MAX, o->reconnect_ivl_max_ms);
  if (o->type == ZMQ_ROUTER) {
    SET_INT(s, ZMQ_ROUTER_MANDATORY, o->router_mandatory ? 1 : 0);
    SET_INT(s, ZMQ_ROUTER_HANDOVER, o->router_handover ? 1 : 0);
  }
  if (o->type == ZMQ_DEALER || o->type == ZMQ_PUSH || o->type == ZMQ_ROUTER)
    SET_INT(s, ZMQ_IMMEDIATE, o->immediate ? 1 : 0);
  if (o->tcp_keepalive_idle_s > 0) {
    SET_INT(s, ZMQ_TCP_KEEPALIVE, 1);
    SET_INT(s, ZMQ_TCP_KEEPALIVE_IDLE, o->tcp_keepalive_idle_s);
    SET_INT(s, ZMQ_TCP_KEEPALIVE_INTVL, o->tcp_keepalive_intvl_s > 0 ? o->tcp_keepalive_intvl_s : 10);
    SET_INT(s, ZMQ_TCP_KEEPALIVE_CNT, o->tcp_keepalive_cnt > 0 ? o->tcp_keepalive_cnt : 3);
  }
  if (o->heartbeat_ivl_ms > 0) {
    SET_INT(s, ZMQ_HEARTBEAT_IVL, o->heartbeat_ivl_ms);
    SET_INT(s, ZMQ_HEARTBEAT_TIMEOUT, 3 * o->heartbeat_ivl_ms);
    SET_INT(s, ZMQ_HEARTBEAT_TTL, 3 * o->heartbeat_ivl_ms);
  }
  if (o->handshake_ivl_ms > 0) SET_INT(s, ZMQ_HANDSHAKE_IVL, o->handshake_ivl_ms);
  if (o->routing_id) {
    size_t n = strlen(o->routing_id);
    if (n == 0 || n > PD_NET_ROUTING_ID_MAX || o->routing_id[0] == '\0') {
      pd_err_set(e, PD_EINVAL, "routing id must be 1..%d bytes", PD_NET_ROUTING_ID_MAX);
      goto fail;
    }
    if (zmq_setsockopt(s, ZMQ_ROUTING_ID, o->routing_id, n) != 0) {
      ZERR(e, PD_EIO, "zmq_setsockopt(ZMQ_ROUTING_ID=%s)", o->routing_id);
      goto fail;
    }
  }
  if (o->curve_server) {
    if (pd_curve_server_setup(s, o->curve_keys, e) != PD_OK) goto fail;
    if (o->zap_domain && zmq_setsockopt(s, ZMQ_ZAP_DOMAIN, o->zap_domain,
                                        strlen(o->zap_domain)) != 0) {
      ZERR(e, PD_EIO, "zmq_setsockopt(ZMQ_ZAP_DOMAIN=%s)", o->zap_domain);
      goto fail;
    }
  } else if (o->curve_server_key) {
    if (pd_curve_client_setup(s, o->curve_keys, o->curve_server_key, e) != PD_OK) goto fail;
  }
  return s;
fail:
  zmq_close(s);
  return NULL;
}

pd_status pd_net_bind(void *sock, const char *endpoint, char *bound, size_t cap, pd_err *e) {
  if (!sock || !endpoint) return pd_err_set(e, PD_EINVAL, "pd_net_bind: no socket or endpoint");
  if (zmq_bind(sock, endpoint) != 0) return ZERR(e, PD_EIO, "zmq_bind(%s)", endpoint);
  if (bound && cap) {
    char buf[512];
    size_t n = sizeof buf;
    if (zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, buf, &n) != 0)
      return ZERR(e, PD_EIO, "zmq_getsockopt(ZMQ_LAST_ENDPOINT) after binding %s", endpoint);
    buf[sizeof buf - 1] = 0;
    if (strlen(buf) >= cap)
      return pd_err_set(e, PD_ERANGE, "bound endpoint %s does not fit in %zu bytes", buf, cap);
    strcpy(bound, buf);
  }
  return PD_OK;
}

pd_status pd_net_connect(void *sock, const char *endpoint, pd_err *e) {
  if (!sock || !endpoint)
    return pd_err_set(e, PD_EINVAL, "pd_net_connect: no socket or endpoint");
  if (zmq_connect(sock, endpoint) != 0) return ZERR(e, PD_EIO, "zmq_connect(%s)", endpoint);
  return PD_OK;
}

void pd_net_close(void *sock) {
  if (sock) zmq_close(sock);
}

static int sock_type(void *sock) {
  int t = -1;
  size_t n = sizeof t;
  if (zmq_getsockopt(sock, ZMQ_TYPE, &t, &n) != 0) return -1;
  return t;
}

/* ---- send ---- */

static pd_status send_errno(pd_err *e, const char *what) {
  int err = zmq_errno();
  if (err == EAGAIN)
    return pd_err_set(e, PD_EFULL, "%s: the peer's queue is full (high-water mark)", what);
  if (err == EHOSTUNREACH)
    return pd_err_set(e, PD_ENOTFOUND, "%s: no such peer (not connected)", what);
  return pd_err_set(e, PD_EIO, "%s: %s", what, zmq_strerror(err));
}

pd_status pd_net_send(void *sock, const void *rid, size_t rid_len, const Pd__Envelope *env,
                      const pd_net_payload *payloads, int n_payloads, pd_err *e) {
  pd_status st = PD_OK;
  int n_msgs = 0, sent = 0;
  zmq_msg_t stack_msgs[8];
  zmq_msg_t *msgs = stack_msgs;
  int type = sock ? sock_type(sock) : -1;
  bool router = type == ZMQ_ROUTER;
  int total = (router ? 1 : 0) + 1 + (n_payloads > 0 ? n_payloads : 0);

  if (type < 0) st = pd_err_set(e, PD_EINVAL, "pd_net_send: not a socket");
  else if (n_payloads < 0 || (n_payloads > 0 && !payloads))
    st = pd_err_set(e, PD_EINVAL, "pd_net_send: bad payload list");
  else if (router && (!rid || rid_len == 0 || rid_len > PD_NET_ROUTING_ID_MAX))
    st = pd_err_set(e, PD_EINVAL, "pd_net_send: a ROUTER socket needs a routing id");
  if (!st && total > 8) {
    msgs = malloc((size_t)total * sizeof *msgs);
    if (!msgs) {
      msgs = stack_msgs;
      st = pd_err_set(e, PD_ENOMEM, "pd_net_send: out of memory");
    }
  }
  /* Build every frame first. A zero-copy payload is owned by its zmq_msg_t once built (closing
   * an unsent one runs its free_fn), or freed at once when an earlier step failed: every
   * failure path releases it exactly once. */
  if (!st && router) {
    if (zmq_msg_init_size(&msgs[n_msgs], rid_len) != 0)
      st = ZERR(e, PD_ENOMEM, "zmq_msg_init_size(routing id)");
    else
      memcpy(zmq_msg_data(&msgs[n_msgs++]), rid, rid_len);
  }
  size_t env_len = 0;
  if (!st) {
    if (!env || env->version != PD_PROTOCOL_VERSION ||
        env->body_case == PD__ENVELOPE__BODY__NOT_SET)
      st = pd_err_set(e, PD_EINVAL, "pd_net_send: envelope without body or version");
    else if (zmq_msg_init_size(&msgs[n_msgs], pd_wire_encoded_size(env)) != 0)
      st = ZERR(e, PD_ENOMEM, "zmq_msg_init_size(envelope)");
    else {
      zmq_msg_t *m = &msgs[n_msgs++];
      st = pd_wire_encode(env, zmq_msg_data(m), zmq_msg_size(m), &env_len, e);
    }
  }
  for (int i = 0; payloads && i < n_payloads; i++) {
    const pd_net_payload *p = &payloads[i];
    zmq_msg_t *m = &msgs[n_msgs];
    if (p->free_fn && st) {
      p->free_fn((void *)p->data, p->hint); /* ownership passed to us: nothing will send it */
    } else if (p->free_fn) {
      if (zmq_msg_init_data(m, (void *)p->data, p->len, p->free_fn, p->hint) != 0) {
        p->free_fn((void *)p->data, p->hint);
        st = ZERR(e, PD_ENOMEM, "zmq_msg_init_data(payload %d)", i);
        continue;
      }
      n_msgs++;
    } else if (!st) {
      if (p->len && !p->data) {
        st = pd_err_set(e, PD_EINVAL, "pd_net_send: payload %d has no data", i);
      } else if (zmq_msg_init_size(m, p->len) != 0) {
        st = ZERR(e, PD_ENOMEM, "zmq_msg_init_size(payload %d, %zu bytes)", i, p->len);
      } else {
        if (p->len) memcpy(zmq_msg_data(m), p->data, p->len);
        n_msgs++;
      }
    }
  }
  for (; !st && sent < n_msgs; sent++) {
    int flags = sent + 1 < n_msgs ? ZMQ_SNDMORE : 0;
    if (zmq_msg_send(&msgs[sent], sock, flags) < 0) {
      if (sent == 0)
        st = send_errno(e, "pd_net_send");
      else /* libzmq accepts all parts once the first is in; this is a broken socket */
        st = ZERR(e, PD_EIO, "zmq_msg_send(part %d of %d)", sent + 1, n_msgs);
      break;
    }
  }
  for (int i = sent; i < n_msgs; i++) zmq_msg_close(&msgs[i]);
  if (msgs != stack_msgs) free(msgs);
  return st;
}

pd_status pd_net_send_error(void *sock, const void *rid, size_t rid_len, Pd__ErrorCode code,
                            const char *request_id, bool retryable, const char *message,
                            pd_err *e) {
  /* The text may quote anything: keep printable ASCII only, so it always validates as UTF-8,
   * and cut it to the smallest default limit. */
  char text[1024];
  size_t n = 0;
  for (const char *p = message ? message : ""; *p && n + 1 < sizeof text; p++)
    text[n++] = (*p >= ' ' && *p <= '~') ? *p : '?';
  text[n] = 0;
  Pd__Error err = PD__ERROR__INIT;
  err.code = code;
  err.message = text;
  err.request_id = (char *)(request_id && pd_wire_id_ok(request_id) ? request_id : "");
  err.retryable = retryable;
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_ERROR;
  env.error = &err;
  return pd_net_send(sock, rid, rid_len, &env, NULL, 0, e);
}

/* ---- receive ---- */

void pd_net_msg_init(pd_net_msg *m) { memset(m, 0, sizeof *m); }

/* Closes payload frames and the envelope; keeps the arrays for reuse. */
static void msg_reset(pd_net_msg *m) {
  zmq_msg_t *f = m->frames_;
  for (int i = 0; i < m->n_payload; i++) zmq_msg_close(&f[i]);
  m->n_payload = 0;
  m->routing_id_len = 0;
  m->has_peer_key = false;
  pd_wire_msg_clear(&m->wire);
}

void pd_net_msg_clear(pd_net_msg *m) {
  msg_reset(m);
  free(m->frames_);
  free(m->payload);
  free(m->payload_len);
  m->frames_ = NULL;
  m->payload = NULL;
  m->payload_len = NULL;
  m->frames_cap_ = 0;
}

/* zmq_msg_t structures are moved with zmq_msg_move only (a very small message keeps its
 * bytes inside the structure), so growing the frame array moves each one explicitly. */
static bool msg_grow(pd_net_msg *m, int need) {
  if (need <= m->frames_cap_) return true;
  int cap = m->frames_cap_ ? m->frames_cap_ * 2 : 4;
  while (cap < need) cap *= 2;
  const void **p = realloc(m->payload, (size_t)cap * sizeof *p);
  if (!p) return false;
  m->payload = p;
  size_t *pl = realloc(m->payload_len, (size_t)cap * sizeof *pl);
  if (!pl) return false;
  m->payload_len = pl;
  zmq_msg_t *f = malloc((size_t)cap * sizeof *f);
  if (!f) return false;
  zmq_msg_t *old = m->frames_;
  for (int i = 0; i < m->n_payload; i++) {
    zmq_msg_init(&f[i]);
    zmq_msg_move(&f[i], &old[i]);
    zmq_msg_close(&old[i]);
  }
  free(old);
  m->frames_ = f;
  m->frames_cap_ = cap;
  return true;
}

static bool has_more(void *sock) {
  int more = 0;
  size_t n = sizeof more;
  return zmq_getsockopt(sock, ZMQ_RCVMORE, &more, &n) == 0 && more;
}

/* The sender's CURVE key from a frame's User-Id (set by pd_curve_auth: Z85, 40 characters). */
static void peer_key_of(zmq_msg_t *f, pd_net_msg *m) {
  const char *uid = zmq_msg_gets(f, "User-Id");
  m->has_peer_key = uid && strlen(uid) == PD_CURVE_Z85_LEN &&
                    zmq_z85_decode(m->peer_key, uid) != NULL;
}

pd_status pd_net_recv(void *sock, int timeout_ms, const pd_wire_limits *l, pd_net_msg *m,
                      bool *got, pd_err *e) {
  *got = false;
  msg_reset(m);
  if (!sock || !l) return pd_err_set(e, PD_EINVAL, "pd_net_recv: no socket or limits");
  zmq_pollitem_t it = {.socket = sock, .events = ZMQ_POLLIN};
  int rc = zmq_poll(&it, 1, timeout_ms);
  if (rc < 0) {
    if (zmq_errno() == EINTR) return PD_OK;
    return ZERR(e, PD_EIO, "zmq_poll");
  }
  if (rc == 0 || !(it.revents & ZMQ_POLLIN)) return PD_OK;

  int type = sock_type(sock);
  pd_status st = PD_OK; /* first problem found; the rest of the message is still drained */
  zmq_msg_t env;
  bool have_env = false;
  int index = 0; /* frame number within the multipart message */
  for (;;) {
    zmq_msg_t f;
    zmq_msg_init(&f);
    if (zmq_msg_recv(&f, sock, index == 0 ? ZMQ_DONTWAIT : 0) < 0) {
      int err = zmq_errno();
      zmq_msg_close(&f);
      if (index == 0 && (err == EAGAIN || err == EINTR)) return PD_OK; /* spurious wake-up */
      if (!st) st = pd_err_set(e, PD_EIO, "zmq_msg_recv: %s", zmq_strerror(err));
      if (have_env) zmq_msg_close(&env);
      msg_reset(m);
      *got = index > 0;
      return st;
    }
    *got = true;
    bool more = has_more(sock);
    size_t size = zmq_msg_size(&f);
    /* the envelope frame carries the connection's metadata (a ROUTER's routing id frame only
     * sometimes does) */
    if (index <= 1 && !m->has_peer_key) peer_key_of(&f, m);
    if (type == ZMQ_ROUTER && index == 0) {
      if (size == 0 || size > PD_NET_ROUTING_ID_MAX) {
        if (!st) st = pd_err_set(e, PD_EFORMAT, "routing id frame of %zu bytes", size);
      } else {
        memcpy(m->routing_id, zmq_msg_data(&f), size);
        m->routing_id_len = size;
      }
    } else if (!have_env) {
      if (size > l->max_frame_bytes) {
        if (!st)
          st = pd_err_set(e, PD_ERANGE, "envelope frame of %zu bytes exceeds the limit of %zu",
                          size, l->max_frame_bytes);
      } else {
        zmq_msg_init(&env);
        zmq_msg_move(&env, &f);
        have_env = true;
      }
    } else {
      if (m->n_payload >= l->max_payload_frames) {
        if (!st)
          st = pd_err_set(e, PD_ERANGE, "more than %d payload frames", l->max_payload_frames);
      } else if (size > l->max_payload_frame_bytes) {
        if (!st)
          st = pd_err_set(e, PD_ERANGE, "payload frame of %zu bytes exceeds the limit of %zu",
                          size, l->max_payload_frame_bytes);
      } else if (!st) {
        if (!msg_grow(m, m->n_payload + 1)) {
          st = pd_err_set(e, PD_ENOMEM, "pd_net_recv: out of memory");
        } else {
          zmq_msg_t *slot = &((zmq_msg_t *)m->frames_)[m->n_payload];
          zmq_msg_init(slot);
          zmq_msg_move(slot, &f);
          m->payload_len[m->n_payload] = size;
          m->n_payload++;
        }
      }
    }
    zmq_msg_close(&f); /* empty when it was moved into env or a payload slot */
    index++;
    if (!more) break;
  }
  /* Payload pointers from the final array (a very small message's bytes live inside its
   * zmq_msg_t, so pointers are only taken once nothing moves any more). */
  for (int i = 0; i < m->n_payload; i++)
    m->payload[i] = zmq_msg_data(&((zmq_msg_t *)m->frames_)[i]);

  if (!st && !have_env) st = pd_err_set(e, PD_EFORMAT, "message without an envelope frame");
  if (!st) {
    st = pd_wire_decode(&m->wire, zmq_msg_data(&env), zmq_msg_size(&env), l, e);
  }
  if (have_env) zmq_msg_close(&env);
  if (!st) {
    const Pd__Envelope *en = m->wire.env;
    if (en->body_case == PD__ENVELOPE__BODY_KV_HEADER)
      st = pd_wire_validate_kv_frames(en->kv_header, m->n_payload, m->payload_len, e);
    else if (m->n_payload > 0)
      st = pd_err_set(e, PD_EFORMAT, "%s message carries %d payload frames (only kv_header may)",
                      pd_wire_body_name(en->body_case), m->n_payload);
  }
  if (st) {
    /* Keep the routing id so the caller can answer the sender. */
    uint8_t rid[PD_NET_ROUTING_ID_MAX];
    size_t rid_len = m->routing_id_len;
    bool has_key = m->has_peer_key;
    memcpy(rid, m->routing_id, rid_len);
    msg_reset(m);
    memcpy(m->routing_id, rid, rid_len);
    m->routing_id_len = rid_len;
    m->has_peer_key = has_key;
  }
  return st;
}
