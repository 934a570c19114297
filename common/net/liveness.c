/* Liveness tracker (pd/liveness.h): an open-addressing hash table (linear probing, backward-shift
 * deletion, load <= 1/2) of ids with their last sighting and deadlines. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pd/liveness.h"

typedef struct entry {
  bool used;
  char id[PD_LIVENESS_ID_MAX + 1];
  int64_t last_seen;
  int64_t suspect_ms;
  int64_t dead_ms;
} entry;

struct pd_liveness {
  pd_liveness_opts o;
  entry *tab;
  size_t cap; /* power of two */
  size_t count;
};

int64_t pd_liveness_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static uint64_t hash_id(const char *s) { /* FNV-1a */
  uint64_t h = 1469598103934665603ull;
  for (; *s; s++) h = (h ^ (unsigned char)*s) * 1099511628211ull;
  return h;
}

pd_liveness *pd_liveness_new(const pd_liveness_opts *o, pd_err *e) {
  if (!o || o->suspect_ms <= 0 || o->dead_ms <= 0 || o->suspect_ms > o->dead_ms) {
    pd_err_set(e, PD_EINVAL, "liveness: need 0 < suspect_ms <= dead_ms");
    return NULL;
  }
  pd_liveness *lv = calloc(1, sizeof *lv);
  if (lv) lv->tab = calloc(16, sizeof *lv->tab);
  if (!lv || !lv->tab) {
    free(lv);
    pd_err_set(e, PD_ENOMEM, "liveness: out of memory");
    return NULL;
  }
  lv->o = *o;
  lv->cap = 16;
  return lv;
}

void pd_liveness_free(pd_liveness *lv) {
  if (!lv) return;
  free(lv->tab);
  free(lv);
}

/* Slot holding id, or the empty slot where it would go. */
static size_t find_slot(const entry *tab, size_t cap, const char *id) {
  size_t i = hash_id(id) & (cap - 1);
  while (tab[i].used && strcmp(tab[i].id, id) != 0) i = (i + 1) & (cap - 1);
  return i;
}

static entry *lookup(const pd_liveness *lv, const char *id) {
  if (!id) return NULL;
  size_t i = find_slot(lv->tab, lv->cap, id);
  return lv->tab[i].used ? &lv->tab[i] : NULL;
}

static bool grow(pd_liveness *lv) {
  size_t cap = lv->cap * 2;
  entry *tab = calloc(cap, sizeof *tab);
  if (!tab) return false;
  for (size_t i = 0; i < lv->cap; i++)
    if (lv->tab[i].used) tab[find_slot(tab, cap, lv->tab[i].id)] = lv->tab[i];
  free(lv->tab);
  lv->tab = tab;
  lv->cap = cap;
  return true;
}

/* Backward-shift deletion: later entries of the same probe run move up into the hole. */
static void delete_slot(pd_liveness *lv, size_t hole) {
  size_t mask = lv->cap - 1;
  lv->tab[hole].used = false;
  for (size_t j = (hole + 1) & mask; lv->tab[j].used; j = (j + 1) & mask) {
    size_t home = hash_id(lv->tab[j].id) & mask;
    /* j may move to hole if its home is not cyclically in (hole, j]. */
    bool stays = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
    if (stays) continue;
    lv->tab[hole] = lv->tab[j];
    lv->tab[j].used = false;
    hole = j;
  }
  lv->count--;
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
  if ((lv->count + 1) * 2 > lv->cap && !grow(lv))
    return pd_err_set(e, PD_ENOMEM, "liveness: out of memory");
  en = &lv->tab[find_slot(lv->tab, lv->cap, id)];
  en->used = true;
  memcpy(en->id, id, n + 1);
  en->last_seen = now_ms;
  en->suspect_ms = lv->o.suspect_ms;
  en->dead_ms = lv->o.dead_ms;
  lv->count++;
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
  if (!id) return false;
  size_t i = find_slot(lv->tab, lv->cap, id);
  if (!lv->tab[i].used) return false;
  delete_slot(lv, i);
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

int pd_liveness_count(const pd_liveness *lv) { return (int)lv->count; }

int pd_liveness_sweep(pd_liveness *lv, int64_t now_ms, pd_liveness_dead_fn on_dead, void *user) {
  int removed = 0;
  /* After a deletion the slot is examined again: backward shift may have moved an unvisited
   * entry into it (entries only move toward the hole, so none skips past the cursor). */
  for (size_t i = 0; i < lv->cap;) {
    entry *en = &lv->tab[i];
    if (en->used && state_of(en, now_ms) == PD_LIVE_DEAD) {
      if (on_dead) on_dead(en->id, en->last_seen, user);
      delete_slot(lv, i);
      removed++;
      continue;
    }
    i++;
  }
  return removed;
}

int64_t pd_liveness_next_event_ms(const pd_liveness *lv, int64_t now_ms) {
  int64_t best = -1;
  for (size_t i = 0; i < lv->cap; i++) {
    const entry *en = &lv->tab[i];
    if (!en->used) continue;
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
