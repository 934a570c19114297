/* The router's node registry: registration, heartbeats, liveness, load, node choice.
 *
 * A node registers (Register) and heartbeats with its load; every message from it counts as a
 * sighting for pd_liveness. A node silent for heartbeat_timeout / 2 is SUSPECT (it gets no new
 * work but keeps its requests), after heartbeat_timeout it is dead: removed, and each of its
 * choices gets an outcome (route_node_failed). A heartbeat from a node the router does not
 * know (the router restarted, or the node was declared dead) is answered with
 * HeartbeatAck{reregister}; a Register with a new incarnation under a known id is a restarted
 * process: the old one is treated as dead first.
 *
 * Who a node is: its Register names its id; its connection is the routing id its DEALER chose,
 * "<node id>#<128 random bits>" (nobody else can take that connection over: ROUTER_HANDOVER
 * hands a routing id to whoever presents it, so it must be a secret), and, with node
 * authentication, the CURVE key the ZAP handler admitted it with. The first key an id registers
 * with stays bound to it for the router's lifetime: a process with another key cannot register
 * under that id (refused, logged), whether the node is alive or not.
 *
 * Load estimates: between heartbeats the router counts what it sent itself (blocks reserved on
 * a decode node, prompt tokens sent to a prefill node), so a burst of requests spreads over the
 * nodes instead of piling onto the one that looked emptiest at the last heartbeat. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zmq.h>

#include "pd/kvcache.h"
#include "router.h"

void registry_init(router *r) {
  pd_liveness_opts lo = {.suspect_ms = r->o.heartbeat_timeout_ms / 2,
                         .dead_ms = r->o.heartbeat_timeout_ms};
  if (lo.suspect_ms < 1) lo.suspect_ms = 1;
  pd_err e = {0};
  r->live = pd_liveness_new(&lo, &e);
  PD_ASSERT(r->live);
  pd_map_init(&r->node_keys, 0, PD_MAP_COPY_KEYS);
}

static void node_free(rnode *n) {
  free(n->affinity);
  free(n);
}

void registry_free(router *r) {
  pd_map_slot *en;
  for (pd_map_it it = {0}; (en = pd_map_next(&r->node_keys, &it));) free(pd_map_ptr(en));
  pd_map_free(&r->node_keys);
  for (int i = 0; i < r->n_nodes; i++) node_free(r->nodes[i]);
  free(r->nodes);
  r->nodes = NULL;
  r->n_nodes = 0;
  pd_liveness_free(r->live);
}

rnode *registry_find(router *r, const char *id) {
  for (int i = 0; i < r->n_nodes; i++)
    if (!r->nodes[i]->dead && !strcmp(r->nodes[i]->id, id)) return r->nodes[i];
  return NULL;
}

rnode *registry_find_rid(router *r, const uint8_t *rid, size_t len) {
  for (int i = 0; i < r->n_nodes; i++) {
    rnode *n = r->nodes[i];
    if (!n->dead && n->rid_len == len && !memcmp(n->rid, rid, len)) return n;
  }
  return NULL;
}

/* Removes dead nodes that no choice refers to any more. */
static void reap(router *r) {
  for (int i = 0; i < r->n_nodes;) {
    rnode *n = r->nodes[i];
    if (n->dead && n->n_subs == 0) {
      r->nodes[i] = r->nodes[--r->n_nodes];
      node_free(n);
      continue;
    }
    i++;
  }
}

static void node_dead(router *r, rnode *n, const char *why) {
  if (n->dead) return;
  n->dead = true;
  pd_liveness_remove(r->live, n->id);
  pd_log(PD_LOG_WARN, "node %s (%s) removed: %s", n->id,
         n->role == PD__ROLE__ROLE_DECODE ? "decode" : "prefill", why);
  rmetrics_error(r, "node_failed");
  route_node_failed(r, n, why);
  reap(r);
  route_dispatch(r);
}

pd_status router_send_node(router *r, rnode *n, Pd__Envelope *env) {
  pd_err e = {0};
  env->sender = "router";
  env->seq = ++r->seq;
  pd_status st = pd_net_send(r->cluster_sock, n->rid, n->rid_len, env, NULL, 0, &e);
  router_after_send(r);
  if (st != PD_OK)
    pd_log(PD_LOG_WARN, "send %s to %s: %s", pd_wire_body_name(env->body_case), n->id, e.msg);
  return st;
}

