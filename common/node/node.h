/* libpdnode: what pd-prefill, pd-decode and pd-router share around the engine and the wire.
 *
 *   - logging: one line per event on stderr, "2024-05-01T12:00:00.123Z pd-decode INFO msg"
 *   - the --ready-file (JSON written atomically once a process serves)
 *   - a metrics/health HTTP server on a thread of its own (nodes: GET /metrics, GET /health)
 *   - pd_outbox: an ordered, non-blocking send queue over one ZeroMQ DEALER socket, so a node's
 *     single loop never blocks on a slow or absent peer (messages wait and go out in order)
 *   - pd_node: a node's runtime, its DEALER to the router, registration, heartbeats and the
 *     common flags; the role-specific loops live in prefill-node/ and decode-node/.
 *
 * Threading: everything here belongs to the node's main thread, except the metrics server
 * (its own thread; it reads a pd_metrics registry, which is thread-safe, and an atomic flag)
 * and the release of sent payload frames (ZeroMQ's I/O thread: pd_outbox_free_fn,
 * pd_framepool_release). */
#ifndef PD_NODE_H
#define PD_NODE_H

#include <cjson/cJSON.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "framepool.h"
#include "pd/crc32.h"
#include "pd/kvpack.h"
#include "pd/log.h"
#include "pd/metrics.h"
#include "pd/net.h"
#include "pd/runtime.h"
#include "pd/wire.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- metrics/health HTTP server on its own thread ---- */

typedef struct pd_metrics_server pd_metrics_server;
/* Serves GET /metrics (m rendered), GET /health (200 while *healthy, else 503: readiness) and
 * GET /live (200 while *progress_ms, the main loop's last turn, is less than PD_NODE_STALL_MS
 * old, else 503: liveness) on host:port (port 0: a free one). NULL with e set on failure. */
pd_metrics_server *pd_metrics_server_start(const char *host, int port, pd_metrics *m, atomic_bool *healthy,
                           atomic_llong *progress_ms, pd_err *e);
int pd_metrics_server_port(const pd_metrics_server *s);
void pd_metrics_server_stop(pd_metrics_server *s);

/* ---- ordered non-blocking sends on one socket ---- */

typedef struct pd_outbox_msg pd_outbox_msg;
typedef struct pd_outbox {
  void *sock;
  pd_outbox_msg *head, *tail;
  size_t n_msgs, n_bytes;
  size_t max_msgs;      /* queue cap: beyond it the oldest messages are dropped (peer gone) */
  uint64_t dropped;
  const char *sender;   /* Envelope.sender */
  uint64_t seq;
} pd_outbox;

void pd_outbox_init(pd_outbox *o, void *sock, const char *sender);
/* Drops everything queued (the peer is gone for good). */
void pd_outbox_clear(pd_outbox *o);
/* Encodes env (sender and seq filled in here) and sends it after anything already queued,
 * followed by payload frames (each malloc'ed buffer is taken over and freed here, even on
 * failure). PD_ENOMEM or PD_EINVAL (encoding) are the only failures; a peer that does not take
 * the message now only delays it. */
pd_status pd_outbox_send(pd_outbox *o, Pd__Envelope *env, void **payload, const size_t *len,
                         int n_payload, pd_err *e);
/* A payload buffer's release function, in ZeroMQ's zmq_free_fn shape. It runs on whichever
 * thread lets go of the frame last: ZeroMQ's I/O thread after the send (possibly after the
 * socket was closed, until zmq_ctx_term returns), or the caller's (pd_outbox_clear, the
 * drop-oldest path, failures). */
typedef void pd_outbox_free_fn(void *data, void *hint);
/* pd_outbox_send whose payload buffers are released with free_fn(buf, hint) instead of free()
 * (NULL: free()): every payload frame of this message, sent, dropped or failed, exactly once. */
pd_status pd_outbox_send_owned(pd_outbox *o, Pd__Envelope *env, void **payload,
                               const size_t *len, int n_payload, pd_outbox_free_fn *free_fn,
                               void *hint, pd_err *e);
/* Sends what the socket takes now, in order. Returns the number of messages still queued. */
size_t pd_outbox_flush(pd_outbox *o);

/* ---- a node ---- */

#define PD_NODE_STALL_MS 60000 /* main loop silent this long: stop heartbeating */

