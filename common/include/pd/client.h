/* A small C client for the router's ZeroMQ client API (docs/protocol.md, "client port").
 *
 * One pd_client is one DEALER connection to a pd-router client port ("tcp://host:port"). A
 * request is a pd.GenerateRequest (proto/pd.proto); the answer is a stream of
 * pd.GenerateChunk messages carrying the request's id: text deltas per choice, the last chunk of
 * each choice with a finish reason (or an error), usage on the last chunk when asked.
 *
 *   pd_client_opts o;  pd_client_opts_init(&o);
 *   pd_client *c = pd_client_connect("tcp://127.0.0.1:5601", &o, &err);
 *   Pd__GenerateRequest req = PD__GENERATE_REQUEST__INIT;  ...
 *   pd_client_generate(c, &req, on_chunk, ud, &result, &err);   (or send / recv / cancel)
 *   pd_client_close(c);
 *
 * Timeouts: pd_client_connect waits until the ZeroMQ connection and its handshake (CURVE
 * included) are complete, at most connect_timeout_ms, so a wrong address or a wrong server
 * key fails there with a clear message instead of a silent hang. pd_client_generate fails
 * when the router sends nothing for idle_timeout_ms (and cancels the request). A router that
 * restarts is reconnected to by libzmq; requests in flight at that moment end with the idle
 * timeout.
 *
 * Security: with server_public_key set the connection uses CURVE (the router's client-port
 * key); the client's own keypair is client_keys or, when NULL, a fresh random one. A router
 * with an API key refuses requests without it (finish ERROR, error UNAUTHORIZED): api_key.
 *
 * Thread-safety: a pd_client belongs to one thread at a time (libzmq sockets are not
 * thread-safe). Several requests may be in flight on one client; chunks carry their
 * request_id. */
#ifndef PD_CLIENT_H
#define PD_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd/net.h"
#include "pd/status.h"
#include "pd/wire.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_client pd_client;

typedef struct pd_client_opts {
  int connect_timeout_ms;        /* connection + handshake. Default 5000; <= 0: 5000 */
  int idle_timeout_ms;           /* longest silence while a request runs. Default 120000;
                                    <= 0: wait forever */
  const char *server_public_key; /* router client-port CURVE key (Z85); NULL: plain ZMTP */
  const pd_curve_keypair *client_keys; /* own CURVE keypair; NULL: a random one */
  const char *api_key;           /* the router's API key, sent with every request that has none
                                    of its own (GenerateRequest.api_key); NULL: none. Copied */
  const char *name;              /* Envelope.sender for the router's logs. Default "pdclient" */
} pd_client_opts;

void pd_client_opts_init(pd_client_opts *o);

/* Connects to endpoint and waits for the handshake. NULL with a message on failure:
 * PD_EINVAL (bad endpoint or key), PD_EIO (refused, handshake failed or timed out). */
pd_client *pd_client_connect(const char *endpoint, const pd_client_opts *o, pd_err *e);
/* Closes the connection; requests still running on the router are cancelled first (best
 * effort). NULL is a no-op. */
void pd_client_close(pd_client *c);

/* Sends one request. An empty req->request_id is replaced by a fresh unique one (the pointer
 * is restored before returning); the id used is copied to id (may be NULL). The request is
 * checked with pd_wire_validate_generate first, so a malformed one fails here (PD_EINVAL,
 * PD_ERANGE) rather than on the router. PD_EFULL: the router is not reachable right now. */
pd_status pd_client_send(pd_client *c, Pd__GenerateRequest *req,
                         char id[PD_WIRE_ID_MAX_BYTES + 1], pd_err *e);
/* Asks the router to cancel a request of this client (idempotent; the router answers with a
 * final chunk whose finish reason is ABORT). */
pd_status pd_client_cancel(pd_client *c, const char *request_id, pd_err *e);

/* Waits up to timeout_ms (-1: forever, 0: poll) for the next chunk of any request. PD_OK with
 * *chunk set: a validated chunk, valid until the next pd_client_recv or pd_client_close. PD_OK
 * with *chunk NULL: nothing in time. An Error envelope from the router (a refused or malformed
 * request) is returned as a chunk whose error field is set and whose finish_reason is ERROR.
 * Other messages are skipped. */
pd_status pd_client_recv(pd_client *c, int timeout_ms, const Pd__GenerateChunk **chunk,
                         pd_err *e);

/* What pd_client_generate saw, summed over the request's chunks. */
typedef struct pd_client_result {
  char request_id[PD_WIRE_ID_MAX_BYTES + 1];
  uint32_t n_choices;          /* choices that finished */
  uint32_t n_chunks;
  uint32_t completion_tokens;  /* token ids received (all choices) */
  bool have_usage;
  uint32_t prompt_tokens, usage_completion_tokens, cached_tokens; /* when have_usage */
  Pd__FinishReason finish_reason; /* of choice 0 */
  Pd__ErrorCode error_code;       /* ERROR_CODE_UNSPECIFIED when no choice failed */
  char error[256];                /* the first error message, "" if none */
  double ttft_s, total_s;         /* first chunk with tokens or text; whole request */
} pd_client_result;

/* Called for every chunk of the request, in order. Return false to cancel the request (the
 * call then still waits for the router's final chunks, at most idle_timeout_ms). */
typedef bool (*pd_client_chunk_fn)(const Pd__GenerateChunk *chunk, void *ud);

/* Sends req and receives its chunks until every choice (req->sampling->n, default 1) has
 * finished, calling fn (may be NULL) for each. PD_OK when the stream ended properly, even if a
 * choice ended with an error (see res->error_code: the request failed, the transport did
 * not); PD_EIO when the router went silent for idle_timeout_ms (the request is cancelled). */
pd_status pd_client_generate(pd_client *c, Pd__GenerateRequest *req, pd_client_chunk_fn fn,
                             void *ud, pd_client_result *res, pd_err *e);

/* Name of a finish reason as OpenAI spells it ("stop", "length", "abort", "error", "" for
 * NONE), and of an error code ("invalid_request", "overloaded", ...). */
const char *pd_client_finish_reason_str(Pd__FinishReason r);
const char *pd_client_error_code_str(Pd__ErrorCode c);

#ifdef __cplusplus
}
#endif
#endif