static void send_raw(router *r, const pd_net_msg *m, Pd__Envelope *env) {
  env->sender = "router";
  env->seq = ++r->seq;
  pd_err e = {0};
  pd_net_send(r->cluster_sock, m->routing_id, m->routing_id_len, env, NULL, 0, &e);
  router_after_send(r);
}

static void register_reply(router *r, const pd_net_msg *m, bool ok, const char *why) {
  Pd__RegisterAck a;
  pd__register_ack__init(&a);
  a.accepted = ok;
  Pd__Error err;
  if (!ok) {
    pd__error__init(&err);
    err.code = PD__ERROR_CODE__ERROR_CODE_UNSUPPORTED;
    err.message = (char *)why;
    a.error = &err;
  }
  a.heartbeat_interval_ms = (uint32_t)r->o.heartbeat_interval_ms;
  a.heartbeat_timeout_ms = (uint32_t)r->o.heartbeat_timeout_ms;
  a.router_incarnation = r->incarnation;
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_REGISTER_ACK;
  env.register_ack = &a;
  send_raw(r, m, &env);
}

static void load_update(rnode *n, const Pd__Load *l) {
  if (!l) return;
  n->queued_tokens = l->queued_prompt_tokens;
  n->free_blocks = l->free_blocks;
  n->running = l->running_seqs;
  n->waiting = l->waiting_seqs;
  n->reserved_blocks = l->reserved_blocks;
  n->spec_acceptance = l->spec_acceptance;
  n->est_free_blocks = l->free_blocks;
  n->est_queued_tokens = (int64_t)l->queued_prompt_tokens;
}

/* Node authentication: the key g's connection was admitted with, bound to its id at the first
 * registration; false (refused and logged) when the id is bound to another key. */
static bool register_key_ok(router *r, const pd_net_msg *m, const Pd__Register *g) {
  if (!r->auth) return true; /* --insecure */
  char have[PD_CURVE_Z85_LEN + 1] = "none";
  if (m->has_peer_key && !zmq_z85_encode(have, m->peer_key, PD_CURVE_KEY_BYTES))
    snprintf(have, sizeof have, "?");
  const uint8_t *bound = pd_map_ptr(pd_map_cstr_find(&r->node_keys, g->node_id));
  const char *why = NULL;
  if (!m->has_peer_key) why = "its connection has no CURVE key";
  else if (bound && memcmp(bound, m->peer_key, PD_CURVE_KEY_BYTES) != 0)
    why = "the id is registered with another key";
  if (why) {
    if (pd_log_limit_ok(&r->deny_log, "refusals"))
      pd_log(PD_LOG_WARN, "refused node %s (CURVE key %s): %s", g->node_id, have, why);
    register_reply(r, m, false, why);
    return false;
  }
  if (!bound) {
    uint8_t *k = malloc(PD_CURVE_KEY_BYTES);
    if (!k || !pd_map_cstr_put(&r->node_keys, g->node_id, (uintptr_t)k)) {
      free(k);
      pd_log(PD_LOG_ERROR, "refused node %s: out of memory", g->node_id);
      register_reply(r, m, false, "out of memory");
      return false;
    }
    memcpy(k, m->peer_key, PD_CURVE_KEY_BYTES);
  }
  return true;
}

