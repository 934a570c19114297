/* pd_outbox: ordered, non-blocking sends on a DEALER socket (node.h).
 *
 * A DEALER with ZMQ_IMMEDIATE refuses a message (EAGAIN) while its peer is not connected or
 * its queue is at the high-water mark; blocking there would stall a node's whole loop (a
 * forward pass, heartbeats, other requests). Instead a refused message waits here and the loop
 * retries, keeping the order of everything sent after it. ZeroMQ applies the high-water mark
 * to a message's first frame only and delivers multipart messages atomically, so once the
 * envelope frame is accepted the payload frames always follow. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "node.h"

struct pd_outbox_msg {
  pd_outbox_msg *next;
  void *env;
  size_t env_len;
  int n_payload;
  void **payload;
  size_t *len;
  pd_outbox_free_fn *free_fn; /* releases each payload buffer (free_payload: free()) */
  void *hint;
};

static void free_payload(void *data, void *hint) {
  (void)hint;
  free(data);
}

static void msg_free(pd_outbox_msg *m) {
  free(m->env);
  for (int i = 0; i < m->n_payload; i++)
    if (m->payload[i]) m->free_fn(m->payload[i], m->hint);
  free(m->payload);
  free(m->len);
  free(m);
}

void pd_outbox_init(pd_outbox *o, void *sock, const char *sender) {
  memset(o, 0, sizeof *o);
  o->sock = sock;
  o->sender = sender;
  o->max_msgs = 100000;
}

void pd_outbox_clear(pd_outbox *o) {
  while (o->head) {
    pd_outbox_msg *m = o->head;
    o->head = m->next;
    msg_free(m);
  }
  o->tail = NULL;
  o->n_msgs = o->n_bytes = 0;
}

/* Tries to send m now. 1 = sent (payload buffers handed to ZeroMQ), 0 = not now, -1 = failed
 * for good (dropped). */
static int try_send(pd_outbox *o, pd_outbox_msg *m) {
  int flags = ZMQ_DONTWAIT | (m->n_payload ? ZMQ_SNDMORE : 0);
  if (zmq_send(o->sock, m->env, m->env_len, flags) < 0) {
    int err = zmq_errno();
    if (err == EAGAIN || err == EINTR) return 0;
    pd_log(PD_LOG_WARN, "send failed: %s", zmq_strerror(err));
    return -1;
  }
  for (int i = 0; i < m->n_payload; i++) {
    zmq_msg_t f;
    if (zmq_msg_init_data(&f, m->payload[i], m->len[i], m->free_fn, m->hint) != 0) {
      /* cannot happen with a non-NULL buffer; keep the framing intact with a copy */
      zmq_msg_init_size(&f, m->len[i]);
      memcpy(zmq_msg_data(&f), m->payload[i], m->len[i]);
      m->free_fn(m->payload[i], m->hint);
    }
    m->payload[i] = NULL; /* owned by f now */
    int fl = i + 1 < m->n_payload ? ZMQ_SNDMORE : 0;
    if (zmq_msg_send(&f, o->sock, fl) < 0) {
      pd_log(PD_LOG_WARN, "send of a payload frame failed: %s", zmq_strerror(zmq_errno()));
      zmq_msg_close(&f);
    }
  }
  return 1;
}

pd_status pd_outbox_send(pd_outbox *o, Pd__Envelope *env, void **payload, const size_t *len,
                         int n_payload, pd_err *e) {
  return pd_outbox_send_owned(o, env, payload, len, n_payload, free_payload, NULL, e);
}

pd_status pd_outbox_send_owned(pd_outbox *o, Pd__Envelope *env, void **payload,
                               const size_t *len, int n_payload, pd_outbox_free_fn *free_fn,
                               void *hint, pd_err *e) {
  if (!free_fn) free_fn = free_payload;
  env->sender = (char *)(o->sender ? o->sender : "");
  env->seq = ++o->seq;
  pd_outbox_msg *m = calloc(1, sizeof *m);
  size_t cap = pd_wire_encoded_size(env);
  pd_status st = PD_OK;
  if (!m) {
    st = pd_err_set(e, PD_ENOMEM, "out of memory");
    goto fail;
  }
  m->free_fn = free_fn;
  m->hint = hint;
  m->env = malloc(cap ? cap : 1);
  if (!m->env) {
    st = pd_err_set(e, PD_ENOMEM, "out of memory");
    goto fail;
  }
  if ((st = pd_wire_encode(env, m->env, cap, &m->env_len, e)) != PD_OK) goto fail;
  if (n_payload > 0) {
    m->payload = calloc((size_t)n_payload, sizeof *m->payload);
    m->len = calloc((size_t)n_payload, sizeof *m->len);
    if (!m->payload || !m->len) {
      st = pd_err_set(e, PD_ENOMEM, "out of memory");
      goto fail;
    }
    for (int i = 0; i < n_payload; i++) {
      m->payload[i] = payload[i];
      m->len[i] = len[i];
      payload[i] = NULL;
    }
    m->n_payload = n_payload;
  }
  if (!o->head) {
    int r = try_send(o, m);
    if (r != 0) {
      msg_free(m);
      return PD_OK;
    }
  }
  if (o->n_msgs >= o->max_msgs) { /* the peer has been gone long: drop the oldest */
    pd_outbox_msg *old = o->head;
    o->head = old->next;
    if (!o->head) o->tail = NULL;
    o->n_msgs--;
    msg_free(old);
    o->dropped++;
  }
  if (o->tail) o->tail->next = m;
  else o->head = m;
  o->tail = m;
  o->n_msgs++;
  return PD_OK;
fail:
  for (int i = 0; i < n_payload; i++)
    if (payload[i]) {
      free_fn(payload[i], hint);
      payload[i] = NULL;
    }
  if (m) msg_free(m);
  return st;
}

size_t pd_outbox_flush(pd_outbox *o) {
  while (o->head) {
    int r = try_send(o, o->head);
    if (r == 0) break;
    pd_outbox_msg *m = o->head;
    o->head = m->next;
    if (!o->head) o->tail = NULL;
    o->n_msgs--;
    msg_free(m);
  }
  return o->n_msgs;
}
