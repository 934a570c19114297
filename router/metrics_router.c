/* The router's Prometheus series (GET /metrics). Latency histograms are in seconds; counters
 * end in _total; gauges that describe the cluster are sampled when scraped. */
#include <stdio.h>

#include "router.h"

static void collect(pd_metrics *m, void *ud) {
  (void)m;
  router *r = ud;
  pd_metric_set(r->m.queue_len, route_queue_length(r));
  pd_metric_set(r->m.running, route_active_subs(r) - route_queue_length(r));
  pd_metric_set(r->m.live, r->n_live);
  pd_metric_set(r->m.preparing, api_prep_in_flight(r));
  pd_metric_set(r->m.nodes_prefill, registry_count(r, PD__ROLE__ROLE_PREFILL, true));
  pd_metric_set(r->m.nodes_decode, registry_count(r, PD__ROLE__ROLE_DECODE, true));
  pd_metric_set(r->m.spec_acceptance, registry_spec_acceptance(r));
  if (r->http) {
    pd_http_stats st;
    pd_http_server_stats(r->http, &st);
    pd_metric_set(r->m.http_conns, (double)st.connections_open);
    /* counters kept by the server: bring ours up to them */
    pd_metric_add(r->m.http_evicted, (double)st.evicted - pd_metric_value(r->m.http_evicted));
    pd_metric_add(r->m.http_refused, (double)st.refused - pd_metric_value(r->m.http_refused));
  }
}

void rmetrics_init(router *r) {
  pd_err e = {0};
  pd_metrics *m = pd_metrics_new(&e);
  PD_ASSERT(m);
  r->m.reg = m;
  r->m.ttft = pd_metrics_histogram(m, "pd_router_time_to_first_token_seconds",
                                   "From receiving a request to its first output token.", NULL,
                                   pd_metrics_latency_buckets, pd_metrics_latency_buckets_n);
  r->m.itl = pd_metrics_histogram(m, "pd_router_inter_token_latency_seconds",
                                  "Gap between consecutive output tokens of a choice.", NULL,
                                  pd_metrics_itl_buckets, pd_metrics_itl_buckets_n);
  r->m.e2e = pd_metrics_histogram(m, "pd_router_e2e_request_latency_seconds",
                                  "From receiving a request to its last output.", NULL,
                                  pd_metrics_latency_buckets, pd_metrics_latency_buckets_n);
  r->m.queue_len = pd_metrics_gauge(m, "pd_router_queue_length",
                                    "Choices waiting for node capacity.", NULL);
  r->m.running = pd_metrics_gauge(m, "pd_router_requests_running",
                                  "Choices dispatched to nodes and not finished.", NULL);
  r->m.live = pd_metrics_gauge(m, "pd_router_requests_live",
                               "Requests the router holds (admitted, answering, or ended and "
                               "not yet freed).",
                               NULL);
  r->m.preparing = pd_metrics_gauge(m, "pd_router_requests_tokenizing",
                                    "Requests whose prompts are being tokenized (or their chat "
                                    "template rendered) in the worker pool, queued or running.",
                                    NULL);
  r->m.gen_tokens = pd_metrics_counter(m, "pd_router_generation_tokens_total",
                                       "Output tokens received from nodes.", NULL);
  r->m.prompt_tokens = pd_metrics_counter(m, "pd_router_prompt_tokens_total",
                                          "Prompt tokens of admitted requests.", NULL);
  r->m.cached_tokens = pd_metrics_counter(m, "pd_router_cached_prompt_tokens_total",
                                          "Prompt tokens the prefill nodes served from their "
                                          "prefix caches.",
                                          NULL);
  r->m.migrations = pd_metrics_counter(m, "pd_router_migrations_total",
                                       "Choices moved to another decode node mid-generation.",
                                       NULL);
  r->m.retries = pd_metrics_counter(m, "pd_router_retries_total",
                                    "Choices retried before their first token.", NULL);
  r->m.prefill_local = pd_metrics_counter(m, "pd_router_prefills_total",
                                          "Prompts sent to be prefilled, by where.",
                                          "path=\"local\"");
  r->m.prefill_remote = pd_metrics_counter(m, "pd_router_prefills_total",
                                           "Prompts sent to be prefilled, by where.",
                                           "path=\"remote\"");
  r->m.nodes_prefill = pd_metrics_gauge(m, "pd_router_nodes", "Usable nodes by role.",
                                        "role=\"prefill\"");
  r->m.nodes_decode = pd_metrics_gauge(m, "pd_router_nodes", "Usable nodes by role.",
                                       "role=\"decode\"");
  r->m.spec_acceptance = pd_metrics_gauge(
      m, "pd_router_spec_acceptance_length",
      "Tokens per speculative verification (accepted proposals + 1), mean over the decode nodes "
      "that speculate, since their start; 0 when none does.", NULL);
  r->m.http_conns = pd_metrics_gauge(m, "pd_router_http_connections", "Open HTTP connections.",
                                     NULL);
  r->m.http_evicted = pd_metrics_counter(m, "pd_router_http_connections_evicted_total",
                                         "Idle HTTP connections (or ones still sending their "
                                         "head) closed to admit a new one: the table or the "
                                         "client address was full.",
                                         NULL);
  r->m.http_refused = pd_metrics_counter(m, "pd_router_http_connections_refused_total",
                                         "New HTTP connections refused (503): their address was "
                                         "at --max-connections-per-ip with none idle.",
                                         NULL);
  /* the usual series exist from the start, so rates work before the first event */
  static const char *apis[] = {"completions", "chat", "generate", "zmq"};
  for (int i = 0; i < 4; i++) {
    char l[96];
    snprintf(l, sizeof l, "api=\"%s\",code=\"200\"", apis[i]);
    pd_metrics_counter(m, "pd_router_requests_total", "Requests answered, by API and HTTP status.",
                       l);
  }
  static const char *kinds[] = {"invalid_request", "overloaded", "timeout", "node_failed",
                                "aborted", "internal"};
  for (int i = 0; i < 6; i++) {
    char l[64];
    snprintf(l, sizeof l, "kind=\"%s\"", kinds[i]);
    pd_metrics_counter(m, "pd_router_errors_total", "Errors by kind.", l);
  }
  pd_metrics_on_collect(m, collect, r);
}

void rmetrics_request(router *r, const char *api, int status) {
  char l[96];
  snprintf(l, sizeof l, "api=\"%s\",code=\"%d\"", api, status);
  pd_metric_add(pd_metrics_counter(r->m.reg, "pd_router_requests_total",
                                   "Requests answered, by API and HTTP status.", l),
                1);
}

void rmetrics_error(router *r, const char *kind) {
  char l[64];
  snprintf(l, sizeof l, "kind=\"%s\"", kind);
  pd_metric_add(pd_metrics_counter(r->m.reg, "pd_router_errors_total", "Errors by kind.", l), 1);
}
