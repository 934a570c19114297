/* pd-prefill: computes prompts' KV (chunked, batched by the scheduler), samples each
 * request's first token and returns it to the router at once, then ships the KV pages into the
 * decode node's reserved blocks (docs/protocol.md, "KV transfer"; docs/cluster.md for flags).
 *
 * One thread: a loop that polls the router socket and the KV links with a short timeout, and
 * runs one scheduler step whenever there is work. The first token is reported from the
 * scheduler's event callback; the pages are packed there too (the sequence's blocks are freed
 * at the end of that step), and the messages wait in the link's outbox until the socket takes
 * them, so a slow decode node never stalls the forward passes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "node.h"
#include "pd/crc32.h"
#include "pd/kvpack.h"

/* One request in this node. */
typedef struct preq {
  char id[PD_WIRE_ID_MAX_BYTES + 1];
  uint64_t sid; /* scheduler id */
  int n_prompt, n_gen;
  bool has_dest, want_logprobs;
  char dest_node[PD_WIRE_ID_MAX_BYTES + 1];
  char endpoint[256];
  char dest_key[PD_CURVE_Z85_LEN + 1]; /* "" = plain */
  uint64_t reservation_id;
  uint8_t reservation_token[PD_WIRE_TOKEN_BYTES]; /* the decode node's, sent with every KV message */
  int32_t *dest_blocks;
  int n_dest_blocks;
  int32_t *dest_draft_blocks; /* the decode node's draft blocks (none: no draft KV shipped) */
  int n_dest_draft_blocks;
  int64_t t_start;
} preq;

/* A DEALER towards one decode node's KV port. */
typedef struct kv_link {
  char endpoint[256];
  char key[PD_CURVE_Z85_LEN + 1];
  void *sock;
  pd_outbox out;
  int64_t last_used_ms, stuck_since_ms;
} kv_link;

/* A transfer waiting for its KvTransferAck (for the transfer-time metric). */
typedef struct pending_ack {
  char id[PD_WIRE_ID_MAX_BYTES + 1];
  uint64_t reservation_id;
  double t0; /* pd_mono_s when its KV was queued */
} pending_ack;

typedef struct prefill {
  pd_node node;
  preq **reqs;
  int n_reqs, cap_reqs;
  uint64_t next_sid;
  kv_link **links;
  int n_links;
  pending_ack acks[1024];
  int n_acks;
  size_t chunk_bytes;
  pd_metric *m_kv_pack_s, *m_kv_check_s, *m_kv_send_s; /* the loop thread's time on KV */
  pd_metric *m_kv_frames_pinned, *m_kv_frames_malloc; /* KV frames by where their memory came from */
  pd_metric *m_requests, *m_kv_bytes, *m_kv_seconds, *m_kv_transfers, *m_errors_invalid,
      *m_errors_internal, *m_errors_kv, *m_ttft, *m_draft_kv_transfers;
} prefill;

static prefill g;

/* ---- requests ---- */

static preq *find_by_id(const char *id) {
  for (int i = 0; i < g.n_reqs; i++)
    if (!strcmp(g.reqs[i]->id, id)) return g.reqs[i];
  return NULL;
}

static preq *find_by_sid(uint64_t sid) {
  for (int i = 0; i < g.n_reqs; i++)
    if (g.reqs[i]->sid == sid) return g.reqs[i];
  return NULL;
}

static void remove_req(preq *r) {
  for (int i = 0; i < g.n_reqs; i++)
    if (g.reqs[i] == r) {
      g.reqs[i] = g.reqs[--g.n_reqs];
      break;
    }
  free(r->dest_blocks);
  free(r->dest_draft_blocks);
  free(r);
}

static void fill_load(pd_node *n, Pd__Load *l) {
  uint64_t q = 0;
  for (int i = 0; i < g.n_reqs; i++) q += (uint64_t)(g.reqs[i]->n_prompt + g.reqs[i]->n_gen);
  pd_sched_stats s;
  pd_sched_get_stats(n->rt.sched, &s);
  l->queued_prompt_tokens = q;
  l->total_blocks = (uint32_t)pd_kv_pool_num_blocks(n->rt.pool);
  l->free_blocks = (uint32_t)pd_kv_pool_num_available(n->rt.pool);
  l->running_seqs = (uint32_t)s.running;
  l->waiting_seqs = (uint32_t)s.waiting;
}

