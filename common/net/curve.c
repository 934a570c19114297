/* CURVE keys (generation, Z85, zcert files, environment), socket roles, and a ZAP handler that
 * admits an allow list of client keys (pd/net.h). */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "pd/net.h"

#define ZAP_ENDPOINT "inproc://zeromq.zap.01" /* fixed by RFC 27 */
#define KEYFILE_MAX (64 * 1024)

bool pd_curve_available(void) { return zmq_has("curve") != 0; }

pd_status pd_curve_keypair_generate(pd_curve_keypair *kp, pd_err *e) {
  if (!pd_curve_available())
    return pd_err_set(e, PD_EUNSUPPORTED, "this libzmq has no CURVE support (libsodium)");
  if (zmq_curve_keypair(kp->public_z85, kp->secret_z85) != 0)
    return pd_err_set(e, PD_EIO, "zmq_curve_keypair: %s", zmq_strerror(zmq_errno()));
  return PD_OK;
}

static bool z85_char(int c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
         (c && strchr(".-:+=^!/*?&<>()[]{}@%$#", c));
}

pd_status pd_curve_key_parse(const char *z85, uint8_t key[PD_CURVE_KEY_BYTES],
                             char out[PD_CURVE_Z85_LEN + 1], pd_err *e) {
  if (!z85) return pd_err_set(e, PD_EINVAL, "CURVE key: missing");
  while (isspace((unsigned char)*z85)) z85++;
  size_t n = strnlen(z85, PD_CURVE_Z85_LEN + 64);
  while (n && isspace((unsigned char)z85[n - 1])) n--;
  if (n != PD_CURVE_Z85_LEN)
    return pd_err_set(e, PD_EFORMAT, "CURVE key: %zu characters, a Z85 key has %d", n,
                      PD_CURVE_Z85_LEN);
  char text[PD_CURVE_Z85_LEN + 1];
  for (size_t i = 0; i < n; i++) {
    if (!z85_char((unsigned char)z85[i]))
      return pd_err_set(e, PD_EFORMAT, "CURVE key: '%c' is not a Z85 character", z85[i]);
    text[i] = z85[i];
  }
  text[n] = 0;
  uint8_t bin[PD_CURVE_KEY_BYTES];
  if (!zmq_z85_decode(bin, text)) return pd_err_set(e, PD_EFORMAT, "CURVE key: bad Z85 text");
  if (key) memcpy(key, bin, sizeof bin);
  if (out) memcpy(out, text, sizeof text);
  return PD_OK;
}

pd_status pd_curve_keypair_from_secret(const char *secret_z85, pd_curve_keypair *kp, pd_err *e) {
  char sec[PD_CURVE_Z85_LEN + 1];
  pd_status st = pd_curve_key_parse(secret_z85, NULL, sec, e);
  if (st) return st;
  if (!pd_curve_available())
    return pd_err_set(e, PD_EUNSUPPORTED, "this libzmq has no CURVE support (libsodium)");
  char pub[PD_CURVE_Z85_LEN + 1];
  if (zmq_curve_public(pub, sec) != 0)
    return pd_err_set(e, PD_EIO, "zmq_curve_public: %s", zmq_strerror(zmq_errno()));
  memcpy(kp->public_z85, pub, sizeof pub);
  memcpy(kp->secret_z85, sec, sizeof sec);
  return PD_OK;
}

/* Finds `name = value` on a line (name at the start, after indentation); writes the value
 * without quotes and surrounding blanks into out. */
static bool key_line(const char *line, const char *name, char *out, size_t cap) {
  while (*line == ' ' || *line == '\t') line++;
  size_t n = strlen(name);
  if (strncmp(line, name, n) != 0) return false;
  line += n;
  while (*line == ' ' || *line == '\t') line++;
  if (*line != '=') return false;
  line++;
  while (*line == ' ' || *line == '\t') line++;
  bool quoted = *line == '"';
  if (quoted) line++;
  size_t len = 0;
  while (line[len] && line[len] != '\n' && line[len] != '\r' && !(quoted && line[len] == '"'))
    len++;
  while (!quoted && len && (line[len - 1] == ' ' || line[len - 1] == '\t')) len--;
  if (len >= cap) return false;
  memcpy(out, line, len);
  out[len] = 0;
  return true;
}