typedef struct pd_node_opts {
  const char *model_dir, *served_name, *router_ep, *node_id, *bind, *advertise, *ready_file;
  int kv_port, metrics_port, kv_chunk_mb;
  int kv_pinned_mb; /* page-locked KV memory in MiB (0 = off): prefill: cap of the frame pool;
                       decode: cap of the receive buffer (kv_rx) */
  int kv_crc_threads; /* threads for a KV message's CRC-32, the loop's included (0, 1: the loop) */
  double kv_budget_ms; /* decode: KV page work per loop turn while sequences decode (-1: about
                          one step, 2-20 ms; 0: everything queued) */
  const char *curve_secret_file, *curve_secret_key, *router_public_key, *curve_allow_file;
  bool insecure;         /* run without the cluster's keys (logs a warning) */
  bool unified;          /* decode: also prefill the prompts it decodes (a unified node) */
  int fail_device_after; /* testing: inject a device fault after this many steps (0 = never) */
  bool verbose, help;
  pd_runtime_opts rt;
} pd_node_opts;

/* A node's exit status when its device failed (pd_node_check_device); 1 is a start-up or usage
 * failure, 0 a shutdown on SIGTERM/SIGINT. */
#define PD_NODE_EXIT_DEVICE 3

/* Parses argv for role (prefill or decode). Returns 0 to run, 1 on a usage error (printed),
 * 2 after printing --help. */
int pd_node_opts_parse(pd_node_opts *o, Pd__Role role, int argc, char **argv);

typedef struct pd_node pd_node;

/* What a role adds to the shared loop. */
typedef struct pd_node_hooks {
  /* Fills the load fields for Register/Heartbeat. */
  void (*fill_load)(pd_node *n, Pd__Load *load);
  /* A validated message from the router (anything but RegisterAck/HeartbeatAck). */
  void (*on_router_msg)(pd_node *n, const Pd__Envelope *env);
  /* The router restarted (new incarnation) or asked us to register again after losing us:
   * every request the node holds belongs to a router that no longer knows it. */
  void (*on_router_reset)(pd_node *n);
  void *ud;
} pd_node_hooks;

struct pd_node {
  pd_node_opts o;
  Pd__Role role;
  char node_id[PD_WIRE_ID_MAX_BYTES + 1];
  /* the routing id of its DEALER to the router: "<node_id>#<128 random bits, hex>", a secret
   * between the two (the router hands a routing id to whichever connection presents it) */
  char rid[PD_WIRE_ID_MAX_BYTES + 2 + 2 * PD_WIRE_TOKEN_BYTES];
  char router_key[PD_CURVE_Z85_LEN + 1]; /* the router's public key; "" = plain ZMTP */
  char model_name[256];
  uint64_t fingerprint, incarnation;
  pd_runtime rt;
  pd_kv_pages pages;         /* the engine's KV cache, in backend memory: host pages on the CPU
                                backend, device pointers on a GPU (then only pd_kvstage may
                                touch them: use pd_node_kv_pack / pd_node_kv_unpack) */
  pd_kv_layer *layers;       /* [num_layers] backing pages.layers */
  /* the draft model's KV cache (speculative decoding with a draft; num_layers 0: none), and the
   * staging through the draft's backend where it is not the model's */
  pd_kv_pages draft_pages;
  pd_kv_layer *draft_layers;
  pd_kvstage *draft_kvstage;
  uint64_t draft_fingerprint;
  pd_kvstage *kvstage;       /* KV staging through the backend; NULL on host-memory backends */
  pd_framepool *kv_frames;   /* prefill: page-locked KV frames of kv_chunk_mb MiB (framepool.h);
                                NULL on backends without host_alloc or with --kv-pinned-mb 0.
                                Freed by pd_node_close after zmq_ctx_term, before the backend */
  void *kv_rx;               /* decode: page-locked receive buffer of kv_rx_bytes from host_alloc
                                (pd_node_kv_rx_buf), grown to the largest KV message seen, at
                                most kv_rx_cap; loop thread only; freed by pd_node_close before
                                the backend */
  size_t kv_rx_bytes, kv_rx_cap; /* cap: --kv-pinned-mb MiB on a decode node whose backend has
                                host_alloc, else 0 (never used) */
  pd_crcpool *kv_crc;        /* the KV messages' CRC-32 over --kv-crc-threads threads (the loop
                                thread is one of them; pd/crc32.h); used by the loop only */
  pd_wire_limits lim;        /* receive limits with this node's geometry */
  void *zctx;
  pd_curve_auth *auth;       /* decode: admits listed prefill keys on the KV port */
  pd_log_limit deny_log;     /* refused KV-port handshakes */
  pd_curve_keypair keys;
  bool have_keys;
  void *router_sock;
  pd_outbox router;
  pd_node_hooks hooks;
  /* registration (main thread) */
  bool registered;
  uint64_t router_incarnation;
  uint32_t hb_timeout_ms;
  int64_t next_register_ms, next_load_ms;
  /* heartbeats: a thread of their own with its own DEALER (routing id "<node_id>/hb"), so a
   * long forward pass never makes the router think the node died. The main loop publishes
   * its load and a progress time; the thread stops heartbeating when the main loop has made
   * no progress for PD_NODE_STALL_MS (a hung node must leave rotation). */
  pthread_t hb_thread;
  bool hb_started;
  pthread_mutex_t hb_mu;
  Pd__Load hb_load;               /* guarded by hb_mu */
  atomic_bool hb_registered, hb_reregister, hb_stop;
  atomic_uint hb_interval_ms;
  atomic_llong hb_last_ack_ms, hb_progress_ms;
  bool ready_written;
  bool device_failed, fault_injected; /* pd_node_check_device */
  char kv_endpoint[256];     /* decode: advertised KV endpoint */
  uint8_t kv_public_key[PD_CURVE_KEY_BYTES];
  bool kv_curve;
  /* metrics */
  pd_metrics *metrics;
  pd_metrics_server *metrics_srv;
  atomic_bool healthy;
  pd_metric *m_registered, *m_running, *m_waiting, *m_kv_usage, *m_kv_free, *m_kv_total,
      *m_prefix_queries, *m_prefix_hits, *m_prefix_rate, *m_gen_tokens, *m_prompt_tokens,
      *m_steps, *m_step_seconds, *m_preemptions, *m_graph_replays;
  /* speculative decoding (NULL when off) */
  pd_metric *m_spec_proposed, *m_spec_accepted, *m_spec_len, *m_spec_verify_s, *m_spec_draft_s,
      *m_spec_draft_steps;
  pd_sched_stats last_stats;
};