/* ---- KV links ---- */

static kv_link *link_get(const char *endpoint, const char *key, pd_err *e) {
  for (int i = 0; i < g.n_links; i++)
    if (!strcmp(g.links[i]->endpoint, endpoint) && !strcmp(g.links[i]->key, key))
      return g.links[i];
  kv_link *l = calloc(1, sizeof *l);
  kv_link **v = realloc(g.links, (size_t)(g.n_links + 1) * sizeof *v);
  if (!l || !v) {
    free(l);
    if (v) g.links = v;
    pd_err_set(e, PD_ENOMEM, "out of memory");
    return NULL;
  }
  g.links = v;
  snprintf(l->endpoint, sizeof l->endpoint, "%s", endpoint);
  snprintf(l->key, sizeof l->key, "%s", key);
  pd_net_sock_opts so;
  pd_net_sock_opts_init(&so, ZMQ_DEALER);
  so.send_timeout_ms = 0;
  so.sndhwm = 100000; /* KV chunks of many requests may queue towards one decode node */
  if (key[0]) {
    if (!g.node.have_keys && pd_curve_keypair_generate(&g.node.keys, e) != PD_OK) {
      free(l);
      return NULL;
    }
    g.node.have_keys = true;
    so.curve_keys = &g.node.keys;
    so.curve_server_key = l->key;
  }
  l->sock = pd_net_socket(g.node.zctx, &so, e);
  if (!l->sock || pd_net_connect(l->sock, endpoint, e) != PD_OK) {
    pd_net_close(l->sock);
    free(l);
    return NULL;
  }
  pd_outbox_init(&l->out, l->sock, g.node.node_id);
  l->last_used_ms = pd_now_ms();
  g.links[g.n_links++] = l;
  pd_log(PD_LOG_INFO, "KV link to %s opened", endpoint);
  return l;
}

static void link_close(int i) {
  kv_link *l = g.links[i];
  pd_outbox_clear(&l->out);
  pd_net_close(l->sock);
  free(l);
  g.links[i] = g.links[--g.n_links];
}

/* Flushes every link; drops the queue of a link stuck for 30 s (its decode node is gone: the
 * router has migrated those requests) and closes links idle for 2 minutes. */
static void links_flush(void) {
  int64_t now = pd_now_ms();
  for (int i = 0; i < g.n_links;) {
    kv_link *l = g.links[i];
    if (pd_outbox_flush(&l->out) > 0) {
      if (!l->stuck_since_ms) l->stuck_since_ms = now;
      if (now - l->stuck_since_ms > 30000) {
        pd_log(PD_LOG_WARN, "KV link to %s: nothing sent for 30 s, dropping %zu messages",
               l->endpoint, l->out.n_msgs);
        pd_outbox_clear(&l->out);
        l->stuck_since_ms = 0;
      }
    } else {
      l->stuck_since_ms = 0;
      if (now - l->last_used_ms > 120000) {
        link_close(i);
        continue;
      }
    }
    i++;
  }
}

static void ack_track(const char *id, uint64_t res) {
  if (g.n_acks == (int)(sizeof g.acks / sizeof g.acks[0])) {
    memmove(g.acks, g.acks + 1, (size_t)(g.n_acks - 1) * sizeof g.acks[0]);
    g.n_acks--;
  }
  pending_ack *a = &g.acks[g.n_acks++];
  snprintf(a->id, sizeof a->id, "%s", id);
  a->reservation_id = res;
  a->t0 = pd_mono_s();
}

static void on_kv_ack(const Pd__KvTransferAck *a) {
  for (int i = 0; i < g.n_acks; i++)
    if (g.acks[i].reservation_id == a->reservation_id && !strcmp(g.acks[i].id, a->request_id)) {
      if (a->ok) pd_metric_observe(g.m_kv_seconds, pd_mono_s() - g.acks[i].t0);
      g.acks[i] = g.acks[--g.n_acks];
      break;
    }
  if (!a->ok) {
    pd_metric_add(g.m_errors_kv, 1);
    pd_log(PD_LOG_WARN, "KV transfer of %s refused by the decode node: %s", a->request_id,
           a->error && a->error->message ? a->error->message : "?");
  }
}