pd_status pd_curve_keypair_load(const char *path, pd_curve_keypair *kp, pd_err *e) {
  FILE *f = fopen(path, "r");
  if (!f)
    return pd_err_set(e, errno == ENOENT ? PD_ENOTFOUND : PD_EIO, "CURVE key file %s: %s", path,
                      strerror(errno));
  char pub[128] = "", sec[128] = "", line[512];
  size_t total = 0;
  pd_status st = PD_OK;
  while (fgets(line, sizeof line, f)) {
    total += strlen(line);
    if (total > KEYFILE_MAX) {
      st = pd_err_set(e, PD_EFORMAT, "CURVE key file %s: larger than %d bytes", path, KEYFILE_MAX);
      break;
    }
    const char *p = line;
    while (*p == ' ' || *p == '\t') p++;
    if (*p == '#') continue; /* a comment only at the start: '#' is also a Z85 character */
    char v[128];
    if (key_line(p, "public-key", v, sizeof v)) strcpy(pub, v);
    else if (key_line(p, "secret-key", v, sizeof v)) strcpy(sec, v);
  }
  if (!st && ferror(f)) st = pd_err_set(e, PD_EIO, "CURVE key file %s: read error", path);
  fclose(f);
  if (st) return st;
  pd_curve_keypair k;
  memset(&k, 0, sizeof k);
  if (sec[0]) {
    if ((st = pd_curve_keypair_from_secret(sec, &k, e))) {
      pd_err_prefix(e, "CURVE key file %s: secret-key", path);
      return st;
    }
    if (pub[0]) {
      char given[PD_CURVE_Z85_LEN + 1];
      if ((st = pd_curve_key_parse(pub, NULL, given, e))) {
        pd_err_prefix(e, "CURVE key file %s: public-key", path);
        return st;
      }
      if (strcmp(given, k.public_z85) != 0)
        return pd_err_set(e, PD_EFORMAT, "CURVE key file %s: public-key does not belong to "
                          "secret-key", path);
    }
  } else if (pub[0]) {
    if ((st = pd_curve_key_parse(pub, NULL, k.public_z85, e))) {
      pd_err_prefix(e, "CURVE key file %s: public-key", path);
      return st;
    }
  } else {
    return pd_err_set(e, PD_EFORMAT, "CURVE key file %s: no public-key or secret-key line", path);
  }
  *kp = k;
  return PD_OK;
}

pd_status pd_curve_keypair_save(const char *path, const pd_curve_keypair *kp, bool secret,
                                pd_err *e) {
  if (secret && !kp->secret_z85[0])
    return pd_err_set(e, PD_EINVAL, "CURVE key file %s: no secret key to save", path);
  int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, secret ? 0600 : 0644);
  if (fd < 0) return pd_err_set(e, PD_EIO, "CURVE key file %s: %s", path, strerror(errno));
  if (secret && fchmod(fd, 0600) != 0) { /* an existing file keeps its mode otherwise */
    int err = errno;
    close(fd);
    return pd_err_set(e, PD_EIO, "CURVE key file %s: chmod: %s", path, strerror(err));
  }
  FILE *f = fdopen(fd, "w");
  if (!f) {
    close(fd);
    return pd_err_set(e, PD_EIO, "CURVE key file %s: %s", path, strerror(errno));
  }
  fprintf(f, "#   ****  Generated by pdserve  ****\n");
  fprintf(f, "#   ZeroMQ CURVE %s certificate (zcert format)%s\n", secret ? "secret" : "public",
          secret ? "; keep this file private" : "");
  fprintf(f, "metadata\ncurve\n    public-key = \"%s\"\n", kp->public_z85);
  if (secret) fprintf(f, "    secret-key = \"%s\"\n", kp->secret_z85);
  bool bad = ferror(f) != 0;
  if (fclose(f) != 0) bad = true;
  if (bad) return pd_err_set(e, PD_EIO, "CURVE key file %s: write error", path);
  return PD_OK;
}

pd_status pd_curve_keypair_from_env(const char *name, bool secret, pd_curve_keypair *kp,
                                    pd_err *e) {
  const char *v = name ? getenv(name) : NULL;
  if (!v || !*v) return pd_err_set(e, PD_ENOTFOUND, "environment variable %s is not set", name);
  pd_status st;
  if (secret) {
    st = pd_curve_keypair_from_secret(v, kp, e);
  } else {
    memset(kp, 0, sizeof *kp);
    st = pd_curve_key_parse(v, NULL, kp->public_z85, e);
  }
  if (st) pd_err_prefix(e, "%s", name);
  return st;
}

