/* pd/liveness.h: state transitions at exact deadlines, out-of-order sightings, per-entry
 * deadlines, sweep reporting each dead entry once, next-event times, and a randomized comparison
 * with a naive model over many ids (hash table growth and deletion). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pd/liveness.h"
#include "pd_test.h"

typedef struct dead_log {
  char ids[4096][24];
  int n;
} dead_log;

static void on_dead(const char *id, int64_t last_seen, void *user) {
  dead_log *d = user;
  (void)last_seen;
  if (d->n < 4096) snprintf(d->ids[d->n++], sizeof d->ids[0], "%s", id);
}

static void test_basic(void) {
  pd_err e = {0};
  pd_liveness_opts o = {.suspect_ms = 100, .dead_ms = 300};
  pd_liveness *lv = pd_liveness_new(&o, &e);
  REQUIRE(lv);
  CHECK(pd_liveness_state(lv, "a", 0) == PD_LIVE_UNKNOWN);
  CHECK(pd_liveness_next_event_ms(lv, 0) == -1);
  CHECK(pd_liveness_seen(lv, "a", 1000, &e) == PD_OK);
  CHECK(pd_liveness_state(lv, "a", 1000) == PD_LIVE_ALIVE);
  CHECK(pd_liveness_state(lv, "a", 1099) == PD_LIVE_ALIVE);
  CHECK(pd_liveness_state(lv, "a", 1100) == PD_LIVE_SUSPECT);
  CHECK(pd_liveness_state(lv, "a", 1299) == PD_LIVE_SUSPECT);
  CHECK(pd_liveness_state(lv, "a", 1300) == PD_LIVE_DEAD);
  CHECK(pd_liveness_next_event_ms(lv, 1040) == 60);  /* -> suspect at 1100 */
  CHECK(pd_liveness_next_event_ms(lv, 1150) == 150); /* -> dead at 1300 */
  CHECK(pd_liveness_next_event_ms(lv, 1400) == 0);
  /* A heartbeat brings a suspect back; an older one (reordered) is ignored. */
  CHECK(pd_liveness_seen(lv, "a", 1200, &e) == PD_OK);
  CHECK(pd_liveness_seen(lv, "a", 1150, &e) == PD_OK);
  CHECK(pd_liveness_last_seen(lv, "a") == 1200);
  CHECK(pd_liveness_state(lv, "a", 1250) == PD_LIVE_ALIVE);
  /* Per-entry deadline (a reservation's ttl). */
  CHECK(pd_liveness_seen(lv, "resv-1", 1200, &e) == PD_OK);
  CHECK(pd_liveness_set_deadline(lv, "resv-1", 1000, &e) == PD_OK);
  CHECK(pd_liveness_state(lv, "resv-1", 1500) == PD_LIVE_SUSPECT); /* default suspect 100 */
  CHECK(pd_liveness_state(lv, "resv-1", 2199) == PD_LIVE_SUSPECT);
  CHECK(pd_liveness_state(lv, "resv-1", 2200) == PD_LIVE_DEAD);
  CHECK(pd_liveness_set_deadline(lv, "nope", 10, &e) == PD_ENOTFOUND);
  CHECK(pd_liveness_set_deadline(lv, "a", 0, &e) == PD_EINVAL);
  /* Sweep: "a" dies at 1500 (last 1200), resv-1 at 2200; each is reported once. */
  dead_log *d = calloc(1, sizeof *d);
  REQUIRE(d);
  CHECK(pd_liveness_sweep(lv, 1499, on_dead, d) == 0);
  CHECK(pd_liveness_sweep(lv, 1500, on_dead, d) == 1);
  CHECK(d->n == 1 && strcmp(d->ids[0], "a") == 0);
  CHECK(pd_liveness_sweep(lv, 1600, on_dead, d) == 0);
  CHECK(pd_liveness_state(lv, "a", 1600) == PD_LIVE_UNKNOWN);
  CHECK(pd_liveness_count(lv) == 1);
  CHECK(pd_liveness_sweep(lv, 5000, NULL, NULL) == 1);
  CHECK(pd_liveness_count(lv) == 0);
  /* Ids: empty or too long refused; the longest allowed works. */
  char longid[PD_LIVENESS_ID_MAX + 2];
  memset(longid, 'x', sizeof longid - 1);
  longid[sizeof longid - 1] = 0;
  CHECK(pd_liveness_seen(lv, longid, 0, &e) == PD_EINVAL);
  longid[PD_LIVENESS_ID_MAX] = 0;
  CHECK(pd_liveness_seen(lv, longid, 0, &e) == PD_OK);
  CHECK(pd_liveness_seen(lv, "", 0, &e) == PD_EINVAL);
  CHECK(pd_liveness_remove(lv, longid) && !pd_liveness_remove(lv, longid));
  pd_liveness_opts bad = {.suspect_ms = 10, .dead_ms = 5};
  CHECK(pd_liveness_new(&bad, &e) == NULL && e.code == PD_EINVAL);
  CHECK(pd_liveness_now_ms() > 0);
  free(d);
  pd_liveness_free(lv);
}

