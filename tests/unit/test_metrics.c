/* The metrics registry renders valid Prometheus text: HELP/TYPE once per family, labelled
 * series, cumulative histogram buckets with +Inf, _sum and _count; handles are stable; bad
 * names, labels and bucket lists are refused; concurrent updates are not lost. */
#include <pthread.h>
#include <string.h>

#include "pd/metrics.h"
#include "pd_test.h"

static int count(const char *hay, const char *needle) {
  int n = 0;
  for (const char *p = strstr(hay, needle); p; p = strstr(p + 1, needle)) n++;
  return n;
}

static void *hammer(void *ud) {
  pd_metric *c = ud;
  for (int i = 0; i < 100000; i++) pd_metric_add(c, 1);
  return NULL;
}

static void collect(pd_metrics *m, void *ud) {
  (void)m;
  pd_metric_set(ud, 42);
}

int main(void) {
  pd_err e = {0};
  pd_metrics *m = pd_metrics_new(&e);
  REQUIRE(m);
  pd_metric *a = pd_metrics_counter(m, "req_total", "Requests.", "code=\"200\"");
  pd_metric *b = pd_metrics_counter(m, "req_total", "Requests.", "code=\"500\"");
  CHECK(a && b && a != b);
  CHECK(pd_metrics_counter(m, "req_total", "Requests.", "code=\"200\"") == a);
  pd_metric_add(a, 3);
  pd_metric_add(a, -1); /* counters never go down */
  pd_metric_add(b, 1);
  CHECK(pd_metric_value(a) == 3);
  pd_metric *g = pd_metrics_gauge(m, "queue", "Queue \\ length\nnow.", NULL);
  pd_metric_set(g, 5);
  pd_metric_add(g, -2);
  CHECK(pd_metric_value(g) == 3);
  static const double bounds[] = {0.005, 0.1, 1};
  pd_metric *h = pd_metrics_histogram(m, "lat_seconds", "Latency.", "api=\"x\"", bounds, 3);
  CHECK(h);
  pd_metric_observe(h, 0.001);
  pd_metric_observe(h, 0.05);
  pd_metric_observe(h, 0.05);
  pd_metric_observe(h, 7);
  CHECK(pd_metric_value(h) == 4);
  /* refusals */
  CHECK(!pd_metrics_gauge(m, "req_total", "other type", NULL));
  CHECK(!pd_metrics_counter(m, "9bad", "x", NULL));
  CHECK(!pd_metrics_counter(m, "ok_total", "x", "code=200"));
  CHECK(!pd_metrics_counter(m, "ok_total", "x", "code=\"2\"00\""));
  static const double unsorted[] = {1, 0.5};
  CHECK(!pd_metrics_histogram(m, "h2", "x", NULL, unsorted, 2));
  CHECK(!pd_metrics_histogram(m, "lat_seconds", "x", NULL, unsorted + 1, 1));
  pd_metric_add(NULL, 1); /* no-op */
  pd_metric *cg = pd_metrics_gauge(m, "collected", "Set at scrape time.", NULL);
  CHECK(pd_metrics_on_collect(m, collect, cg) == PD_OK);

  size_t len = 0;
  char *t = pd_metrics_render(m, &len);
  REQUIRE(t);
  CHECK(strlen(t) == len);
  CHECK(count(t, "# TYPE req_total counter\n") == 1);
  CHECK(count(t, "# HELP req_total Requests.\n") == 1);
  CHECK(strstr(t, "req_total{code=\"200\"} 3\n") != NULL);
  CHECK(strstr(t, "req_total{code=\"500\"} 1\n") != NULL);
  CHECK(strstr(t, "# HELP queue Queue \\\\ length\\nnow.\n") != NULL);
  CHECK(strstr(t, "queue 3\n") != NULL);
  CHECK(strstr(t, "# TYPE lat_seconds histogram\n") != NULL);
  CHECK(strstr(t, "lat_seconds_bucket{api=\"x\",le=\"0.005\"} 1\n") != NULL);
  CHECK(strstr(t, "lat_seconds_bucket{api=\"x\",le=\"0.1\"} 3\n") != NULL);
  CHECK(strstr(t, "lat_seconds_bucket{api=\"x\",le=\"1\"} 3\n") != NULL);
  CHECK(strstr(t, "lat_seconds_bucket{api=\"x\",le=\"+Inf\"} 4\n") != NULL);
  CHECK(strstr(t, "lat_seconds_sum{api=\"x\"} 7.101\n") != NULL);
  CHECK(strstr(t, "lat_seconds_count{api=\"x\"} 4\n") != NULL);
  CHECK(strstr(t, "collected 42\n") != NULL);
  /* every non-comment line is "name[{labels}] value" */
  for (char *line = strtok(t, "\n"); line; line = strtok(NULL, "\n")) {
    if (line[0] == '#') continue;
    char *sp = strrchr(line, ' ');
    CHECKF(sp && sp[1], "bad sample line '%s'", line);
  }
  free(t);

  char esc[64];
  CHECK(!strcmp(pd_metrics_escape_label("a\"b\\c\nd", esc, sizeof esc), "a\\\"b\\\\c\\nd"));

  pd_metric *c = pd_metrics_counter(m, "hammer_total", "x", NULL);
  pthread_t th[4];
  for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, hammer, c);
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  CHECK(pd_metric_value(c) == 400000);
  pd_metrics_free(m);
  return pd_test_failures ? 1 : 0;
}