pd_status pd_curve_key_arg(const char *arg, bool secret, pd_curve_keypair *kp, pd_err *e) {
  memset(kp, 0, sizeof *kp);
  if (!arg || !*arg) return pd_err_set(e, PD_EINVAL, "CURVE key: empty");
  struct stat sb;
  if (stat(arg, &sb) == 0) {
    pd_curve_keypair k;
    pd_status st = pd_curve_keypair_load(arg, &k, e);
    if (st) return st;
    if (secret && !k.secret_z85[0])
      return pd_err_set(e, PD_EFORMAT, "CURVE key file %s holds no secret key", arg);
    if (!secret) memset(k.secret_z85, 0, sizeof k.secret_z85);
    *kp = k;
    memset(&k, 0, sizeof k);
    return PD_OK;
  }
  if (secret) return pd_curve_keypair_from_secret(arg, kp, e);
  return pd_curve_key_parse(arg, NULL, kp->public_z85, e);
}

/* ---- socket roles ---- */

pd_status pd_curve_server_setup(void *sock, const pd_curve_keypair *server, pd_err *e) {
  if (!server || !server->secret_z85[0])
    return pd_err_set(e, PD_EINVAL, "CURVE server: no secret key");
  if (!pd_curve_available())
    return pd_err_set(e, PD_EUNSUPPORTED, "this libzmq has no CURVE support (libsodium)");
  uint8_t sec[PD_CURVE_KEY_BYTES];
  pd_status st = pd_curve_key_parse(server->secret_z85, sec, NULL, e);
  if (st) return st;
  int one = 1;
  if (zmq_setsockopt(sock, ZMQ_CURVE_SERVER, &one, sizeof one) != 0 ||
      zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, sec, sizeof sec) != 0)
    st = pd_err_set(e, PD_EIO, "CURVE server setup: %s", zmq_strerror(zmq_errno()));
  memset(sec, 0, sizeof sec);
  return st;
}

pd_status pd_curve_client_setup(void *sock, const pd_curve_keypair *client,
                                const char *server_public_z85, pd_err *e) {
  if (!client || !client->secret_z85[0])
    return pd_err_set(e, PD_EINVAL, "CURVE client: no keypair");
  if (!pd_curve_available())
    return pd_err_set(e, PD_EUNSUPPORTED, "this libzmq has no CURVE support (libsodium)");
  uint8_t srv[PD_CURVE_KEY_BYTES], pub[PD_CURVE_KEY_BYTES], sec[PD_CURVE_KEY_BYTES];
  pd_status st;
  if ((st = pd_curve_key_parse(server_public_z85, srv, NULL, e))) {
    pd_err_prefix(e, "CURVE client: server key");
    return st;
  }
  if ((st = pd_curve_key_parse(client->public_z85, pub, NULL, e)) ||
      (st = pd_curve_key_parse(client->secret_z85, sec, NULL, e))) {
    pd_err_prefix(e, "CURVE client: own key");
    return st;
  }
  if (zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, srv, sizeof srv) != 0 ||
      zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, pub, sizeof pub) != 0 ||
      zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, sec, sizeof sec) != 0)
    st = pd_err_set(e, PD_EIO, "CURVE client setup: %s", zmq_strerror(zmq_errno()));
  memset(sec, 0, sizeof sec);
  return st;
}

/* ---- ZAP handler ---- */

#define MAX_OPEN_DOMAINS 8
#define DENIAL_RING 64

struct pd_curve_auth {
  void *rep; /* REP bound to ZAP_ENDPOINT, used by the thread only once started */
  pthread_t thread;
  atomic_bool stop;
  atomic_uint_fast64_t denied;
  pthread_mutex_t mu; /* guards keys, open, the denial ring */
  uint8_t (*keys)[PD_CURVE_KEY_BYTES];
  size_t n_keys, cap_keys;
  char open[MAX_OPEN_DOMAINS][32];
  int n_open;
  pd_curve_denial ring[DENIAL_RING]; /* the latest refusals, oldest at ring_head */
  int ring_head, ring_n;
  uint64_t ring_dropped;
};

static bool key_allowed(pd_curve_auth *a, const uint8_t *key) {
  bool ok = false;
  for (size_t i = 0; i < a->n_keys && !ok; i++)
    ok = memcmp(a->keys[i], key, PD_CURVE_KEY_BYTES) == 0;
  return ok;
}

static bool domain_open(pd_curve_auth *a, zmq_msg_t *d) {
  size_t n = zmq_msg_size(d);
  for (int i = 0; i < a->n_open; i++)
    if (strlen(a->open[i]) == n && memcmp(a->open[i], zmq_msg_data(d), n) == 0) return true;
  return false;
}

