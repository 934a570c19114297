/* pdclient (pd/client.h) against a scripted stand-in for the router's client port: a ROUTER
 * socket on 127.0.0.1 served by a thread that answers each GenerateRequest according to its
 * prompt. Checks streaming and assembly of chunks, n > 1, cancellation (by callback and on
 * idle timeout), Error envelopes, bounded connect failures, and CURVE (right and wrong key). */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "pd/client.h"
#include "pd_test.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct fake {
  void *ctx, *sock;
  char endpoint[128];
  pd_curve_keypair keys; /* server keys when curve */
  bool curve;
  pthread_t th;
  atomic_int stop;
  atomic_int cancels;    /* CancelRequests received */
  atomic_int requests;   /* GenerateRequests received */
  char last_id[PD_WIRE_ID_MAX_BYTES + 1];
  char last_key[64];     /* the api_key of the last GenerateRequest */
} fake;

static void send_chunk(fake *f, const pd_net_msg *m, const char *id, uint32_t index,
                       const char *text, int32_t tok, Pd__FinishReason fr, bool usage) {
  Pd__GenerateChunk ch = PD__GENERATE_CHUNK__INIT;
  ch.request_id = (char *)id;
  ch.index = index;
  ch.text = (char *)text;
  int32_t toks[1] = {tok};
  if (tok >= 0) {
    ch.n_token_ids = 1;
    ch.token_ids = toks;
  }
  ch.finish_reason = fr;
  Pd__Usage u = PD__USAGE__INIT;
  if (usage) {
    u.prompt_tokens = 3;
    u.completion_tokens = 2;
    ch.usage = &u;
  }
  Pd__Envelope env;
  pd_wire_envelope_init(&env);
  env.body_case = PD__ENVELOPE__BODY_CHUNK;
  env.chunk = &ch;
  pd_err e = {0};
  pd_status st = pd_net_send(f->sock, m->routing_id, m->routing_id_len, &env, NULL, 0, &e);
  if (st) fprintf(stderr, "fake: send: %s\n", e.msg);
}

/* Prompts: "hello" -> "Hel" "lo" (LENGTH, usage); "two" with n = 2 -> one chunk per choice;
 * "cancel" -> "a", then waits for the CancelRequest and ends with ABORT; "bad" -> an Error
 * envelope; "silent" -> nothing. */
static void *serve(void *arg) {
  fake *f = arg;
  pd_wire_limits lim;
  pd_wire_limits_init(&lim);
  pd_net_msg m;
  pd_net_msg_init(&m);
  char pending_cancel[PD_WIRE_ID_MAX_BYTES + 1] = "";
  uint8_t pending_rid[PD_NET_ROUTING_ID_MAX];
  size_t pending_rid_len = 0;
  while (!atomic_load(&f->stop)) {
    bool got = false;
    pd_err e = {0};
    pd_status st = pd_net_recv(f->sock, 50, &lim, &m, &got, &e);
    if (!got || st != PD_OK) continue;
    const Pd__Envelope *env = m.wire.env;
    if (env->body_case == PD__ENVELOPE__BODY_CANCEL) {
      atomic_fetch_add(&f->cancels, 1);
      if (pending_cancel[0] && !strcmp(env->cancel->request_id, pending_cancel)) {
        pd_net_msg tmp = m;
        memcpy(tmp.routing_id, pending_rid, pending_rid_len);
        tmp.routing_id_len = pending_rid_len;
        send_chunk(f, &tmp, pending_cancel, 0, "", -1, PD__FINISH_REASON__FINISH_REASON_ABORT,
                   false);
        pending_cancel[0] = 0;
      }
      continue;
    }
    if (env->body_case != PD__ENVELOPE__BODY_GENERATE) continue;
    atomic_fetch_add(&f->requests, 1);
    const Pd__GenerateRequest *r = env->generate;
    snprintf(f->last_id, sizeof f->last_id, "%s", r->request_id);
    snprintf(f->last_key, sizeof f->last_key, "%s", r->api_key ? r->api_key : "");
    const char *p = r->prompt ? r->prompt : "";
    if (!strcmp(p, "hello")) {
      send_chunk(f, &m, r->request_id, 0, "Hel", 7, PD__FINISH_REASON__FINISH_REASON_NONE, false);
      send_chunk(f, &m, r->request_id, 0, "lo", 8, PD__FINISH_REASON__FINISH_REASON_LENGTH, true);
    } else if (!strcmp(p, "two")) {
      send_chunk(f, &m, r->request_id, 1, "B", 2, PD__FINISH_REASON__FINISH_REASON_STOP, false);
      send_chunk(f, &m, r->request_id, 0, "A", 1, PD__FINISH_REASON__FINISH_REASON_LENGTH, true);
    } else if (!strcmp(p, "cancel")) {
      send_chunk(f, &m, r->request_id, 0, "a", 1, PD__FINISH_REASON__FINISH_REASON_NONE, false);
      snprintf(pending_cancel, sizeof pending_cancel, "%s", r->request_id);
      memcpy(pending_rid, m.routing_id, m.routing_id_len);
      pending_rid_len = m.routing_id_len;
    } else if (!strcmp(p, "bad")) {
      pd_net_send_error(f->sock, m.routing_id, m.routing_id_len,
                        PD__ERROR_CODE__ERROR_CODE_INVALID_REQUEST, r->request_id, false,
                        "max_tokens must be positive", NULL);
    } else if (!strcmp(p, "refuse")) { /* a refusal as pd-router sends it: one error chunk */
      Pd__GenerateChunk ch = PD__GENERATE_CHUNK__INIT;
      Pd__Error er = PD__ERROR__INIT;
      er.code = PD__ERROR_CODE__ERROR_CODE_CONTEXT_TOO_LONG;
      er.message = (char *)"prompt too long";
      er.request_id = r->request_id;
      ch.request_id = r->request_id;
      ch.finish_reason = PD__FINISH_REASON__FINISH_REASON_ERROR;
      ch.error = &er;
      Pd__Envelope out;
      pd_wire_envelope_init(&out);
      out.body_case = PD__ENVELOPE__BODY_CHUNK;
      out.chunk = &ch;
      pd_net_send(f->sock, m.routing_id, m.routing_id_len, &out, NULL, 0, NULL);
    } /* "silent": nothing */
  }
  pd_net_msg_clear(&m);
  return NULL;
}