static void links_drain(void) {
  pd_net_msg m;
  pd_net_msg_init(&m);
  for (int i = 0; i < g.n_links; i++) {
    for (int k = 0; k < 1000; k++) {
      bool got = false;
      pd_err e = {0};
      pd_status st = pd_net_recv(g.links[i]->sock, 0, &g.node.lim, &m, &got, &e);
      if (!got) break;
      if (st != PD_OK) {
        pd_log(PD_LOG_WARN, "malformed message on the KV link: %s", e.msg);
        continue;
      }
      if (m.wire.env->body_case == PD__ENVELOPE__BODY_KV_ACK) on_kv_ack(m.wire.env->kv_ack);
    }
  }
  pd_net_msg_clear(&m);
}

/* Takes nf page-locked frame buffers from the node's pool: all of them (true) or none (false:
 * the pool is off, at its cap, or the backend has no host_alloc; the caller mallocs). */
static bool frames_get(void **frames, int nf) {
  pd_framepool *p = g.node.kv_frames;
  if (!p || pd_framepool_buf_bytes(p) < g.chunk_bytes) return false;
  for (int f = 0; f < nf; f++)
    if (!(frames[f] = pd_framepool_get(p))) {
      while (f-- > 0) {
        pd_framepool_release(p, frames[f]);
        frames[f] = NULL;
      }
      return false;
    }
  return true;
}

/* Gives back frames that were not sent. */
static void frames_put(void **frames, int nf, bool pinned) {
  for (int f = 0; f < nf; f++) {
    if (pinned) pd_framepool_release(g.node.kv_frames, frames[f]);
    else free(frames[f]);
    frames[f] = NULL;
  }
}

/* Packs one cache's pages of the request (the model's, or with draft the draft model's: all
 * layers, all heads, in chunks of whole layers) from src[nb] and queues their headers on link l
 * towards dst[nb]. On a GPU the pages are gathered from device memory into the frames
 * (pd_node_kv_pack: one kv_gather_runs call per frame); the step's forward is queued before on
 * the same stream, so the KV it wrote is there. */