/* A frame's bytes as printable text (others become '?'). */
static void frame_text(zmq_msg_t *f, char *out, size_t cap) {
  size_t n = zmq_msg_size(f), k = 0;
  const unsigned char *p = zmq_msg_data(f);
  for (; k < n && k + 1 < cap; k++) out[k] = p[k] >= 0x20 && p[k] < 0x7f ? (char)p[k] : '?';
  out[k] = 0;
}

/* Records a refusal (with a->mu held). */
static void note_denial(pd_curve_auth *a, zmq_msg_t *f, int n, const char *key_z85,
                        const char *reason) {
  atomic_fetch_add(&a->denied, 1);
  if (a->ring_n == DENIAL_RING) { /* the oldest goes */
    a->ring_head = (a->ring_head + 1) % DENIAL_RING;
    a->ring_n--;
    a->ring_dropped++;
  }
  pd_curve_denial *d = &a->ring[(a->ring_head + a->ring_n++) % DENIAL_RING];
  memset(d, 0, sizeof *d);
  if (n > 2) frame_text(&f[2], d->domain, sizeof d->domain);
  if (n > 3) frame_text(&f[3], d->address, sizeof d->address);
  snprintf(d->key_z85, sizeof d->key_z85, "%s", key_z85);
  d->reason = reason;
}

/* One ZAP exchange (RFC 27): request frames version, request_id, domain, address, routing id
 * (the server's own), mechanism, credentials...; reply version, request_id, status code, status
 * text, user id (the client's key in Z85), metadata. Every request gets a reply (REP's state
 * machine requires it). */
static void zap_serve_one(pd_curve_auth *a) {
  enum { MAXF = 8 };
  zmq_msg_t f[MAXF];
  int n = 0;
  for (;;) {
    zmq_msg_t part;
    zmq_msg_init(&part);
    if (zmq_msg_recv(&part, a->rep, 0) < 0) {
      zmq_msg_close(&part);
      for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
      return;
    }
    bool more = zmq_msg_more(&part);
    if (n < MAXF) {
      zmq_msg_init(&f[n]);
      zmq_msg_move(&f[n], &part);
      n++;
    }
    zmq_msg_close(&part);
    if (!more) break;
  }
  bool curve = n >= 7 && zmq_msg_size(&f[5]) == 5 && memcmp(zmq_msg_data(&f[5]), "CURVE", 5) == 0 &&
               zmq_msg_size(&f[6]) == PD_CURVE_KEY_BYTES;
  char user[PD_CURVE_Z85_LEN + 1] = "";
  if (curve && !zmq_z85_encode(user, zmq_msg_data(&f[6]), PD_CURVE_KEY_BYTES)) user[0] = 0;
  const char *why = NULL;
  pthread_mutex_lock(&a->mu);
  if (n < 7 || zmq_msg_size(&f[0]) != 3 || memcmp(zmq_msg_data(&f[0]), "1.0", 3) != 0)
    why = "malformed ZAP request";
  else if (!curve)
    why = "not a CURVE handshake";
  else if (!domain_open(a, &f[2]) && !key_allowed(a, zmq_msg_data(&f[6])))
    why = "key not allowed";
  if (why) note_denial(a, f, n, user, why);
  pthread_mutex_unlock(&a->mu);
  const char *code = why ? "400" : "200";
  const char *text = why ? why : "OK";
  if (why) user[0] = 0;
  zmq_send(a->rep, "1.0", 3, ZMQ_SNDMORE);
  if (n >= 2)
    zmq_send(a->rep, zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), ZMQ_SNDMORE);
  else
    zmq_send(a->rep, "", 0, ZMQ_SNDMORE);
  zmq_send(a->rep, code, 3, ZMQ_SNDMORE);
  zmq_send(a->rep, text, strlen(text), ZMQ_SNDMORE);
  zmq_send(a->rep, user, strlen(user), ZMQ_SNDMORE); /* User-Id of the connection */
  zmq_send(a->rep, "", 0, 0);                        /* metadata */
  for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
}

static void *zap_thread(void *arg) {
  pd_curve_auth *a = arg;
  while (!atomic_load(&a->stop)) {
    zmq_pollitem_t it = {.socket = a->rep, .events = ZMQ_POLLIN};
    int rc = zmq_poll(&it, 1, 50); /* the stop flag is checked every 50 ms */
    if (rc < 0) {
      if (zmq_errno() == EINTR) continue;
      break; /* context terminated */
    }
    if (rc > 0 && (it.revents & ZMQ_POLLIN)) zap_serve_one(a);
  }
  return NULL;
}