static void on_register(router *r, const pd_net_msg *m, const Pd__Register *g) {
  char why[512];
  if (strcmp(g->model, r->model_name)) {
    snprintf(why, sizeof why, "this router serves model '%s', not '%s'", r->model_name,
             g->model);
    pd_log(PD_LOG_WARN, "refused node %s: %s", g->node_id, why);
    register_reply(r, m, false, why);
    return;
  }
  if (g->model_fingerprint != r->fingerprint) {
    snprintf(why, sizeof why, "model files differ from the router's (config.json or "
             "tokenizer.json)");
    pd_log(PD_LOG_WARN, "refused node %s: %s", g->node_id, why);
    register_reply(r, m, false, why);
    return;
  }
  if ((int)g->vocab_size < r->vocab_size) {
    snprintf(why, sizeof why, "vocabulary of %u tokens, the tokenizer has %d", g->vocab_size,
             r->vocab_size);
    register_reply(r, m, false, why);
    return;
  }
  if (!register_key_ok(r, m, g)) return;
  rnode *n = registry_find(r, g->node_id);
  if (n && n->incarnation != g->incarnation) {
    node_dead(r, n, "restarted");
    n = NULL;
  } else if (n && (n->rid_len != m->routing_id_len ||
                   memcmp(n->rid, m->routing_id, m->routing_id_len) != 0)) {
    node_dead(r, n, "registered again from another connection");
    n = NULL;
  }
  bool fresh = !n;
  if (!n) {
    n = calloc(1, sizeof *n);
    if (!n) return;
    if (r->n_nodes == r->cap_nodes) {
      int cap = r->cap_nodes ? 2 * r->cap_nodes : 8;
      rnode **v = realloc(r->nodes, (size_t)cap * sizeof *v);
      if (!v) {
        free(n);
        return;
      }
      r->nodes = v;
      r->cap_nodes = cap;
    }
    if (g->role == PD__ROLE__ROLE_PREFILL || g->unified) { /* the nodes that prefill */
      n->affinity = calloc(AFFINITY_SLOTS, sizeof *n->affinity);
      if (!n->affinity) {
        free(n);
        return;
      }
    }
    r->nodes[r->n_nodes++] = n;
    n->registered_ms = pd_now_ms();
  }
  snprintf(n->id, sizeof n->id, "%s", g->node_id);
  memcpy(n->rid, m->routing_id, m->routing_id_len);
  n->rid_len = m->routing_id_len;
  n->has_key = r->auth && m->has_peer_key;
  if (n->has_key) memcpy(n->key, m->peer_key, PD_CURVE_KEY_BYTES);
  n->role = g->role;
  n->unified = g->unified;
  n->incarnation = g->incarnation;
  n->fingerprint = g->model_fingerprint;
  snprintf(n->kv_endpoint, sizeof n->kv_endpoint, "%s", g->kv_endpoint ? g->kv_endpoint : "");
  n->kv_curve = g->kv_curve_public_key.len == PD_CURVE_KEY_BYTES;
  if (n->kv_curve) memcpy(n->kv_key, g->kv_curve_public_key.data, PD_CURVE_KEY_BYTES);
  const Pd__KvGeometry *k = g->kv;
  n->num_layers = k->num_layers;
  n->num_kv_heads = k->num_kv_heads;
  n->head_dim = k->head_dim;
  n->block_size = k->block_size;
  n->total_blocks = k->total_blocks;
  n->kv_head_begin = k->kv_head_begin;
  n->kv_head_end = k->kv_head_end;
  n->dtype = k->dtype;
  n->vocab_size = g->vocab_size;
  n->max_model_len = g->max_model_len;
  n->max_batch_tokens = g->max_batch_tokens;
  n->lim = r->lim;
  n->lim.total_blocks = (int32_t)k->total_blocks;
  n->lim.block_size = (int32_t)k->block_size;
  n->has_draft = g->draft_kv != NULL;
  n->draft_fingerprint = n->has_draft ? g->draft_fingerprint : 0;
  n->draft_num_layers = n->has_draft ? g->draft_kv->num_layers : 0;
  n->draft_num_kv_heads = n->has_draft ? g->draft_kv->num_kv_heads : 0;
  n->draft_head_dim = n->has_draft ? g->draft_kv->head_dim : 0;
  n->draft_total_blocks = n->has_draft ? g->draft_kv->total_blocks : 0;
  n->lim.draft_total_blocks = (int32_t)n->draft_total_blocks;
  n->lim.draft_num_layers = (int32_t)n->draft_num_layers;
  n->lim.draft_num_kv_heads = (int32_t)n->draft_num_kv_heads;
  n->lim.draft_head_dim = (int32_t)n->draft_head_dim;
  load_update(n, g->load);
  n->last_seen_ms = pd_now_ms();
  pd_err e = {0};
  pd_liveness_seen(r->live, n->id, pd_liveness_now_ms(), &e);
  register_reply(r, m, true, NULL);
  if (fresh) {
    char key[PD_CURVE_Z85_LEN + 1] = "";
    if (n->has_key && !zmq_z85_encode(key, n->key, PD_CURVE_KEY_BYTES)) key[0] = 0;
    pd_log(PD_LOG_INFO, "node %s registered: %s, %u KV blocks of %u tokens%s%s%s%s", n->id,
           n->role == PD__ROLE__ROLE_DECODE ? "decode" : "prefill", n->total_blocks,
           n->block_size, n->kv_endpoint[0] ? ", KV at " : "", n->kv_endpoint,
           key[0] ? ", CURVE key " : " (not authenticated)", key);
  }
  route_dispatch(r);
}