static pd_status ship_pages(preq *r, kv_link *l, bool draft, const int32_t *src,
                            const int32_t *dst, int nb, uint32_t *n_chunks, uint64_t *total,
                            pd_err *e) {
  pd_node *n = &g.node;
  const pd_kv_pages *pg = draft ? &n->draft_pages : &n->pages;
  pd_kv_slice whole = {0, pg->num_layers, 0, pg->num_kv_heads};
  size_t seg = pd_kvpack_segment_bytes(pg, &whole);
  size_t per_layer = 2 * (size_t)nb * seg;
  if (!seg || !per_layer) return pd_err_set(e, PD_EINVAL, "empty KV layout");
  int lpc = (int)(g.chunk_bytes / per_layer);
  if (lpc < 1) lpc = 1;
  for (int lb = 0; lb < pg->num_layers; lb += lpc) {
    int le = lb + lpc < pg->num_layers ? lb + lpc : pg->num_layers;
    pd_kv_slice s = {lb, le, 0, pg->num_kv_heads};
    size_t size = pd_kvpack_size(pg, &s, nb);
    int nf = (int)((size + g.chunk_bytes - 1) / g.chunk_bytes);
    if (nf > n->lim.max_payload_frames)
      return pd_err_set(e, PD_ERANGE, "a KV chunk needs %d frames", nf);
    void *frames[256] = {0};
    size_t lens[256];
    uint64_t fb[256];
    uint32_t crc = 0;
    pd_status st = PD_OK;
    size_t off = 0;
    double t_pack = 0.0, t_check = 0.0;
    /* the message's frames all come from the page-locked pool (buffers of chunk_bytes; the
     * last frame may use less) or, when it cannot give them all, all from malloc */
    bool pinned = frames_get(frames, nf);
    for (int f = 0; f < nf && st == PD_OK; f++) {
      size_t len = size - off < g.chunk_bytes ? size - off : g.chunk_bytes;
      if (!pinned) frames[f] = malloc(len);
      if (!frames[f]) {
        st = pd_err_set(e, PD_ENOMEM, "out of memory");
        break;
      }
      const double t0 = pd_mono_s();
      st = draft ? pd_node_draft_kv_pack(n, &s, src, nb, off, frames[f], len, e)
                 : pd_node_kv_pack(n, &s, src, nb, off, frames[f], len, e);
      const double t1 = pd_mono_s();
      crc = pd_crcpool_crc32(n->kv_crc, crc, frames[f], len);
      t_pack += t1 - t0;
      t_check += pd_mono_s() - t1;
      lens[f] = len;
      fb[f] = len;
      off += len;
    }
    pd_metric_add(g.m_kv_pack_s, t_pack);
    pd_metric_add(pinned ? g.m_kv_frames_pinned : g.m_kv_frames_malloc, nf);
    pd_metric_add(g.m_kv_check_s, t_check);
    if (st != PD_OK) {
      frames_put(frames, nf, pinned);
      return st;
    }
    Pd__KvTransferHeader h;
    pd__kv_transfer_header__init(&h);
    h.request_id = r->id;
    h.reservation_id = r->reservation_id;
    h.reservation_token.data = r->reservation_token;
    h.reservation_token.len = sizeof r->reservation_token;
    h.chunk_index = *n_chunks;
    h.draft = draft;
    h.layer_begin = (uint32_t)lb;
    h.layer_end = (uint32_t)le;
    h.head_begin = 0;
    h.head_end = (uint32_t)pg->num_kv_heads;
    h.num_layers = (uint32_t)pg->num_layers;
    h.block_size = (uint32_t)pg->block_size;
    h.head_dim = (uint32_t)pg->head_dim;
    h.dtype = pd_wire_dtype_from_pd(pg->dtype);
    h.n_block_ids = (size_t)nb;
    h.block_ids = (int32_t *)dst;
    h.offset = pd_kvpack_offset(pg, &s, nb);
    h.n_frame_bytes = (size_t)nf;
    h.frame_bytes = fb;
    h.checksum_opt_case = PD__KV_TRANSFER_HEADER__CHECKSUM_OPT_CRC32;
    h.crc32 = crc;
    Pd__Envelope env;
    pd_wire_envelope_init(&env);
    env.body_case = PD__ENVELOPE__BODY_KV_HEADER;
    env.kv_header = &h;
    const double t_send = pd_mono_s();
    st = pinned ? pd_outbox_send_owned(&l->out, &env, frames, lens, nf,
                                       pd_framepool_release_cb, n->kv_frames, e)
                : pd_outbox_send(&l->out, &env, frames, lens, nf, e);
    pd_metric_add(g.m_kv_send_s, pd_mono_s() - t_send);
    if (st != PD_OK) return st;
    (*n_chunks)++;
    *total += size;
  }
  return PD_OK;
}

/* Ships the request's KV: the model's pages, the draft model's where the decode node reserved
 * blocks for them and this node computed them, then KvTransferDone. */
