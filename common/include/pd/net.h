/* ZeroMQ transport: sockets with sane options, CURVE security, and the framing of Envelopes.
 *
 * Sockets (docs/protocol.md, "Sockets"):
 *   router cluster port   ROUTER, bound by pd-router; each node connects a DEALER whose
 *                         routing id is its node_id (Register, Heartbeat, FirstToken, ...)
 *   router client port    ROUTER, bound by pd-router; clients connect DEALERs
 *   decode KV port        ROUTER, bound by pd-decode; prefill nodes connect a DEALER each
 * Every node binds 127.0.0.1 unless configured otherwise.
 *
 * A message is the frames
 *   [routing id]  only on ROUTER sockets (received: the peer; sent: the destination)
 *   [Envelope]    one protobuf frame (pd/wire.h), at most limits.max_frame_bytes
 *   [payload]...  0..limits.max_payload_frames raw frames, each at most
 *                 limits.max_payload_frame_bytes (KV bytes after a KvTransferHeader)
 * pd_net_recv enforces the sizes and the frame count BEFORE decoding, decodes with the capped
 * allocator, validates the body (pd_wire_validate, plus the payload frames against a
 * KvTransferHeader), and always consumes the whole multipart message, so one bad message never
 * desynchronises the socket. Sockets also get ZMQ_MAXMSGSIZE, so a peer that sends a frame
 * larger than any limit is disconnected by libzmq before the frame is buffered.
 *
 * Errors: every libzmq call is checked; failures return a pd_status with a message naming
 * the call, the endpoint and zmq_strerror. Sockets are not thread-safe (libzmq): one thread
 * per socket, inproc:// between threads of one process. */
#ifndef PD_NET_H
#define PD_NET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd/log.h"
#include "pd/status.h"
#include "pd/wire.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- CURVE keys ---- */

#define PD_CURVE_KEY_BYTES 32
#define PD_CURVE_Z85_LEN 40 /* Z85 text of a key, without the NUL */

typedef struct pd_curve_keypair {
  char public_z85[PD_CURVE_Z85_LEN + 1];
  char secret_z85[PD_CURVE_Z85_LEN + 1]; /* "" when only the public key is known */
} pd_curve_keypair;

/* Whether this libzmq supports CURVE (built with libsodium). */
bool pd_curve_available(void);
/* A new random keypair (zmq_curve_keypair). PD_EUNSUPPORTED without CURVE support. */
pd_status pd_curve_keypair_generate(pd_curve_keypair *kp, pd_err *e);
/* Checks that z85 is a 40-character Z85 key (surrounding whitespace allowed) and writes its
 * 32 bytes to key (may be NULL) and its canonical text to out (may be NULL, 41 bytes). */
pd_status pd_curve_key_parse(const char *z85, uint8_t key[PD_CURVE_KEY_BYTES],
                             char out[PD_CURVE_Z85_LEN + 1], pd_err *e);
/* Fills kp from a secret key: secret_z85 and its derived public key (zmq_curve_public). */
pd_status pd_curve_keypair_from_secret(const char *secret_z85, pd_curve_keypair *kp, pd_err *e);
/* Loads a key file in the ZeroMQ certificate format (czmq zcert, as written by
 * pd_curve_keypair_save):
 *     curve
 *         public-key = "<40 chars Z85>"
 *         secret-key = "<40 chars Z85>"      (absent in a public certificate)
 * '#' starts a comment; quotes are optional. A file holding only a secret key gets its public
 * key derived. PD_ENOTFOUND, PD_EIO, PD_EFORMAT (no or bad key). */
pd_status pd_curve_keypair_load(const char *path, pd_curve_keypair *kp, pd_err *e);
/* Writes kp to path in that format; with a secret key the file is created mode 0600.
 * secret == false writes only the public key (to give to peers). */
pd_status pd_curve_keypair_save(const char *path, const pd_curve_keypair *kp, bool secret,
                                pd_err *e);
/* Reads a key from the environment variable name: a Z85 secret key (the public key is derived)
 * when secret is true, else a public key (secret_z85 left ""). PD_ENOTFOUND when unset. */