/* Nodes heartbeat from a socket of their own whose routing id is "<main routing id>/hb" (so a
 * long forward pass on the node's main thread never silences them); the main socket is accepted
 * too. With node authentication the heartbeat comes with the node's key as well. */
static bool heartbeat_from(const pd_net_msg *m, const rnode *n) {
  size_t l = n->rid_len;
  bool rid_ok = m->routing_id_len == l ? !memcmp(m->routing_id, n->rid, l)
                                       : m->routing_id_len == l + 3 &&
                                             !memcmp(m->routing_id, n->rid, l) &&
                                             !memcmp(m->routing_id + l, "/hb", 3);
  return rid_ok && (!n->has_key || (m->has_peer_key &&
                                    !memcmp(m->peer_key, n->key, PD_CURVE_KEY_BYTES)));
}

static void on_heartbeat(router *r, const pd_net_msg *m, const Pd__Heartbeat *h) {
  rnode *n = registry_find(r, h->node_id);
  bool known = n && heartbeat_from(m, n);
  if (known) pd_liveness_seen(r->live, n->id, pd_liveness_now_ms(), NULL);
  Pd__HeartbeatAck a;
  pd__heartbeat_ack__init(&a);
  a.seq = h->seq;
  a.reregister = !known;
  if (known) {
    load_update(n, h->load);
    n->last_seen_ms = pd_now_ms();
  }
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_HEARTBEAT_ACK;
  env.heartbeat_ack = &a;
  send_raw(r, m, &env);
  if (known) route_dispatch(r); /* capacity may have come back */
}

void registry_on_message(router *r, const pd_net_msg *m) {
  const Pd__Envelope *env = m->wire.env;
  switch (env->body_case) {
    case PD__ENVELOPE__BODY_REGISTER_NODE:
      on_register(r, m, env->register_node);
      break;
    case PD__ENVELOPE__BODY_HEARTBEAT:
      on_heartbeat(r, m, env->heartbeat);
      break;
    case PD__ENVELOPE__BODY_DEREGISTER: {
      rnode *n = registry_find(r, env->deregister->node_id);
      if (n && n == registry_find_rid(r, m->routing_id, m->routing_id_len)) {
        char why[300];
        snprintf(why, sizeof why, "deregistered (%s)",
                 env->deregister->reason && *env->deregister->reason ? env->deregister->reason
                                                                      : "no reason");
        node_dead(r, n, why);
      }
      break;
    }
    default:
      break;
  }
}

typedef struct dead_list {
  char ids[64][PD_LIVENESS_ID_MAX + 1];
  int n;
} dead_list;

static void on_dead(const char *id, int64_t last_seen_ms, void *user) {
  (void)last_seen_ms;
  dead_list *d = user;
  if (d->n < 64) snprintf(d->ids[d->n++], sizeof d->ids[0], "%s", id);
}

void registry_sweep(router *r) {
  dead_list d = {.n = 0};
  pd_liveness_sweep(r->live, pd_liveness_now_ms(), on_dead, &d);
  for (int i = 0; i < d.n; i++) {
    rnode *n = registry_find(r, d.ids[i]);
    if (n) node_dead(r, n, "missed its heartbeats");
  }
  reap(r);
}

static bool usable(router *r, const rnode *n) {
  return !n->dead &&
         pd_liveness_state(r->live, n->id, pd_liveness_now_ms()) == PD_LIVE_ALIVE;
}

int registry_count(router *r, Pd__Role role, bool usable_only) {
  int c = 0;
  for (int i = 0; i < r->n_nodes; i++) {
    rnode *n = r->nodes[i];
    if (n->dead || n->role != role) continue;
    if (usable_only && !usable(r, n)) continue;
    c++;
  }
  return c;
}