static pd_status ship_kv(preq *r, const pd_sched_event *ev, const Pd__TokenLogprob *first_lp,
                         pd_err *e) {
  pd_node *n = &g.node;
  int bs = n->pages.block_size, n_ctx = r->n_prompt + r->n_gen;
  int nb = (n_ctx + bs - 1) / bs;
  if (ev->n_kv_tokens < n_ctx || ev->n_blocks < nb || nb != r->n_dest_blocks)
    return pd_err_set(e, PD_EINVAL, "KV of %d tokens in %d blocks, %d destination blocks",
                      ev->n_kv_tokens, ev->n_blocks, r->n_dest_blocks);
  kv_link *l = link_get(r->endpoint, r->dest_key, e);
  if (!l) return e->code;
  l->last_used_ms = pd_now_ms();
  uint32_t n_chunks = 0;
  uint64_t total = 0;
  pd_status st = ship_pages(r, l, false, ev->block_table, r->dest_blocks, nb, &n_chunks, &total, e);
  if (st != PD_OK) return st;
  /* (a draft without its KV of the whole context ships nothing: the decode node's draft then
   * computes it) */
  if (r->n_dest_draft_blocks == nb && ev->draft_block_table && ev->n_draft_kv_tokens >= n_ctx &&
      ev->n_draft_blocks >= nb) {
    st = ship_pages(r, l, true, ev->draft_block_table, r->dest_draft_blocks, nb, &n_chunks,
                    &total, e);
    if (st != PD_OK) return st;
    pd_metric_add(g.m_draft_kv_transfers, 1);
  }
  Pd__KvTransferDone d;
  pd__kv_transfer_done__init(&d);
  d.request_id = r->id;
  d.reservation_id = r->reservation_id;
  d.reservation_token.data = r->reservation_token;
  d.reservation_token.len = sizeof r->reservation_token;
  d.n_chunks = n_chunks;
  d.total_bytes = total;
  d.n_tokens = (uint32_t)n_ctx;
  d.first_token_id = ev->token;
  d.first_logprob = (Pd__TokenLogprob *)first_lp;
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_KV_DONE;
  env.kv_done = &d;
  st = pd_outbox_send(&l->out, &env, NULL, NULL, 0, e);
  if (st) return st;
  pd_outbox_flush(&l->out);
  pd_metric_add(g.m_kv_bytes, (double)total);
  pd_metric_add(g.m_kv_transfers, 1);
  ack_track(r->id, r->reservation_id);
  pd_log(PD_LOG_DEBUG, "%s: %d tokens of KV (%llu bytes, %u chunks) queued to %s", r->id, n_ctx,
         (unsigned long long)total, n_chunks, r->dest_node);
  return PD_OK;
}

/* ---- scheduler events: the first token ---- */

static void on_event(void *user, const pd_sched_event *ev) {
  (void)user;
  preq *r = find_by_sid(ev->id);
  if (!r) {
    pd_sched_abort(g.node.rt.sched, ev->id);
    return;
  }
  if (ev->token < 0) return;
  pd_node *n = &g.node;
  Pd__TokenLogprob lp;
  Pd__TopLogprob *top_p[PD_SAMPLE_MAX_LOGPROBS], top_s[PD_SAMPLE_MAX_LOGPROBS];
  pd_node_send_first_token(n, r->id, ev, r->n_prompt, &lp, top_p, top_s);
  pd_metric_observe(g.m_ttft, (double)(pd_now_ms() - r->t_start) / 1000.0);

  if (ev->finish == PD_FINISH_NONE) {
    if (r->has_dest) {
      pd_err e = {0};
      pd_status st = ship_kv(r, ev, ev->logprobs ? &lp : NULL, &e);
      if (st == PD_EBACKEND && pd_node_check_device(n)) {
        /* the node leaves the cluster: the router retries the prompt elsewhere */
      } else if (st != PD_OK) {
        pd_metric_add(g.m_errors_kv, 1);
        pd_log(PD_LOG_ERROR, "%s: cannot ship KV: %s", r->id, e.msg);
        pd_node_send_error(n, PD__ERROR_CODE__ERROR_CODE_INTERNAL, r->id, true,
                           "prefill node could not ship the KV pages: %s", e.msg);
      }
    }
    /* this node's part is done: the decode node continues (blocks freed after the step) */
    pd_sched_abort(n->rt.sched, r->sid);
  }
  remove_req(r);
}

/* ---- messages from the router ---- */

