/* CURVE keys and allow-lists from files and flags, and refused handshakes in the log (pd/net.h). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "pd/log.h"
#include "pd/net.h"

pd_status pd_curve_allow_file(pd_curve_auth *auth, const char *path, pd_err *e) {
  FILE *f = fopen(path, "r");
  if (!f) return pd_err_set(e, PD_EIO, "cannot read %s: %s", path, strerror(errno));
  char line[512];
  int n = 0, lineno = 0;
  pd_status st = PD_OK;
  while (fgets(line, sizeof line, f)) {
    lineno++;
    char *p = line;
    while (*p == ' ' || *p == '\t') p++;
    if (*p == '#') continue; /* a comment only at the start: '#' is also a Z85 character */
    size_t k = strlen(p);
    while (k && (p[k - 1] == '\n' || p[k - 1] == '\r' || p[k - 1] == ' ' || p[k - 1] == '\t'))
      p[--k] = 0;
    if (!k) continue;
    char canon[PD_CURVE_Z85_LEN + 1];
    if ((st = pd_curve_key_parse(p, NULL, canon, e)) != PD_OK) {
      pd_err_prefix(e, "%s:%d", path, lineno);
      break;
    }
    if ((st = pd_curve_auth_allow(auth, canon, e)) != PD_OK) break;
    n++;
  }
  fclose(f);
  if (st == PD_OK && n == 0) st = pd_err_set(e, PD_EFORMAT, "%s lists no public key", path);
  return st;
}

pd_status pd_curve_keys_from_flags(const char *file, const char *z85, pd_curve_keypair *kp,
                                   bool *have, pd_err *e) {
  memset(kp, 0, sizeof *kp);
  *have = false;
  if (file && *file) {
    pd_status st = pd_curve_keypair_load(file, kp, e);
    if (st) return st;
    if (!kp->secret_z85[0]) return pd_err_set(e, PD_EFORMAT, "%s holds no secret key", file);
    *have = true;
    return PD_OK;
  }
  if (z85 && *z85) {
    pd_status st = pd_curve_keypair_from_secret(z85, kp, e);
    if (st) return st;
    *have = true;
  }
  return PD_OK;
}

/* ---- security events in the log ---- */

void pd_curve_log_denials(pd_curve_auth *auth, pd_log_limit *lim) {
  if (!auth) return;
  pd_curve_denial d[16];
  uint64_t lost = 0;
  int n;
  while ((n = pd_curve_auth_take_denials(auth, d, 16, &lost)) > 0 || lost) {
    lim->held += lost; /* fell out of the handler's record: counted only */
    lost = 0;
    for (int i = 0; i < n; i++)
      if (pd_log_limit_ok(lim, "refusals"))
        pd_log(PD_LOG_WARN, "refused a connection to the %s port from %s (CURVE key %s): %s",
               d[i].domain[0] ? d[i].domain : "CURVE", d[i].address[0] ? d[i].address : "?",
               d[i].key_z85[0] ? d[i].key_z85 : "none", d[i].reason);
    if (n < 16) break;
  }
}

struct pd_hs_watch {
  void *sock, *pair;
  char port[32];
};

pd_hs_watch *pd_hs_watch_start(void *ctx, void *sock, const char *port_name, pd_err *e) {
  pd_hs_watch *w = calloc(1, sizeof *w);
  if (!w) {
    pd_err_set(e, PD_ENOMEM, "out of memory");
    return NULL;
  }
  w->sock = sock;
  snprintf(w->port, sizeof w->port, "%s", port_name);
  char ep[64];
  snprintf(ep, sizeof ep, "inproc://pd-handshakes-%p", (void *)w);
  int zero = 0;
  if (zmq_socket_monitor(sock, ep, ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                                       ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) != 0 ||
      !(w->pair = zmq_socket(ctx, ZMQ_PAIR)) ||
      zmq_setsockopt(w->pair, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
      zmq_connect(w->pair, ep) != 0) {
    pd_err_set(e, PD_EIO, "watching the %s port's handshakes: %s", port_name,
               zmq_strerror(zmq_errno()));
    pd_hs_watch_stop(w);
    return NULL;
  }
  return w;
}

/* What a failed handshake (a monitor event and its value) says about the peer, into out. */
static void hs_reason(uint16_t ev, uint32_t code, char *out, size_t cap) {
  if (ev != ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) /* the peer hung up first: it saw a mismatch */
    snprintf(out, cap, "the handshake did not complete (a peer without the cluster's keys, or "
                       "one that gave up)");
  else if (code == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
    snprintf(out, cap, "it offered no CURVE keys (a process without the cluster's keys)");
  else if (code == ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC)
    snprintf(out, cap, "its handshake did not decrypt (another server key)");
  else
    snprintf(out, cap, "a broken handshake (ZMTP protocol error %#x)", (unsigned)code);
}

void pd_hs_watch_drain(pd_hs_watch *w, pd_log_limit *lim) {
  if (!w) return;
  for (int k = 0; k < 1000; k++) {
    zmq_msg_t f;
    zmq_msg_init(&f);
    if (zmq_msg_recv(&f, w->pair, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&f);
      return;
    }
    uint16_t ev = 0;
    uint32_t val = 0;
    if (zmq_msg_size(&f) >= 6) {
      memcpy(&ev, zmq_msg_data(&f), 2);
      memcpy(&val, (char *)zmq_msg_data(&f) + 2, 4);
    }
    while (zmq_msg_more(&f)) { /* the endpoint frame: the bound one, not the peer */
      zmq_msg_close(&f);
      zmq_msg_init(&f);
      if (zmq_msg_recv(&f, w->pair, 0) < 0) break;
    }
    zmq_msg_close(&f);
    char why[128];
    hs_reason(ev, val, why, sizeof why);
    if (pd_log_limit_ok(lim, "refusals"))
      pd_log(PD_LOG_WARN, "refused a connection to the %s port: %s", w->port, why);
  }
}

void pd_hs_watch_stop(pd_hs_watch *w) {
  if (!w) return;
  zmq_socket_monitor(w->sock, NULL, 0);
  if (w->pair) zmq_close(w->pair);
  free(w);
}