static void fake_start(fake *f, bool curve) {
  memset(f, 0, sizeof *f);
  pd_err e = {0};
  f->ctx = pd_net_ctx_new(1, &e);
  REQUIRE(f->ctx);
  pd_net_sock_opts o;
  pd_net_sock_opts_init(&o, ZMQ_ROUTER);
  f->curve = curve;
  if (curve) {
    REQUIRE(pd_curve_keypair_generate(&f->keys, &e) == PD_OK);
    o.curve_keys = &f->keys;
    o.curve_server = true;
  }
  f->sock = pd_net_socket(f->ctx, &o, &e);
  REQUIRE(f->sock);
  REQUIRE(pd_net_bind(f->sock, "tcp://127.0.0.1:*", f->endpoint, sizeof f->endpoint, &e) ==
          PD_OK);
  REQUIRE(pthread_create(&f->th, NULL, serve, f) == 0);
}

static void fake_stop(fake *f) {
  atomic_store(&f->stop, 1);
  pthread_join(f->th, NULL);
  pd_net_close(f->sock);
  pd_net_ctx_free(f->ctx);
}

typedef struct seen {
  char text[2][64];
  int chunks;
  int stop_after; /* return false after this many chunks (0: never) */
} seen;

static bool on_chunk(const Pd__GenerateChunk *c, void *ud) {
  seen *s = ud;
  if (c->index < 2 && c->text)
    strncat(s->text[c->index], c->text, sizeof s->text[0] - strlen(s->text[c->index]) - 1);
  s->chunks++;
  return !(s->stop_after && s->chunks >= s->stop_after);
}

static void request(Pd__GenerateRequest *r, Pd__SamplingParams *sp, const char *prompt, int n) {
  pd__generate_request__init(r);
  pd__sampling_params__init(sp);
  sp->max_tokens = 4;
  sp->n = (uint32_t)n;
  r->prompt = (char *)prompt;
  r->sampling = sp;
  r->stream = true;
  r->include_usage = true;
}