static void on_prefill(const Pd__Prefill *m) {
  pd_node *n = &g.node;
  if (find_by_id(m->request_id)) {
    pd_node_send_error(n, PD__ERROR_CODE__ERROR_CODE_INVALID_REQUEST, m->request_id, false,
                       "request id is already in use on this node");
    return;
  }
  const Pd__KvDestination *d = m->dest;
  if (d) {
    const Pd__KvGeometry *k = d->kv;
    if (k->block_size != (uint32_t)n->pages.block_size ||
        k->num_layers != (uint32_t)n->pages.num_layers ||
        k->head_dim != (uint32_t)n->pages.head_dim ||
        pd_wire_dtype_to_pd(k->dtype) != (int)n->pages.dtype ||
        k->kv_head_end > (uint32_t)n->pages.num_kv_heads) {
      pd_metric_add(g.m_errors_invalid, 1);
      pd_node_send_error(n, PD__ERROR_CODE__ERROR_CODE_UNSUPPORTED, m->request_id, false,
                         "the destination KV cache has another geometry than this node's");
      return;
    }
  }
  /* the draft's KV goes where the decode node has blocks for it and its draft's cache is this
   * node's draft's; otherwise only the model's (that node's draft computes the context) */
  const Pd__KvGeometry *dk = d && d->n_draft_block_ids ? d->draft_kv : NULL;
  const pd_kv_pages *dp = &n->draft_pages;
  const bool ship_draft = dk && dp->num_layers && dk->block_size == (uint32_t)dp->block_size &&
                          dk->num_layers == (uint32_t)dp->num_layers &&
                          dk->head_dim == (uint32_t)dp->head_dim &&
                          pd_wire_dtype_to_pd(dk->dtype) == (int)dp->dtype &&
                          dk->kv_head_end <= (uint32_t)dp->num_kv_heads &&
                          d->n_draft_block_ids == d->n_block_ids;
  pd_sampling_params p;
  pd_logit_bias *bias = NULL;
  pd_status st = pd_node_sampling(n, m->request_id, m->sampling, &p, &bias);
  if (st != PD_OK) {
    if (st != PD_ENOMEM) pd_metric_add(g.m_errors_invalid, 1);
    return;
  }
  preq *r = calloc(1, sizeof *r);
  if (!r) {
    free(bias);
    free(r);
    pd_node_send_error(n, PD__ERROR_CODE__ERROR_CODE_INTERNAL, m->request_id, true,
                       "out of memory");
    return;
  }
  snprintf(r->id, sizeof r->id, "%s", m->request_id);
  r->sid = ++g.next_sid;
  r->n_prompt = (int)m->n_prompt_token_ids;
  r->n_gen = (int)m->n_generated_token_ids;
  r->want_logprobs = p.logprobs >= 0;
  r->t_start = pd_now_ms();
  if (d) {
    r->has_dest = true;
    snprintf(r->dest_node, sizeof r->dest_node, "%s", d->node_id);
    snprintf(r->endpoint, sizeof r->endpoint, "%s", d->endpoint);
    if (d->curve_public_key.len == PD_CURVE_KEY_BYTES)
      zmq_z85_encode(r->dest_key, d->curve_public_key.data, PD_CURVE_KEY_BYTES);
    r->reservation_id = d->reservation_id;
    memcpy(r->reservation_token, d->reservation_token.data, sizeof r->reservation_token);
    r->n_dest_blocks = (int)d->n_block_ids;
    r->dest_blocks = malloc(d->n_block_ids * sizeof *r->dest_blocks);
    if (!r->dest_blocks) {
      free(bias);
      free(r);
      pd_node_send_error(n, PD__ERROR_CODE__ERROR_CODE_INTERNAL, m->request_id, true,
                         "out of memory");
      return;
    }
    memcpy(r->dest_blocks, d->block_ids, d->n_block_ids * sizeof *r->dest_blocks);
    if (ship_draft && (r->dest_draft_blocks = malloc(d->n_draft_block_ids * sizeof(int32_t)))) {
      memcpy(r->dest_draft_blocks, d->draft_block_ids, d->n_draft_block_ids * sizeof(int32_t));
      r->n_dest_draft_blocks = (int)d->n_draft_block_ids;
    }
  }
  st = pd_node_sched_prefill(n, m, r->sid, &p);
  free(bias);
  if (st != PD_OK) {
    pd_metric_add(g.m_errors_invalid, 1);
    free(r->dest_blocks);
    free(r->dest_draft_blocks);
    free(r);
    return;
  }
  if (g.n_reqs == g.cap_reqs) {
    int cap = g.cap_reqs ? 2 * g.cap_reqs : 64;
    preq **v = realloc(g.reqs, (size_t)cap * sizeof *v);
    if (!v) {
      pd_sched_abort(n->rt.sched, r->sid);
      free(r->dest_blocks);
      free(r->dest_draft_blocks);
      free(r);
      pd_node_send_error(n, PD__ERROR_CODE__ERROR_CODE_INTERNAL, m->request_id, true,
                         "out of memory");
      return;
    }
    g.reqs = v;
    g.cap_reqs = cap;
  }
  g.reqs[g.n_reqs++] = r;
  pd_metric_add(g.m_requests, 1);
  pd_log(PD_LOG_DEBUG, "%s: prefill of %d + %d tokens%s", r->id, r->n_prompt, r->n_gen,
         r->has_dest ? "" : " (no decode stage)");
}