/* Many ids with random sightings, removals and sweeps against a plain array model. */
static void test_model(void) {
  enum { IDS = 2000, STEPS = 20000 };
  pd_err e = {0};
  pd_liveness_opts o = {.suspect_ms = 40, .dead_ms = 100};
  pd_liveness *lv = pd_liveness_new(&o, &e);
  REQUIRE(lv);
  static int64_t last[IDS];
  static bool live[IDS];
  dead_log *d = calloc(1, sizeof *d);
  REQUIRE(d);
  uint64_t r = 12345;
  int64_t now = 0;
  int mismatches = 0, total_dead = 0;
  for (int step = 0; step < STEPS; step++) {
    r = r * 6364136223846793005ull + 1442695040888963407ull;
    int id = (int)((r >> 33) % IDS);
    char name[24];
    snprintf(name, sizeof name, "node-%d", id);
    int op = (int)((r >> 20) % 16);
    now += (int64_t)((r >> 40) % 3);
    if (op < 12) {
      CHECK(pd_liveness_seen(lv, name, now, &e) == PD_OK);
      if (!live[id] || now > last[id]) last[id] = now;
      live[id] = true;
    } else if (op < 14) {
      CHECK(pd_liveness_remove(lv, name) == live[id]);
      live[id] = false;
    } else {
      d->n = 0;
      int got = pd_liveness_sweep(lv, now, on_dead, d);
      int want = 0;
      for (int i = 0; i < IDS; i++)
        if (live[i] && now - last[i] >= o.dead_ms) {
          want++;
          live[i] = false;
        }
      if (got != want || d->n != want) mismatches++;
      total_dead += got;
    }
    /* Spot-check a random id's state. */
    int q = (int)((r >> 12) % IDS);
    snprintf(name, sizeof name, "node-%d", q);
    pd_live_state st = pd_liveness_state(lv, name, now);
    pd_live_state want = !live[q]                           ? PD_LIVE_UNKNOWN
                         : now - last[q] >= o.dead_ms     ? PD_LIVE_DEAD
                         : now - last[q] >= o.suspect_ms  ? PD_LIVE_SUSPECT
                                                          : PD_LIVE_ALIVE;
    if (st != want) mismatches++;
  }
  int n_live = 0;
  for (int i = 0; i < IDS; i++) n_live += live[i];
  CHECK(pd_liveness_count(lv) == n_live);
  CHECKF(mismatches == 0, "%d mismatches", mismatches);
  CHECK(total_dead > 0);
  printf("model: %d entries live at the end, %d swept as dead\n", n_live, total_dead);
  free(d);
  pd_liveness_free(lv);
}

int main(void) {
  test_basic();
  test_model();
  return pd_test_finish("test_net_liveness");
}