rnode *registry_choose_decode(router *r, int need_blocks, const rnode *exclude) {
  rnode *best = NULL;
  for (int i = 0; i < r->n_nodes; i++) {
    rnode *n = r->nodes[i];
    if (n->role != PD__ROLE__ROLE_DECODE || n == exclude || !usable(r, n)) continue;
    if (n->est_free_blocks < need_blocks) continue;
    if (!best || n->est_free_blocks > best->est_free_blocks ||
        (n->est_free_blocks == best->est_free_blocks &&
         n->running + (uint32_t)n->n_subs < best->running + (uint32_t)best->n_subs))
      best = n;
  }
  return best;
}

static bool compatible(const rnode *p, const rnode *d) {
  return p->block_size == d->block_size && p->num_layers == d->num_layers &&
         p->head_dim == d->head_dim && p->dtype == d->dtype && d->kv_head_end <= p->kv_head_end &&
         d->kv_head_begin >= p->kv_head_begin;
}

/* Block hashes of the prompt's first full blocks (at most cap). */
static int prompt_hashes(const rnode *p, const int32_t *ids, int n, uint64_t salt, uint64_t *out,
                         int cap) {
  int bs = (int)p->block_size;
  if (bs < 1) return 0;
  uint64_t h = pd_kv_hash_root("pd-router", 9, salt);
  int k = 0;
  for (int b = 0; (b + 1) * bs <= n && k < cap; b++) {
    h = pd_kv_hash_block(h, ids + (size_t)b * (size_t)bs, bs);
    out[k++] = h ? h : 1;
  }
  return k;
}

/* Leading prompt blocks node p has likely cached (the prompts the router sent it to prefill). */
static int expected_hit_blocks(const rnode *p, const int32_t *ids, int n, uint64_t cache_salt) {
  if (!p->affinity) return 0;
  uint64_t hs[64];
  int nh = prompt_hashes(p, ids, n, cache_salt, hs, 64), hit = 0;
  while (hit < nh && p->affinity[hs[hit] % AFFINITY_SLOTS] == hs[hit]) hit++;
  return hit;
}

rnode *registry_choose_unified(router *r, int n_ctx, const int32_t *ids, int n,
                               uint64_t cache_salt, int *hit_tokens) {
  rnode *best = NULL;
  int best_hit = -1;
  for (int i = 0; i < r->n_nodes; i++) {
    rnode *u = r->nodes[i];
    if (u->role != PD__ROLE__ROLE_DECODE || !u->unified || !usable(r, u)) continue;
    const int bs = u->block_size > 0 ? (int)u->block_size : 16;
    if (u->est_free_blocks < (n_ctx + bs - 1) / bs) continue;
    const int hit = expected_hit_blocks(u, ids, n, cache_salt) * (int)u->block_size;
    /* the most cached prompt, then the most free blocks, then the fewest sequences */
    if (!best || hit > best_hit ||
        (hit == best_hit && (u->est_free_blocks > best->est_free_blocks ||
                             (u->est_free_blocks == best->est_free_blocks &&
                              u->running + (uint32_t)u->n_subs <
                                  best->running + (uint32_t)best->n_subs)))) {
      best = u;
      best_hit = hit;
    }
  }
  if (hit_tokens) *hit_tokens = best_hit < 0 ? 0 : best_hit;
  return best;
}

int registry_count_unified(router *r) {
  int c = 0;
  for (int i = 0; i < r->n_nodes; i++)
    if (r->nodes[i]->role == PD__ROLE__ROLE_DECODE && r->nodes[i]->unified &&
        usable(r, r->nodes[i]))
      c++;
  return c;
}

double registry_spec_acceptance(router *r) {
  double sum = 0;
  int c = 0;
  for (int i = 0; i < r->n_nodes; i++) {
    rnode *n = r->nodes[i];
    if (n->role != PD__ROLE__ROLE_DECODE || !usable(r, n) || !(n->spec_acceptance > 0)) continue;
    sum += n->spec_acceptance;
    c++;
  }
  return c ? sum / c : 0;
}

int64_t registry_min_prefill_queue(router *r) {
  int64_t m = -1;
  for (int i = 0; i < r->n_nodes; i++) {
    rnode *p = r->nodes[i];
    if (p->role != PD__ROLE__ROLE_PREFILL || !usable(r, p)) continue;
    if (m < 0 || p->est_queued_tokens < m) m = p->est_queued_tokens;
  }
  return m;
}