/* Loads the runtime (on_event goes to the scheduler), creates the ZeroMQ context, the CURVE
 * setup, the DEALER to the router and the metrics server. Fills kv_endpoint etc. later via
 * pd_node_set_kv_endpoint (decode). */
pd_status pd_node_open(pd_node *n, const pd_node_opts *o, Pd__Role role,
                       pd_sched_event_fn on_event, void *ev_user, const pd_node_hooks *hooks,
                       pd_err *e);
void pd_node_close(pd_node *n);

/* Registration, the load snapshot for heartbeats, the outbox: call every loop iteration.
 * Returns the milliseconds until it needs to run again. */
int64_t pd_node_tick(pd_node *n);
/* Receives and dispatches every message waiting on the router socket (non-blocking). */
void pd_node_drain_router(pd_node *n);
/* Sends an envelope to the router (ordered, never blocks). */
void pd_node_send(pd_node *n, Pd__Envelope *env);
/* Sends Error{code, request_id, retryable, message} to the router. */
void pd_node_send_error(pd_node *n, Pd__ErrorCode code, const char *request_id, bool retryable,
                        const char *fmt, ...) __attribute__((format(printf, 5, 6)));
/* Deregisters (best effort: flushes for up to timeout_ms). */
void pd_node_deregister(pd_node *n, const char *reason, int timeout_ms);
/* Whether the node's device has failed: a sticky backend failure (pd_backend_status: an
 * illegal address, an ECC error, a launch failure) after which nothing it computes can be
 * trusted. The first call that sees one logs it, marks the node unhealthy, deregisters with the
 * reason "device failed: ..." (the router then retries or migrates the node's requests as for a
 * node that died, and stops routing to it) and sets pd_node_stop_flag; the node's main then
 * shuts down without sending its requests errors and returns PD_NODE_EXIT_DEVICE, for its
 * supervisor to restart it. Call after every step and every failed device operation; it also
 * injects the --fail-device-after fault when that many steps have run. */
bool pd_node_check_device(pd_node *n);
/* Updates the scheduler gauges and counters from the runtime. */
void pd_node_update_metrics(pd_node *n);
/* Fills a KvGeometry from the node's cache. */
void pd_node_geometry(const pd_node *n, Pd__KvGeometry *g);
/* Converts pd_logprobs into a TokenLogprob whose `top` array is top_buf (holding n_top
 * entries of top_store). */
/* Request id's sampling parameters from the wire (defaults when w is NULL), n = 1 (the router
 * fans n out); *bias holds the logit bias p points into (free it after use). On failure the
 * router gets the error (INTERNAL for PD_ENOMEM, else INVALID_REQUEST) and the status comes
 * back. */