pd_status pd_curve_keypair_from_env(const char *name, bool secret, pd_curve_keypair *kp,
                                    pd_err *e);
/* A key given on a command line as Z85 text or as the path of a key file (a certificate as
 * pd_curve_keypair_load reads it): with secret, a keypair (the file must hold the secret key);
 * without, a public key (secret_z85 left ""; a secret file's public half). A file is tried
 * first when arg names one. */
pd_status pd_curve_key_arg(const char *arg, bool secret, pd_curve_keypair *kp, pd_err *e);

/* CURVE roles on a socket, before bind/connect. A server needs its own secret key; a client
 * needs its own keypair and the server's public key (a wrong one: the handshake fails and the
 * client never connects; nothing is delivered either way). */
pd_status pd_curve_server_setup(void *sock, const pd_curve_keypair *server, pd_err *e);
pd_status pd_curve_client_setup(void *sock, const pd_curve_keypair *client,
                                const char *server_public_z85, pd_err *e);

/* Client authentication for CURVE servers: a ZAP handler (RFC 27) on a thread of its own that
 * admits only listed client public keys. It serves every CURVE server socket of ctx; start it
 * before those sockets bind. Without one, any client that knows the server's public key is
 * admitted (traffic is still encrypted).
 *
 * Domains: a server socket's ZAP domain (pd_net_sock_opts.zap_domain, ZMQ_ZAP_DOMAIN) picks the
 * policy. Handshakes in an open domain (pd_curve_auth_open_domain) are admitted whatever the
 * client's key (a port whose clients prove themselves otherwise, e.g. with an API key); in any
 * other domain only allow-listed keys are. Handshakes of other mechanisms (a plain client of a
 * CURVE server never gets this far; NULL-mechanism sockets with a domain) are refused.
 *
 * The client's identity: every admitted handshake's User-Id is the client's public key in Z85,
 * so each message received from that connection carries it (zmq_msg_gets "User-Id";
 * pd_net_recv puts it in pd_net_msg.peer_key). */
typedef struct pd_curve_auth pd_curve_auth;
pd_curve_auth *pd_curve_auth_start(void *ctx, pd_err *e);
/* Adds a client public key (Z85) to the allow list; thread-safe with the handler. */
pd_status pd_curve_auth_allow(pd_curve_auth *a, const char *client_public_z85, pd_err *e);
/* Admits every client key in ZAP domain domain (1..31 bytes; at most 8 open domains). */
pd_status pd_curve_auth_open_domain(pd_curve_auth *a, const char *domain, pd_err *e);
/* Handshakes refused so far (for tests and metrics). */
uint64_t pd_curve_auth_denied(pd_curve_auth *a);
/* A refused handshake, as the handler saw it. */
typedef struct pd_curve_denial {
  char domain[32];                   /* the server socket's ZAP domain ("" if none) */
  char address[64];                  /* the client's IP address */
  char key_z85[PD_CURVE_Z85_LEN + 1]; /* its public key ("" when it offered none) */
  const char *reason;                /* static text: "key not allowed", ... */
} pd_curve_denial;
/* Takes up to max refused handshakes (oldest first) from the handler's record of the latest
 * ones (it keeps 64; older ones are only counted: *dropped, may be NULL, gets how many were
 * lost since the last call). Returns how many were written to out. Thread-safe. */
int pd_curve_auth_take_denials(pd_curve_auth *a, pd_curve_denial *out, int max,
                               uint64_t *dropped);
/* Stops the thread and unbinds; NULL is a no-op. Call before closing ctx. */
void pd_curve_auth_stop(pd_curve_auth *a);

/* ---- context and sockets ---- */

/* A ZeroMQ context with io_threads I/O threads (<= 0: 1) whose termination never blocks on
 * unsent messages (ZMQ_BLOCKY = 0). Free with pd_net_ctx_free. */
void *pd_net_ctx_new(int io_threads, pd_err *e);
void pd_net_ctx_free(void *ctx);