rnode *registry_choose_prefill(router *r, const rnode *dest, const int32_t *ids, int n,
                               uint64_t cache_salt) {
  rnode *best = NULL;
  int64_t best_score = 0;
  uint64_t hs[64];
  for (int i = 0; i < r->n_nodes; i++) {
    rnode *p = r->nodes[i];
    if (p->role != PD__ROLE__ROLE_PREFILL || !usable(r, p)) continue;
    if (dest && !compatible(p, dest)) continue;
    /* leading blocks this node has seen recently: likely in its prefix cache */
    int nh = prompt_hashes(p, ids, n, cache_salt, hs, 64), hit = 0;
    while (hit < nh && p->affinity[hs[hit] % AFFINITY_SLOTS] == hs[hit]) hit++;
    int64_t score = p->est_queued_tokens - (int64_t)hit * p->block_size;
    /* a node that can compute the destination's draft KV first (the other makes the decode
     * node's draft compute the context itself) */
    if (dest && dest->has_draft && !registry_same_draft(p, dest)) score += INT64_MAX / 4;
    if (!best || score < best_score) {
      best = p;
      best_score = score;
    }
  }
  return best;
}

bool registry_same_draft(const rnode *p, const rnode *d) {
  return p->has_draft && d->has_draft && p->draft_fingerprint == d->draft_fingerprint &&
         p->draft_num_layers == d->draft_num_layers &&
         p->draft_num_kv_heads == d->draft_num_kv_heads &&
         p->draft_head_dim == d->draft_head_dim && p->block_size == d->block_size &&
         p->dtype == d->dtype;
}

bool registry_draft_prefill_for(router *r, const rnode *d) {
  if (!d->has_draft) return false;
  for (int i = 0; i < r->n_nodes; i++) {
    const rnode *p = r->nodes[i];
    if (p->role == PD__ROLE__ROLE_PREFILL && usable(r, p) && registry_same_draft(p, d))
      return true;
  }
  return false;
}

void registry_note_prefill(router *r, rnode *p, const int32_t *ids, int n, uint64_t cache_salt) {
  (void)r;
  if (!p->affinity) return;
  uint64_t hs[64];
  int nh = prompt_hashes(p, ids, n, cache_salt, hs, 64);
  for (int i = 0; i < nh; i++) p->affinity[hs[i] % AFFINITY_SLOTS] = hs[i];
  p->est_queued_tokens += n;
}

int registry_max_model_len(router *r) {
  int m = r->max_model_len;
  for (int i = 0; i < r->n_nodes; i++)
    if (!r->nodes[i]->dead && r->nodes[i]->max_model_len &&
        (int)r->nodes[i]->max_model_len < m)
      m = (int)r->nodes[i]->max_model_len;
  return m;
}

cJSON *registry_json(router *r) {
  cJSON *a = cJSON_CreateArray();
  int64_t now = pd_liveness_now_ms();
  for (int i = 0; i < r->n_nodes; i++) {
    rnode *n = r->nodes[i];
    if (n->dead) continue;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "node_id", n->id);
    cJSON_AddStringToObject(o, "role", n->role == PD__ROLE__ROLE_PREFILL ? "prefill"
                                       : n->unified                     ? "unified"
                                                                        : "decode");
    pd_live_state s = pd_liveness_state(r->live, n->id, now);
    cJSON_AddStringToObject(o, "state", s == PD_LIVE_ALIVE     ? "alive"
                                        : s == PD_LIVE_SUSPECT ? "suspect"
                                                               : "dead");
    if (n->kv_endpoint[0]) cJSON_AddStringToObject(o, "kv_endpoint", n->kv_endpoint);
    cJSON_AddNumberToObject(o, "total_blocks", n->total_blocks);
    cJSON_AddNumberToObject(o, "free_blocks", n->free_blocks);
    cJSON_AddNumberToObject(o, "running", n->running);
    cJSON_AddNumberToObject(o, "waiting", n->waiting);
    cJSON_AddNumberToObject(o, "queued_prompt_tokens", (double)n->queued_tokens);
    cJSON_AddNumberToObject(o, "requests", n->n_subs);
    cJSON_AddNumberToObject(o, "last_seen_ms_ago", (double)(pd_now_ms() - n->last_seen_ms));
    cJSON_AddItemToArray(a, o);
  }
  return a;
}