static void test_plain(void) {
  fake f;
  fake_start(&f, false);
  pd_client_opts o;
  pd_client_opts_init(&o);
  o.idle_timeout_ms = 400;
  pd_err e = {0};
  pd_client *c = pd_client_connect(f.endpoint, &o, &e);
  CHECKF(c != NULL, "%s", e.msg);
  if (!c) {
    fake_stop(&f);
    return;
  }
  Pd__GenerateRequest r;
  Pd__SamplingParams sp;
  pd_client_result res;

  /* a streamed answer is assembled in order; usage and the finish reason come through */
  seen s = {0};
  request(&r, &sp, "hello", 1);
  char *id_before = r.request_id;
  CHECKF(pd_client_generate(c, &r, on_chunk, &s, &res, &e) == PD_OK, "%s", e.msg);
  CHECK(r.request_id == id_before); /* the generated id was not left in the caller's struct */
  CHECK(!strcmp(s.text[0], "Hello"));
  CHECK(res.n_chunks == 2 && res.completion_tokens == 2);
  CHECK(res.have_usage && res.prompt_tokens == 3 && res.usage_completion_tokens == 2);
  CHECK(res.finish_reason == PD__FINISH_REASON__FINISH_REASON_LENGTH);
  CHECK(res.error_code == PD__ERROR_CODE__ERROR_CODE_UNSPECIFIED);
  CHECK(!strcmp(res.request_id, f.last_id) && res.request_id[0]);
  CHECK(f.last_key[0] == 0); /* no API key: none sent */
  char first_id[PD_WIRE_ID_MAX_BYTES + 1];
  snprintf(first_id, sizeof first_id, "%s", res.request_id);

  /* a second request gets a different generated id */
  memset(&s, 0, sizeof s);
  CHECK(pd_client_generate(c, &r, on_chunk, &s, &res, &e) == PD_OK);
  CHECK(strcmp(first_id, res.request_id) != 0);

  /* n = 2: the call waits for both choices, whatever their order */
  memset(&s, 0, sizeof s);
  request(&r, &sp, "two", 2);
  CHECKF(pd_client_generate(c, &r, on_chunk, &s, &res, &e) == PD_OK, "%s", e.msg);
  CHECK(res.n_choices == 2 && !strcmp(s.text[0], "A") && !strcmp(s.text[1], "B"));

  /* the callback cancels: the router's ABORT chunk ends the request */
  memset(&s, 0, sizeof s);
  s.stop_after = 1;
  request(&r, &sp, "cancel", 1);
  int cancels0 = atomic_load(&f.cancels);
  CHECKF(pd_client_generate(c, &r, on_chunk, &s, &res, &e) == PD_OK, "%s", e.msg);
  CHECK(res.finish_reason == PD__FINISH_REASON__FINISH_REASON_ABORT);
  CHECK(atomic_load(&f.cancels) == cancels0 + 1);

  /* an Error envelope ends the request with its code, not a transport error */
  memset(&s, 0, sizeof s);
  request(&r, &sp, "bad", 1);
  CHECKF(pd_client_generate(c, &r, on_chunk, &s, &res, &e) == PD_OK, "%s", e.msg);
  CHECK(res.error_code == PD__ERROR_CODE__ERROR_CODE_INVALID_REQUEST);
  CHECK(strstr(res.error, "max_tokens") != NULL);

  /* a refusal of an n = 2 request ends it at once (not after the idle timeout) */
  request(&r, &sp, "refuse", 2);
  CHECKF(pd_client_generate(c, &r, NULL, NULL, &res, &e) == PD_OK, "%s", e.msg);
  CHECK(res.error_code == PD__ERROR_CODE__ERROR_CODE_CONTEXT_TOO_LONG);
  CHECK(res.finish_reason == PD__FINISH_REASON__FINISH_REASON_ERROR);

  /* silence: PD_EIO after idle_timeout_ms, and the request is cancelled on the router */
  request(&r, &sp, "silent", 1);
  cancels0 = atomic_load(&f.cancels);
  double t0 = now_s();
  CHECK(pd_client_generate(c, &r, NULL, NULL, &res, &e) == PD_EIO);
  double dt = now_s() - t0;
  CHECKF(dt >= 0.35 && dt < 3.0, "idle timeout took %.2f s", dt);
  for (int i = 0; i < 40 && atomic_load(&f.cancels) == cancels0; i++) {
    struct timespec ts = {0, 25000000};
    nanosleep(&ts, NULL);
  }
  CHECK(atomic_load(&f.cancels) == cancels0 + 1);

  /* an invalid request is refused before it is sent */
  request(&r, &sp, "hello", 1);
  r.request_id = (char *)"bad id with spaces";
  int reqs0 = atomic_load(&f.requests);
  CHECK(pd_client_send(c, &r, NULL, &e) != PD_OK);
  CHECK(atomic_load(&f.requests) == reqs0);

  /* a request left running is cancelled by close */
  request(&r, &sp, "silent", 1);
  cancels0 = atomic_load(&f.cancels);
  CHECK(pd_client_send(c, &r, NULL, &e) == PD_OK);
  pd_client_close(c);
  for (int i = 0; i < 40 && atomic_load(&f.cancels) == cancels0; i++) {
    struct timespec ts = {0, 25000000};
    nanosleep(&ts, NULL);
  }
  CHECK(atomic_load(&f.cancels) == cancels0 + 1);

  /* an API key goes with every request that has none of its own; the caller's struct keeps
   * what it had */
  o.api_key = "sk-test-key";
  c = pd_client_connect(f.endpoint, &o, &e);
  CHECKF(c != NULL, "%s", e.msg);
  if (c) {
    memset(&s, 0, sizeof s);
    request(&r, &sp, "hello", 1);
    CHECK(pd_client_generate(c, &r, on_chunk, &s, &res, &e) == PD_OK);
    CHECK(!strcmp(f.last_key, "sk-test-key"));
    CHECK(r.api_key && r.api_key[0] == 0); /* as the init left it */
    memset(&s, 0, sizeof s);
    r.api_key = (char *)"sk-own";
    CHECK(pd_client_generate(c, &r, on_chunk, &s, &res, &e) == PD_OK);
    CHECK(!strcmp(f.last_key, "sk-own"));
    pd_client_close(c);
  }
  fake_stop(&f);
}

