/* Liveness tracker (pd/liveness.h): ids with their last sighting and deadlines, found through
 * a pd_map from the id (borrowed from its entry, which is allocated once and never moves) to
 * the entry. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pd/liveness.h"
#include "pd/map.h"

typedef struct entry {
  char id[PD_LIVENESS_ID_MAX + 1];
  int64_t last_seen;
  int64_t suspect_ms;
  int64_t dead_ms;
} entry;

struct pd_liveness {
  pd_liveness_opts o;
  pd_map ids; /* id -> entry */
};

int64_t pd_liveness_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

pd_liveness *pd_liveness_new(const pd_liveness_opts *o, pd_err *e) {
  if (!o || o->suspect_ms <= 0 || o->dead_ms <= 0 || o->suspect_ms > o->dead_ms) {
    pd_err_set(e, PD_EINVAL, "liveness: need 0 < suspect_ms <= dead_ms");
    return NULL;
  }
  pd_liveness *lv = calloc(1, sizeof *lv);
  if (!lv || !pd_map_init(&lv->ids, 8, 0)) {
    free(lv);
    pd_err_set(e, PD_ENOMEM, "liveness: out of memory");
    return NULL;
  }
  lv->o = *o;
  return lv;
}

void pd_liveness_free(pd_liveness *lv) {
  if (!lv) return;
  pd_map_slot *s;
  for (pd_map_it it = {0}; (s = pd_map_next(&lv->ids, &it));) free(pd_map_ptr(s));
  pd_map_free(&lv->ids);
  free(lv);
}

static entry *lookup(const pd_liveness *lv, const char *id) {
  return id ? pd_map_ptr(pd_map_cstr_find(&lv->ids, id)) : NULL;
}

pd_status pd_liveness_seen(pd_liveness *lv, const char *id, int64_t now_ms, pd_err *e) {
  size_t n = id ? strnlen(id, PD_LIVENESS_ID_MAX + 1) : 0;
  if (n == 0 || n > PD_LIVENESS_ID_MAX)
    return pd_err_set(e, PD_EINVAL, "liveness: id must be 1..%d bytes", PD_LIVENESS_ID_MAX);
  entry *en = lookup(lv, id);
  if (en) {
    if (now_ms > en->last_seen) en->last_seen = now_ms;
    return PD_OK;
  }
  en = malloc(sizeof *en);
  if (en) {
    memcpy(en->id, id, n + 1);
    en->last_seen = now_ms;
    en->suspect_ms = lv->o.suspect_ms;
    en->dead_ms = lv->o.dead_ms;
  }
  if (!en || !pd_map_str_put(&lv->ids, pd_map_hash(en->id, n), en->id, n, (uintptr_t)en)) {
    free(en);
    return pd_err_set(e, PD_ENOMEM, "liveness: out of memory");
  }
  return PD_OK;
}

pd_status pd_liveness_set_deadline(pd_liveness *lv, const char *id, int64_t dead_ms, pd_err *e) {
  if (dead_ms <= 0) return pd_err_set(e, PD_EINVAL, "liveness: dead_ms must be positive");
  entry *en = lookup(lv, id);
  if (!en) return pd_err_set(e, PD_ENOTFOUND, "liveness: '%s' is not tracked", id ? id : "");
  en->dead_ms = dead_ms;
  int64_t half = dead_ms / 2 > 0 ? dead_ms / 2 : dead_ms;
  en->suspect_ms = lv->o.suspect_ms < half ? lv->o.suspect_ms : half;
  return PD_OK;
}

bool pd_liveness_remove(pd_liveness *lv, const char *id) {
  pd_map_slot *s = id ? pd_map_cstr_find(&lv->ids, id) : NULL;
  if (!s) return false;
  entry *en = pd_map_ptr(s);
  pd_map_remove(&lv->ids, s);
  free(en);
  return true;
}

static pd_live_state state_of(const entry *en, int64_t now_ms) {
  int64_t age = now_ms - en->last_seen;
  if (age >= en->dead_ms) return PD_LIVE_DEAD;
  if (age >= en->suspect_ms) return PD_LIVE_SUSPECT;
  return PD_LIVE_ALIVE;
}

pd_live_state pd_liveness_state(const pd_liveness *lv, const char *id, int64_t now_ms) {
  const entry *en = lookup(lv, id);
  return en ? state_of(en, now_ms) : PD_LIVE_UNKNOWN;
}

int64_t pd_liveness_last_seen(const pd_liveness *lv, const char *id) {
  const entry *en = lookup(lv, id);
  return en ? en->last_seen : -1;
}

int pd_liveness_count(const pd_liveness *lv) { return (int)pd_map_count(&lv->ids); }

int pd_liveness_sweep(pd_liveness *lv, int64_t now_ms, pd_liveness_dead_fn on_dead, void *user) {
  int removed = 0;
  pd_map_slot *s;
  for (pd_map_it it = {0}; (s = pd_map_next(&lv->ids, &it));) {
    entry *en = pd_map_ptr(s);
    if (state_of(en, now_ms) != PD_LIVE_DEAD) continue;
    if (on_dead) on_dead(en->id, en->last_seen, user);
    pd_map_it_remove(&lv->ids, &it);
    free(en);
    removed++;
  }
  return removed;
}

int64_t pd_liveness_next_event_ms(const pd_liveness *lv, int64_t now_ms) {
  int64_t best = -1;
  const pd_map_slot *s;
  for (pd_map_it it = {0}; (s = pd_map_next(&lv->ids, &it));) {
    const entry *en = pd_map_ptr(s);
    int64_t age = now_ms - en->last_seen, dt;
    if (age < en->suspect_ms)
      dt = en->suspect_ms - age;
    else if (age < en->dead_ms)
      dt = en->dead_ms - age;
    else
      dt = 0;
    if (best < 0 || dt < best) best = dt;
  }
  return best;
}
