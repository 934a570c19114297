/* A node's /metrics, /health and /live HTTP endpoint: a pd_http_server on an event loop of its
 * own thread, so a scrape is answered even while the node's main thread is inside a forward
 * pass. /health is readiness (the router counts the node); /live is liveness (the node's main
 * loop has come round within PD_NODE_STALL_MS), which does not depend on other processes. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "http.h"
#include "node.h"

struct pd_metrics_server {
  pd_evloop *loop;
  pd_http_server *srv;
  pthread_t th;
  bool started;
  pd_metrics *m;
  atomic_bool *healthy;
  atomic_llong *progress_ms; /* the main loop's last turn (pd_now_ms) */
};

static void on_request(pd_http_req *req, const pd_http_request *msg, void *ud) {
  pd_metrics_server *s = ud;
  bool get = !strcmp(msg->method, "GET") || !strcmp(msg->method, "HEAD");
  if (!strcmp(msg->path, "/metrics")) {
    if (!get) {
      pd_http_respond_error(req, 405, "use GET", NULL, NULL, NULL);
      return;
    }
    size_t len = 0;
    char *text = pd_metrics_render(s->m, &len);
    if (!text) {
      pd_http_respond_error(req, 500, "out of memory", NULL, NULL, NULL);
      return;
    }
    pd_http_respond(req, 200, "text/plain; version=0.0.4; charset=utf-8", NULL, 0, text, len,
                    NULL);
    free(text);
    return;
  }
  if (!strcmp(msg->path, "/health") || !strcmp(msg->path, "/live")) {
    bool ok = msg->path[1] == 'h'
                  ? atomic_load(s->healthy)
                  : pd_now_ms() - atomic_load(s->progress_ms) < PD_NODE_STALL_MS;
    const char *body = ok ? "{\"status\":\"ok\"}" : "{\"status\":\"unavailable\"}";
    pd_http_respond(req, ok ? 200 : 503, "application/json", NULL, 0, body, strlen(body), NULL);
    return;
  }
  pd_http_respond_error(req, 404, "not found", NULL, NULL, NULL);
}

static void *run(void *ud) {
  pd_metrics_server *s = ud;
  pd_err e = {0};
  if (pd_evloop_run(s->loop, &e) != PD_OK) pd_log(PD_LOG_ERROR, "metrics server: %s", e.msg);
  return NULL;
}

pd_metrics_server *pd_metrics_server_start(const char *host, int port, pd_metrics *m, atomic_bool *healthy,
                           atomic_llong *progress_ms, pd_err *e) {
  pd_metrics_server *s = calloc(1, sizeof *s);
  if (!s) {
    pd_err_set(e, PD_ENOMEM, "out of memory");
    return NULL;
  }
  s->m = m;
  s->healthy = healthy;
  s->progress_ms = progress_ms;
  s->loop = pd_evloop_new(e);
  if (!s->loop) goto fail;
  pd_http_config c;
  pd_http_config_default(&c);
  c.host = host;
  c.port = port;
  c.max_connections = 64;
  c.limits.max_body_bytes = 4096;
  c.on_request = on_request;
  c.ud = s;
  s->srv = pd_http_server_new(s->loop, &c, e);
  if (!s->srv) goto fail;
  if (pthread_create(&s->th, NULL, run, s) != 0) {
    pd_err_set(e, PD_EIO, "cannot start the metrics thread");
    goto fail;
  }
  s->started = true;
  return s;
fail:
  pd_metrics_server_stop(s);
  return NULL;
}

int pd_metrics_server_port(const pd_metrics_server *s) { return s ? pd_http_server_port(s->srv) : -1; }

void pd_metrics_server_stop(pd_metrics_server *s) {
  if (!s) return;
  if (s->started) {
    pd_evloop_stop(s->loop);
    pthread_join(s->th, NULL);
  }
  if (s->srv) pd_http_server_free(s->srv);
  pd_evloop_free(s->loop);
  free(s);
}