static void on_router_msg(pd_node *n, const Pd__Envelope *env) {
  switch (env->body_case) {
    case PD__ENVELOPE__BODY_PREFILL:
      on_prefill(env->prefill);
      break;
    case PD__ENVELOPE__BODY_ABORT: {
      preq *r = find_by_id(env->abort->request_id);
      if (r) {
        pd_sched_abort(n->rt.sched, r->sid);
        pd_log(PD_LOG_DEBUG, "%s: aborted", r->id);
        remove_req(r);
      }
      break;
    }
    case PD__ENVELOPE__BODY_ERROR:
      pd_log(PD_LOG_WARN, "router: error %d: %s", (int)env->error->code,
             env->error->message ? env->error->message : "");
      break;
    default:
      pd_log(PD_LOG_WARN, "unexpected %s from the router", pd_wire_body_name(env->body_case));
      break;
  }
}

static void on_router_reset(pd_node *n) {
  while (g.n_reqs > 0) {
    preq *r = g.reqs[g.n_reqs - 1];
    pd_sched_abort(n->rt.sched, r->sid);
    remove_req(r);
  }
}

/* The scheduler failed a step (a bug or a backend failure): every request in it gets an error
 * the router can act on (retry elsewhere), and the node goes on. */
static void fail_all(const char *why) {
  pd_metric_add(g.m_errors_internal, 1);
  while (g.n_reqs > 0) {
    preq *r = g.reqs[g.n_reqs - 1];
    pd_node_send_error(&g.node, PD__ERROR_CODE__ERROR_CODE_INTERNAL, r->id, true,
                       "prefill step failed: %s", why);
    pd_sched_abort(g.node.rt.sched, r->sid);
    remove_req(r);
  }
}