typedef struct pd_net_sock_opts {
  int type;                 /* ZMQ_ROUTER, ZMQ_DEALER, ZMQ_PUSH, ZMQ_PULL, ZMQ_PAIR */
  int linger_ms;            /* pending messages kept at close. Default 0 */
  int sndhwm, rcvhwm;       /* messages queued per peer. Default 1000 */
  int64_t max_msg_size;     /* ZMQ_MAXMSGSIZE: a peer sending a larger frame is disconnected.
                               Default: the largest frame pd_wire_limits_init allows; -1 = none */
  int send_timeout_ms;      /* ZMQ_SNDTIMEO: -1 block, 0 never (ROUTER default), DEALER 5000 */
  int reconnect_ivl_ms;     /* Default 100 */
  int reconnect_ivl_max_ms; /* exponential back-off cap. Default 5000 */
  bool router_mandatory;    /* ROUTER: sending to an unknown peer fails (PD_ENOTFOUND) instead
                               of being dropped silently. Default true for ROUTER */
  bool router_handover;     /* ROUTER: a new connection with a routing id already in use takes
                               it over (a restarted node reconnecting). Default true for ROUTER */
  bool immediate;           /* ZMQ_IMMEDIATE: queue only on completed connections. Default true
                               for DEALER/PUSH, so a dead peer does not swallow messages */
  int tcp_keepalive_idle_s; /* TCP keepalive on (idle, interval in seconds, probes); 0 = off.
                               Default 30, 10, 3 */
  int tcp_keepalive_intvl_s;
  int tcp_keepalive_cnt;
  int heartbeat_ivl_ms;     /* ZMTP PING interval; 0 = off. Default 1000, timeout 3x */
  int handshake_ivl_ms;     /* ZMTP/CURVE handshake limit. Default 5000 */
  const char *routing_id;   /* DEALER: its identity as ROUTER peers see it (node_id); NULL:
                               random. At most 255 bytes, not starting with a zero byte */
  /* CURVE: server when curve_server is true (curve_keys has the secret key); client when
   * curve_server_key is set (curve_keys = own keypair). Neither: plain ZMTP (NULL mechanism). */
  const pd_curve_keypair *curve_keys;
  bool curve_server;
  const char *curve_server_key; /* server's public key, Z85 */
  const char *zap_domain;       /* CURVE server: its ZAP domain (pd_curve_auth policies); NULL:
                                   none */
} pd_net_sock_opts;

void pd_net_sock_opts_init(pd_net_sock_opts *o, int type);
/* A socket of ctx with o's options (NULL: defaults for ZMQ_DEALER). */
void *pd_net_socket(void *ctx, const pd_net_sock_opts *o, pd_err *e);
/* zmq_bind; bound (may be NULL, cap bytes) receives the resolved endpoint (ZMQ_LAST_ENDPOINT),
 * e.g. "tcp://127.0.0.1:40123" for "tcp://127.0.0.1:*". */
pd_status pd_net_bind(void *sock, const char *endpoint, char *bound, size_t cap, pd_err *e);
pd_status pd_net_connect(void *sock, const char *endpoint, pd_err *e);
/* Closes a socket; NULL is a no-op. */
void pd_net_close(void *sock);

/* ---- envelopes ---- */

/* One raw payload frame to send. With free_fn == NULL the bytes are copied; otherwise they
 * are sent without a copy and free_fn(data, hint) runs (on a libzmq thread) once libzmq is done
 * with them — also when the send fails. */
typedef struct pd_net_payload {
  const void *data;
  size_t len;
  void (*free_fn)(void *data, void *hint);
  void *hint;
} pd_net_payload;

/* Sends [routing id] [env] [payload 0..n) as one multipart message. rid/rid_len: required on
 * ROUTER sockets (the peer's routing id), ignored (may be NULL) otherwise. env must have a body
 * and version PD_PROTOCOL_VERSION (pd_wire_envelope_init). Returns PD_ENOTFOUND when a ROUTER
 * with router_mandatory has no such peer, PD_EFULL when the peer's queue is full within the
 * send timeout (backpressure: nothing was sent), PD_EINVAL, PD_EIO. */
pd_status pd_net_send(void *sock, const void *rid, size_t rid_len, const Pd__Envelope *env,
                      const pd_net_payload *payloads, int n_payloads, pd_err *e);