static void test_connect_failures(void) {
  /* nobody listens: a bounded failure, not a hang */
  fake f;
  fake_start(&f, false);
  char ep[128];
  snprintf(ep, sizeof ep, "%s", f.endpoint);
  fake_stop(&f); /* the port is free again */
  pd_client_opts o;
  pd_client_opts_init(&o);
  o.connect_timeout_ms = 300;
  pd_err e = {0};
  double t0 = now_s();
  pd_client *c = pd_client_connect(ep, &o, &e);
  double dt = now_s() - t0;
  CHECK(c == NULL && e.code == PD_EIO);
  CHECKF(dt >= 0.25 && dt < 2.5, "connect failure took %.2f s", dt);
  CHECK(strstr(e.msg, ep) != NULL);
  pd_client_close(c);

  CHECK(pd_client_connect("not-an-endpoint", &o, &e) == NULL);
  CHECK(pd_client_connect("", &o, &e) == NULL && e.code == PD_EINVAL);
}

static void test_curve(void) {
  if (!pd_curve_available()) {
    fprintf(stderr, "test_client: no CURVE in this libzmq, CURVE part skipped\n");
    return;
  }
  fake f;
  fake_start(&f, true);
  pd_client_opts o;
  pd_client_opts_init(&o);
  o.connect_timeout_ms = 2000;
  o.idle_timeout_ms = 2000;
  pd_err e = {0};

  /* the right server key: encrypted and working */
  o.server_public_key = f.keys.public_z85;
  pd_client *c = pd_client_connect(f.endpoint, &o, &e);
  CHECKF(c != NULL, "%s", e.msg);
  if (c) {
    Pd__GenerateRequest r;
    Pd__SamplingParams sp;
    request(&r, &sp, "hello", 1);
    seen s = {0};
    pd_client_result res;
    CHECKF(pd_client_generate(c, &r, on_chunk, &s, &res, &e) == PD_OK, "%s", e.msg);
    CHECK(!strcmp(s.text[0], "Hello"));
    pd_client_close(c);
  }

  /* a wrong server key: the handshake never completes; connect fails in time */
  pd_curve_keypair other;
  REQUIRE(pd_curve_keypair_generate(&other, &e) == PD_OK);
  o.server_public_key = other.public_z85;
  o.connect_timeout_ms = 500;
  double t0 = now_s();
  c = pd_client_connect(f.endpoint, &o, &e);
  CHECK(c == NULL && e.code == PD_EIO);
  CHECKF(now_s() - t0 < 3.0, "took %.2f s", now_s() - t0);
  pd_client_close(c);

  /* no key against a CURVE server: refused as well */
  o.server_public_key = NULL;
  c = pd_client_connect(f.endpoint, &o, &e);
  CHECK(c == NULL);
  pd_client_close(c);

  /* a malformed key is an argument error */
  o.server_public_key = "short";
  CHECK(pd_client_connect(f.endpoint, &o, &e) == NULL && e.code != PD_OK);
  fake_stop(&f);
}

int main(void) {
  test_plain();
  test_connect_failures();
  test_curve();
  CHECK(!strcmp(pd_client_finish_reason_str(PD__FINISH_REASON__FINISH_REASON_STOP), "stop"));
  CHECK(!strcmp(pd_client_error_code_str(PD__ERROR_CODE__ERROR_CODE_OVERLOADED), "overloaded"));
  return pd_test_finish("test_client");
}