int main(int argc, char **argv) {
  pd_node_opts o;
  int rc = pd_node_opts_parse(&o, PD__ROLE__ROLE_PREFILL, argc, argv);
  if (rc) return rc == 2 ? 0 : 1;
  pd_log_init("pd-prefill", o.verbose);
  pd_node_install_signals();
  pd_node_tune_malloc(); /* KV frames stay on the heap (no page faults per frame) */
  g.chunk_bytes = (size_t)o.kv_chunk_mb << 20;
  pd_node_hooks hooks = {.fill_load = fill_load, .on_router_msg = on_router_msg,
                         .on_router_reset = on_router_reset};
  pd_err e = {0};
  pd_node *n = &g.node;
  if (pd_node_open(n, &o, PD__ROLE__ROLE_PREFILL, on_event, NULL, &hooks, &e) != PD_OK) {
    pd_log(PD_LOG_ERROR, "%s", e.msg);
    pd_node_close(n);
    return 1;
  }
  pd_metrics *m = n->metrics;
  g.m_requests = pd_metrics_counter(m, "pd_node_requests_total", "Requests received.", NULL);
  g.m_kv_bytes = pd_metrics_counter(m, "pd_node_kv_transfer_bytes_total",
                                    "KV page bytes sent to decode nodes.", "direction=\"sent\"");
  g.m_kv_transfers = pd_metrics_counter(m, "pd_node_kv_transfers_total",
                                        "KV transfers sent.", "direction=\"sent\"");
  g.m_draft_kv_transfers = pd_metrics_counter(
      m, "pd_node_draft_kv_transfers_total",
      "KV transfers that carried the draft model's pages too.", "direction=\"sent\"");
  static const char *const kv_work[3] = {"pack", "checksum", "send"};
  pd_metric **kv_work_m[3] = {&g.m_kv_pack_s, &g.m_kv_check_s, &g.m_kv_send_s};
  for (int i = 0; i < 3; i++) {
    char lab[64];
    snprintf(lab, sizeof lab, "direction=\"sent\",work=\"%s\"", kv_work[i]);
    *kv_work_m[i] = pd_metrics_counter(m, "pd_node_kv_loop_seconds_total",
                                       "Time the node's loop thread spent on KV pages.", lab);
  }
  static const char kv_frames_help[] =
      "KV frames sent, by memory: page-locked from the pool (--kv-pinned-mb) or malloc'ed (no "
      "pool, or all its buffers still queued or in ZeroMQ).";
  g.m_kv_frames_pinned = pd_metrics_counter(m, "pd_node_kv_frames_total", kv_frames_help,
                                            "memory=\"page-locked\"");
  g.m_kv_frames_malloc = pd_metrics_counter(m, "pd_node_kv_frames_total", kv_frames_help,
                                            "memory=\"malloc\"");
  g.m_kv_seconds = pd_metrics_histogram(m, "pd_node_kv_transfer_seconds",
                                        "From queueing a request's KV pages to the decode "
                                        "node's acknowledgement.",
                                        NULL, pd_metrics_fine_buckets,
                                        pd_metrics_fine_buckets_n);
  g.m_ttft = pd_metrics_histogram(m, "pd_node_time_to_first_token_seconds",
                                  "From receiving a Prefill to sampling its first token.", NULL,
                                  pd_metrics_latency_buckets, pd_metrics_latency_buckets_n);
  g.m_errors_invalid = pd_metrics_counter(m, "pd_node_errors_total", "Errors by kind.",
                                          "kind=\"invalid_request\"");
  g.m_errors_internal = pd_metrics_counter(m, "pd_node_errors_total", "Errors by kind.",
                                           "kind=\"internal\"");
  g.m_errors_kv = pd_metrics_counter(m, "pd_node_errors_total", "Errors by kind.",
                                     "kind=\"kv_transfer\"");
  pd_log(PD_LOG_INFO, "prefill node %s: model %s (%d blocks of %d tokens), router %s, metrics %d",
         n->node_id, n->model_name, n->pages.num_blocks, n->pages.block_size, o.router_ep,
         pd_metrics_server_port(n->metrics_srv));

  if (n->kv_frames)
    pd_log(PD_LOG_INFO, "KV frames in page-locked memory (up to %d MiB)", o.kv_pinned_mb);
  int64_t next_metrics = 0;
  while (!pd_node_stop_flag) {
    int64_t wait = pd_node_tick(n);
    links_flush();
    bool work = pd_sched_has_work(n->rt.sched);
    if (work) wait = 0;
    if (wait > 100) wait = 100;
    for (int i = 0; i < g.n_links && wait > 2; i++)
      if (g.links[i]->out.n_msgs) wait = 2;
    zmq_pollitem_t items[65];
    int ni = 0;
    items[ni++] = (zmq_pollitem_t){n->router_sock, 0, ZMQ_POLLIN, 0};
    for (int i = 0; i < g.n_links && ni < 65; i++)
      items[ni++] = (zmq_pollitem_t){g.links[i]->sock, 0, ZMQ_POLLIN, 0};
    zmq_poll(items, ni, (long)wait);
    pd_node_drain_router(n);
    links_drain();
    if (pd_sched_has_work(n->rt.sched)) {
      const double t0 = pd_mono_s();
      if (pd_sched_step(n->rt.sched, &e) != PD_OK) {
        pd_log(PD_LOG_ERROR, "step failed: %s", e.msg);
        /* a failed device takes the node out of the cluster: the router retries its prompts */
        if (!pd_node_check_device(n)) fail_all(e.msg);
      } else {
        pd_node_check_device(n);
      }
      pd_metric_observe(n->m_step_seconds, pd_mono_s() - t0);
      pd_node_update_metrics(n); /* O(1): scrapes see every step */
      links_flush();
    }
    if (pd_now_ms() >= next_metrics) {
      pd_node_update_metrics(n);
      next_metrics = pd_now_ms() + 250;
    }
  }
  const bool dead = n->device_failed; /* deregistered already */
  pd_log(PD_LOG_INFO, "shutting down");
  if (!dead) pd_node_deregister(n, "shutdown", 500);
  on_router_reset(n);
  while (g.n_links) link_close(g.n_links - 1);
  free(g.links);
  free(g.reqs);
  pd_node_close(n);
  return dead ? PD_NODE_EXIT_DEVICE : 0;
}