pd_status pd_node_sampling(pd_node *n, const char *id, const Pd__SamplingParams *w,
                           pd_sampling_params *p, pd_logit_bias **bias);
/* Adds the prompt (and generated tokens) of Prefill m to the node's scheduler as request sid;
 * on failure the router gets the error (CONTEXT_TOO_LONG or INVALID_REQUEST) and the status
 * comes back. */
pd_status pd_node_sched_prefill(pd_node *n, const Pd__Prefill *m, uint64_t sid,
                                const pd_sampling_params *p);
/* FirstToken for the router from the scheduler event of a sequence's first token of this
 * attempt (n_prompt: its prompt tokens): the token, its logprob when asked (written into lp, with
 * top_p / top_s [PD_SAMPLE_MAX_LOGPROBS] as room for the alternatives), the finish reason, the
 * prompt and cached token counts and the prompt logprobs. A prefill node's answer, and a unified
 * node's for the prompts it prefills itself. */
void pd_node_send_first_token(pd_node *n, const char *id, const pd_sched_event *ev, int n_prompt,
                              Pd__TokenLogprob *lp, Pd__TopLogprob **top_p,
                              Pd__TopLogprob *top_s);
void pd_node_logprob(const pd_logprobs *lp, Pd__TokenLogprob *out, Pd__TopLogprob **top_buf,
                     Pd__TopLogprob *top_store);
/* Bytes [off, off + len) of the staging buffer (pd/kvpack.h) of slice s over the node's blocks
 * ids[nb], packed from / unpacked into the node's KV cache: pd_kvpack_*_range on host-memory
 * backends, pd_kvstage_*_range (kv_gather / kv_scatter) on devices. Same checks and errors;
 * PD_EBACKEND when the device failed (the request should fail; the backend is not usable). */
pd_status pd_node_kv_pack(pd_node *n, const pd_kv_slice *s, const int32_t *ids, int nb,
                          size_t off, void *buf, size_t len, pd_err *e);
pd_status pd_node_kv_unpack(pd_node *n, const pd_kv_slice *s, const int32_t *ids, int nb,
                            size_t off, const void *buf, size_t len, pd_err *e);
/* The same for the draft model's cache (n->draft_pages). */
pd_status pd_node_draft_kv_pack(pd_node *n, const pd_kv_slice *s, const int32_t *ids, int nb,
                                size_t off, void *buf, size_t len, pd_err *e);
pd_status pd_node_draft_kv_unpack(pd_node *n, const pd_kv_slice *s, const int32_t *ids, int nb,
                                  size_t off, const void *buf, size_t len, pd_err *e);
/* The geometry of the draft's cache for the wire (draft_pages). */
void pd_node_draft_geometry(const pd_node *n, Pd__KvGeometry *g);
/* Decode: the node's page-locked receive buffer, at least len bytes, for a KV message to be
 * copied into (pd_crcpool_copy_crc32v) and unpacked from by one DMA. NULL (use the frames as
 * they are) when len is 0 or over kv_rx_cap, the backend has no host_alloc, or host_alloc
 * failed (then kv_rx_cap is lowered to the buffer already held, so a refusing driver is not
 * asked again per message). Grows (a new buffer, then host_free of the old) in whole MiB; the
 * contents are not kept. Loop thread only. */
void *pd_node_kv_rx_buf(pd_node *n, size_t len);

/* Process-wide malloc settings for a node (call once at start, before threads): KV frames
 * (malloc'ed by the prefill loop when not from its page-locked pool, kv_frames, and freed by
 * ZeroMQ's I/O thread after the send; received ones malloc'ed by that thread and freed after
 * the unpack) stay on the heap up to 32 MiB, and up to 256 MiB of freed heap stays mapped, so a
 * frame's pages are not page-faulted in again on its first write after the last one's free
 * gave them back. glibc's own dynamic threshold does most
 * of this already after the first free; this makes it hold for every frame. Frames above 32 MiB
 * (--kv-chunk-mb > 32) are still mmapped each time (glibc's cap). Best effort: silent where the
 * allocator (a sanitizer's) ignores it. */
void pd_node_tune_malloc(void);

/* Set by the signal handler (SIGINT/SIGTERM): the loops end when it is nonzero. */
extern volatile sig_atomic_t pd_node_stop_flag;
void pd_node_install_signals(void);

#ifdef __cplusplus
}
#endif
#endif