/* Sends an Error envelope (the usual answer to a malformed or refused message). Non-printable
 * characters of message become '?' and it is cut to 1023 bytes; a request_id that is not a
 * valid id is left out. */
pd_status pd_net_send_error(void *sock, const void *rid, size_t rid_len, Pd__ErrorCode code,
                            const char *request_id, bool retryable, const char *message,
                            pd_err *e);

#define PD_NET_ROUTING_ID_MAX 255

/* A received message. Zero-initialise or pd_net_msg_init before first use; pd_net_recv clears
 * it first, so one pd_net_msg can be reused in a loop; pd_net_msg_clear frees it. */
typedef struct pd_net_msg {
  uint8_t routing_id[PD_NET_ROUTING_ID_MAX]; /* ROUTER sockets: the sender */
  size_t routing_id_len;                      /* 0 on other socket types */
  uint8_t peer_key[PD_CURVE_KEY_BYTES];       /* the sender's CURVE public key, as the ZAP
                                                 handler admitted it (User-Id) */
  bool has_peer_key;                          /* false without CURVE or without a handler */
  pd_wire_msg wire;                           /* wire.env: the decoded, validated Envelope */
  int n_payload;
  const void **payload;  /* [n_payload]; valid until the next recv into or clear of this msg */
  size_t *payload_len;   /* [n_payload] */
  /* private: */
  void *frames_;         /* zmq_msg_t[n_payload]: payloads are not copied */
  int frames_cap_;
} pd_net_msg;

void pd_net_msg_init(pd_net_msg *m);
void pd_net_msg_clear(pd_net_msg *m);

/* Receives one message, waiting up to timeout_ms (-1: forever, 0: poll). *got tells whether a
 * message was consumed. PD_OK with *got true: m holds a validated envelope. PD_OK with *got
 * false: nothing arrived in time. A malformed message (too many frames, a frame too large, bad
 * bytes, failed validation) is consumed and returns its error (PD_EFORMAT, PD_ERANGE, PD_EINVAL,
 * PD_EUNSUPPORTED) with *got true and m->routing_id set, so a ROUTER can answer the sender with
 * an Error; m->wire.env is NULL then. PD_EIO when libzmq fails (context terminated, ...). */
pd_status pd_net_recv(void *sock, int timeout_ms, const pd_wire_limits *l, pd_net_msg *m,
                      bool *got, pd_err *e);

/* ---- keys from files and flags ---- */

/* Loads "one Z85 public key per line; lines starting with # are comments" (a '#' elsewhere is
 * part of a key: it is a Z85 character; zcert files are not accepted, keys only) and allows
 * each on auth. */
pd_status pd_curve_allow_file(pd_curve_auth *auth, const char *path, pd_err *e);
/* Keypair from --curve-secret-file or --curve-secret-key (either may be NULL). *have is false
 * when neither is given. */
pd_status pd_curve_keys_from_flags(const char *file, const char *z85, pd_curve_keypair *kp,
                                   bool *have, pd_err *e);


/* ---- refused handshakes in the log ---- */

/* Logs (WARN) the handshakes auth refused since the last call, one line each through lim:
 * "refused a connection to the cluster port from 127.0.0.1 (key K): key not allowed". The port
 * is named after the socket's ZAP domain ("cluster", "client", "kv"). NULL auth: no-op. */
void pd_curve_log_denials(pd_curve_auth *auth, pd_log_limit *lim);

/* Handshakes that fail before the ZAP handler is asked, on one server socket: a peer that
 * offers no CURVE keys to a CURVE server (a node started without the cluster's keys), one that
 * uses another server key, a broken handshake. A socket monitor (inproc PAIR) on sock; drain
 * it now and then, stop it before closing sock. */
typedef struct pd_hs_watch pd_hs_watch;
pd_hs_watch *pd_hs_watch_start(void *ctx, void *sock, const char *port_name, pd_err *e);
/* Logs (WARN, through lim) the failures seen since the last call. */
void pd_hs_watch_drain(pd_hs_watch *w, pd_log_limit *lim);
/* NULL: no-op. */
void pd_hs_watch_stop(pd_hs_watch *w);

#ifdef __cplusplus
}
#endif
#endif