pd_curve_auth *pd_curve_auth_start(void *ctx, pd_err *e) {
  if (!pd_curve_available()) {
    pd_err_set(e, PD_EUNSUPPORTED, "this libzmq has no CURVE support (libsodium)");
    return NULL;
  }
  pd_curve_auth *a = calloc(1, sizeof *a);
  if (!a) {
    pd_err_set(e, PD_ENOMEM, "CURVE auth: out of memory");
    return NULL;
  }
  pthread_mutex_init(&a->mu, NULL);
  atomic_init(&a->stop, false);
  atomic_init(&a->denied, 0);
  a->rep = zmq_socket(ctx, ZMQ_REP);
  int zero = 0;
  if (!a->rep || zmq_setsockopt(a->rep, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
      zmq_bind(a->rep, ZAP_ENDPOINT) != 0) {
    pd_err_set(e, PD_EIO, "CURVE auth: binding %s: %s (one handler per context)", ZAP_ENDPOINT,
               zmq_strerror(zmq_errno()));
    if (a->rep) zmq_close(a->rep);
    pthread_mutex_destroy(&a->mu);
    free(a);
    return NULL;
  }
  int rc = pthread_create(&a->thread, NULL, zap_thread, a);
  if (rc != 0) {
    pd_err_set(e, PD_EIO, "CURVE auth: pthread_create: %s", strerror(rc));
    zmq_close(a->rep);
    pthread_mutex_destroy(&a->mu);
    free(a);
    return NULL;
  }
  return a;
}

pd_status pd_curve_auth_allow(pd_curve_auth *a, const char *client_public_z85, pd_err *e) {
  uint8_t key[PD_CURVE_KEY_BYTES];
  pd_status st = pd_curve_key_parse(client_public_z85, key, NULL, e);
  if (st) return st;
  pthread_mutex_lock(&a->mu);
  if (a->n_keys == a->cap_keys) {
    size_t cap = a->cap_keys ? a->cap_keys * 2 : 8;
    void *k = realloc(a->keys, cap * sizeof *a->keys);
    if (!k) {
      pthread_mutex_unlock(&a->mu);
      return pd_err_set(e, PD_ENOMEM, "CURVE auth: out of memory");
    }
    a->keys = k;
    a->cap_keys = cap;
  }
  memcpy(a->keys[a->n_keys++], key, sizeof key);
  pthread_mutex_unlock(&a->mu);
  return PD_OK;
}

pd_status pd_curve_auth_open_domain(pd_curve_auth *a, const char *domain, pd_err *e) {
  size_t n = domain ? strlen(domain) : 0;
  if (n < 1 || n >= sizeof a->open[0])
    return pd_err_set(e, PD_EINVAL, "CURVE auth: a ZAP domain is 1..%zu bytes",
                      sizeof a->open[0] - 1);
  pthread_mutex_lock(&a->mu);
  pd_status st = PD_OK;
  if (a->n_open == MAX_OPEN_DOMAINS)
    st = pd_err_set(e, PD_ERANGE, "CURVE auth: more than %d open domains", MAX_OPEN_DOMAINS);
  else
    memcpy(a->open[a->n_open++], domain, n + 1);
  pthread_mutex_unlock(&a->mu);
  return st;
}

uint64_t pd_curve_auth_denied(pd_curve_auth *a) { return atomic_load(&a->denied); }

int pd_curve_auth_take_denials(pd_curve_auth *a, pd_curve_denial *out, int max,
                               uint64_t *dropped) {
  pthread_mutex_lock(&a->mu);
  int k = 0;
  for (; k < max && a->ring_n > 0; k++) {
    out[k] = a->ring[a->ring_head];
    a->ring_head = (a->ring_head + 1) % DENIAL_RING;
    a->ring_n--;
  }
  if (dropped) *dropped = a->ring_dropped;
  a->ring_dropped = 0;
  pthread_mutex_unlock(&a->mu);
  return k;
}

void pd_curve_auth_stop(pd_curve_auth *a) {
  if (!a) return;
  atomic_store(&a->stop, true);
  pthread_join(a->thread, NULL);
  zmq_close(a->rep);
  pthread_mutex_destroy(&a->mu);
  free(a->keys);
  free(a);
}
