/* Event loop: epoll + binary min-heap of timers + eventfd-woken post queue. See evloop.h. */
#include "evloop.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#define EV_BATCH 256                 /* epoll events fetched per wait */
#define EV_WAKE_TAG UINT64_MAX       /* epoll data of the eventfd */

typedef struct watcher {
  pd_ev_fd_fn fn;
  void *ud;
  unsigned interest;
  uint32_t gen; /* bumped on every del, so stale batched events for this fd are dropped */
  bool active;
} watcher;

typedef struct tslot {
  uint64_t deadline; /* monotonic ms */
  uint64_t seq;      /* insertion order: tie-break and same-pass guard */
  pd_ev_timer_fn fn;
  void *ud;
  uint32_t gen;      /* bumped when the slot is released, so old ids stop matching */
  int32_t heap_idx;  /* position in heap[], -1 when the slot is free */
} tslot;

typedef struct post_node {
  pd_ev_post_fn fn;
  void *ud;
  struct post_node *next;
} post_node;

struct pd_evloop {
  int epfd, wakefd;
  watcher *w; /* indexed by fd */
  size_t w_cap;

  tslot *slots;
  size_t slots_n, slots_cap;
  uint32_t *free_slots; /* stack of free slot indices */
  size_t free_n;
  uint32_t *heap; /* slot indices, min-heap on (deadline, seq) */
  size_t heap_n;
  uint64_t next_seq;

  pthread_mutex_t post_mu;
  post_node *post_head, *post_tail;
  atomic_bool post_nonempty;

  atomic_bool stop_req;
  atomic_bool running;
  pthread_t owner;
};

uint64_t pd_evloop_now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void wake(pd_evloop *l) {
  uint64_t one = 1;
  /* EAGAIN means the counter is already nonzero: the loop is woken anyway. */
  ssize_t r = write(l->wakefd, &one, sizeof one);
  (void)r;
}

pd_evloop *pd_evloop_new(pd_err *e) {
  pd_evloop *l = calloc(1, sizeof *l);
  if (!l) {
    pd_err_set(e, PD_ENOMEM, "evloop: out of memory");
    return NULL;
  }
  l->epfd = epoll_create1(EPOLL_CLOEXEC);
  if (l->epfd < 0) {
    pd_err_set(e, PD_EIO, "evloop: epoll_create1: %s", strerror(errno));
    free(l);
    return NULL;
  }
  l->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (l->wakefd < 0) {
    pd_err_set(e, PD_EIO, "evloop: eventfd: %s", strerror(errno));
    close(l->epfd);
    free(l);
    return NULL;
  }
  struct epoll_event ev = {.events = EPOLLIN, .data.u64 = EV_WAKE_TAG};
  if (epoll_ctl(l->epfd, EPOLL_CTL_ADD, l->wakefd, &ev) < 0) {
    pd_err_set(e, PD_EIO, "evloop: epoll_ctl(eventfd): %s", strerror(errno));
    close(l->wakefd);
    close(l->epfd);
    free(l);
    return NULL;
  }
  if (pthread_mutex_init(&l->post_mu, NULL) != 0) {
    pd_err_set(e, PD_EIO, "evloop: pthread_mutex_init failed");
    close(l->wakefd);
    close(l->epfd);
    free(l);
    return NULL;
  }
  atomic_init(&l->post_nonempty, false);
  atomic_init(&l->stop_req, false);
  atomic_init(&l->running, false);
  return l;
}

/* Runs every queued post callback once (those queued meanwhile wait for the next call). */
static void run_posts(pd_evloop *l) {
  if (!atomic_load_explicit(&l->post_nonempty, memory_order_acquire)) return;
  pthread_mutex_lock(&l->post_mu);
  post_node *n = l->post_head;
  l->post_head = l->post_tail = NULL;
  atomic_store_explicit(&l->post_nonempty, false, memory_order_release);
  pthread_mutex_unlock(&l->post_mu);
  while (n) {
    post_node *next = n->next;
    n->fn(l, n->ud);
    free(n);
    n = next;
  }
}

void pd_evloop_free(pd_evloop *l) {
  if (!l) return;
  /* Posted callbacks may own resources (request references); let them release them. A
   * callback that posts again is drained as well, but only for a bounded number of rounds. */
  for (int round = 0; round < 16 && atomic_load(&l->post_nonempty); round++) run_posts(l);
  pthread_mutex_lock(&l->post_mu);
  post_node *n = l->post_head;
  l->post_head = l->post_tail = NULL;
  pthread_mutex_unlock(&l->post_mu);
  while (n) {
    post_node *next = n->next;
    free(n);
    n = next;
  }
  pthread_mutex_destroy(&l->post_mu);
  close(l->wakefd);
  close(l->epfd);
  free(l->w);
  free(l->slots);
  free(l->free_slots);
  free(l->heap);
  free(l);
}

void pd_evloop_stop(pd_evloop *l) {
  atomic_store(&l->stop_req, true);
  wake(l);
}

bool pd_evloop_in_loop_thread(const pd_evloop *l) {
  return atomic_load(&l->running) && pthread_equal(l->owner, pthread_self());
}

pd_status pd_evloop_post(pd_evloop *l, pd_ev_post_fn fn, void *ud, pd_err *e) {
  post_node *n = malloc(sizeof *n);
  if (!n) return pd_err_set(e, PD_ENOMEM, "evloop: out of memory posting a callback");
  n->fn = fn;
  n->ud = ud;
  n->next = NULL;
  pthread_mutex_lock(&l->post_mu);
  bool was_empty = l->post_head == NULL;
  if (l->post_tail)
    l->post_tail->next = n;
  else
    l->post_head = n;
  l->post_tail = n;
  atomic_store_explicit(&l->post_nonempty, true, memory_order_release);
  pthread_mutex_unlock(&l->post_mu);
  /* The loop checks the queue before every wait, so the first post after a drain is the only
   * one that must wake it. */
  if (was_empty) wake(l);
  return PD_OK;
}

/* ---- fd watchers ------------------------------------------------------------------------ */

static uint32_t to_epoll(unsigned interest) {
  uint32_t ev = 0;
  if (interest & PD_EV_READ) ev |= EPOLLIN;
  if (interest & PD_EV_WRITE) ev |= EPOLLOUT;
  if (interest & PD_EV_RDHUP) ev |= EPOLLRDHUP;
  if (interest & PD_EV_EDGE) ev |= EPOLLET;
  return ev;
}

static unsigned from_epoll(uint32_t ev) {
  unsigned m = 0;
  if (ev & EPOLLIN) m |= PD_EV_READ;
  if (ev & EPOLLOUT) m |= PD_EV_WRITE;
  if (ev & EPOLLRDHUP) m |= PD_EV_RDHUP;
  if (ev & EPOLLHUP) m |= PD_EV_HUP;
  if (ev & EPOLLERR) m |= PD_EV_ERR;
  return m;
}

pd_status pd_evloop_add_fd(pd_evloop *l, int fd, unsigned interest, pd_ev_fd_fn fn, void *ud,
                           pd_err *e) {
  if (fd < 0 || !fn) return pd_err_set(e, PD_EINVAL, "evloop: bad fd %d or callback", fd);
  if ((size_t)fd >= l->w_cap) {
    size_t cap = l->w_cap ? l->w_cap : 64;
    while (cap <= (size_t)fd) cap *= 2;
    watcher *w = realloc(l->w, cap * sizeof *w);
    if (!w) return pd_err_set(e, PD_ENOMEM, "evloop: out of memory for fd %d", fd);
    memset(w + l->w_cap, 0, (cap - l->w_cap) * sizeof *w);
    l->w = w;
    l->w_cap = cap;
  }
  watcher *w = &l->w[fd];
  if (w->active) return pd_err_set(e, PD_EINVAL, "evloop: fd %d is already watched", fd);
  struct epoll_event ev = {.events = to_epoll(interest),
                           .data.u64 = ((uint64_t)w->gen << 32) | (uint32_t)fd};
  if (epoll_ctl(l->epfd, EPOLL_CTL_ADD, fd, &ev) < 0)
    return pd_err_set(e, PD_EIO, "evloop: epoll_ctl(ADD, %d): %s", fd, strerror(errno));
  w->fn = fn;
  w->ud = ud;
  w->interest = interest;
  w->active = true;
  return PD_OK;
}

pd_status pd_evloop_mod_fd(pd_evloop *l, int fd, unsigned interest, pd_err *e) {
  if (fd < 0 || (size_t)fd >= l->w_cap || !l->w[fd].active)
    return pd_err_set(e, PD_EINVAL, "evloop: fd %d is not watched", fd);
  watcher *w = &l->w[fd];
  if (w->interest == interest) return PD_OK;
  struct epoll_event ev = {.events = to_epoll(interest),
                           .data.u64 = ((uint64_t)w->gen << 32) | (uint32_t)fd};
  if (epoll_ctl(l->epfd, EPOLL_CTL_MOD, fd, &ev) < 0)
    return pd_err_set(e, PD_EIO, "evloop: epoll_ctl(MOD, %d): %s", fd, strerror(errno));
  w->interest = interest;
  return PD_OK;
}

void pd_evloop_del_fd(pd_evloop *l, int fd) {
  if (fd < 0 || (size_t)fd >= l->w_cap || !l->w[fd].active) return;
  /* Failure here means the fd was already closed (the kernel dropped it from the set): the
   * watcher must go regardless. */
  epoll_ctl(l->epfd, EPOLL_CTL_DEL, fd, NULL);
  watcher *w = &l->w[fd];
  w->active = false;
  w->fn = NULL;
  w->ud = NULL;
  w->gen++;
}

/* ---- timers ------------------------------------------------------------------------------ */

static bool t_less(const pd_evloop *l, uint32_t a, uint32_t b) {
  const tslot *x = &l->slots[a], *y = &l->slots[b];
  return x->deadline < y->deadline || (x->deadline == y->deadline && x->seq < y->seq);
}

static void h_set(pd_evloop *l, size_t i, uint32_t s) {
  l->heap[i] = s;
  l->slots[s].heap_idx = (int32_t)i;
}

static void h_up(pd_evloop *l, size_t i) {
  uint32_t s = l->heap[i];
  while (i > 0) {
    size_t p = (i - 1) / 2;
    if (!t_less(l, s, l->heap[p])) break;
    h_set(l, i, l->heap[p]);
    i = p;
  }
  h_set(l, i, s);
}

static void h_down(pd_evloop *l, size_t i) {
  uint32_t s = l->heap[i];
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= l->heap_n) break;
    if (c + 1 < l->heap_n && t_less(l, l->heap[c + 1], l->heap[c])) c++;
    if (!t_less(l, l->heap[c], s)) break;
    h_set(l, i, l->heap[c]);
    i = c;
  }
  h_set(l, i, s);
}

/* Removes heap entry i and releases its slot. */
static void h_remove(pd_evloop *l, size_t i) {
  uint32_t s = l->heap[i];
  l->heap_n--;
  if (i < l->heap_n) {
    h_set(l, i, l->heap[l->heap_n]);
    h_down(l, i); /* the moved entry may belong lower ... */
    h_up(l, i);   /* ... or higher (a no-op when h_down moved it) */
  }
  tslot *t = &l->slots[s];
  t->heap_idx = -1;
  t->gen++;
  t->fn = NULL;
  t->ud = NULL;
  l->free_slots[l->free_n++] = s;
}

pd_status pd_evloop_timer_add(pd_evloop *l, uint64_t delay_ms, pd_ev_timer_fn fn, void *ud,
                              uint64_t *id, pd_err *e) {
  if (!fn) return pd_err_set(e, PD_EINVAL, "evloop: timer without a callback");
  if (l->free_n == 0) {
    if (l->slots_n >= UINT32_MAX - 1)
      return pd_err_set(e, PD_ENOMEM, "evloop: too many timers");
    if (l->slots_n == l->slots_cap) {
      size_t cap = l->slots_cap ? l->slots_cap * 2 : 64;
      tslot *s = realloc(l->slots, cap * sizeof *s);
      if (!s) return pd_err_set(e, PD_ENOMEM, "evloop: out of memory for timers");
      l->slots = s;
      uint32_t *h = realloc(l->heap, cap * sizeof *h);
      if (!h) return pd_err_set(e, PD_ENOMEM, "evloop: out of memory for timers");
      l->heap = h;
      uint32_t *f = realloc(l->free_slots, cap * sizeof *f);
      if (!f) return pd_err_set(e, PD_ENOMEM, "evloop: out of memory for timers");
      l->free_slots = f;
      l->slots_cap = cap;
    }
    l->slots[l->slots_n] = (tslot){.heap_idx = -1, .gen = 1};
    l->free_slots[l->free_n++] = (uint32_t)l->slots_n++;
  }
  uint32_t s = l->free_slots[--l->free_n];
  tslot *t = &l->slots[s];
  uint64_t now = pd_evloop_now_ms();
  t->deadline = delay_ms > UINT64_MAX - now ? UINT64_MAX : now + delay_ms;
  t->seq = l->next_seq++;
  t->fn = fn;
  t->ud = ud;
  l->heap[l->heap_n++] = s;
  h_up(l, l->heap_n - 1);
  if (id) *id = ((uint64_t)t->gen << 32) | (uint64_t)(s + 1);
  return PD_OK;
}

bool pd_evloop_timer_cancel(pd_evloop *l, uint64_t id) {
  uint32_t lo = (uint32_t)id, gen = (uint32_t)(id >> 32);
  if (lo == 0 || lo > l->slots_n) return false;
  tslot *t = &l->slots[lo - 1];
  if (t->gen != gen || t->heap_idx < 0) return false;
  h_remove(l, (size_t)t->heap_idx);
  return true;
}

size_t pd_evloop_timer_count(const pd_evloop *l) { return l->heap_n; }

/* Runs the timers due now that existed when the pass started. */
static void run_timers(pd_evloop *l) {
  uint64_t now = pd_evloop_now_ms();
  uint64_t seq_limit = l->next_seq;
  while (l->heap_n > 0) {
    uint32_t s = l->heap[0];
    tslot *t = &l->slots[s];
    /* Ordering is by (deadline, seq): a timer added during this pass has deadline >= now and
     * a larger seq than every older due timer, so once it is on top no older one is due. */
    if (t->deadline > now || t->seq >= seq_limit) break;
    pd_ev_timer_fn fn = t->fn;
    void *ud = t->ud;
    uint64_t id = ((uint64_t)t->gen << 32) | (uint64_t)(s + 1);
    h_remove(l, 0);
    fn(l, id, ud);
  }
}

static int wait_timeout(pd_evloop *l) {
  if (atomic_load_explicit(&l->post_nonempty, memory_order_acquire)) return 0;
  if (l->heap_n == 0) return -1;
  uint64_t now = pd_evloop_now_ms(), d = l->slots[l->heap[0]].deadline;
  if (d <= now) return 0;
  uint64_t ms = d - now;
  return ms > INT_MAX ? INT_MAX : (int)ms;
}

pd_status pd_evloop_run(pd_evloop *l, pd_err *e) {
  struct epoll_event evs[EV_BATCH];
  pd_status st = PD_OK;
  l->owner = pthread_self();
  atomic_store(&l->running, true);
  while (!atomic_load(&l->stop_req)) {
    int n = epoll_wait(l->epfd, evs, EV_BATCH, wait_timeout(l));
    if (n < 0) {
      if (errno == EINTR) continue;
      st = pd_err_set(e, PD_EIO, "evloop: epoll_wait: %s", strerror(errno));
      break;
    }
    for (int i = 0; i < n; i++) {
      uint64_t tag = evs[i].data.u64;
      if (tag == EV_WAKE_TAG) {
        uint64_t v;
        ssize_t r = read(l->wakefd, &v, sizeof v); /* resets the counter */
        (void)r;
        continue;
      }
      int fd = (int)(uint32_t)tag;
      uint32_t gen = (uint32_t)(tag >> 32);
      if ((size_t)fd >= l->w_cap) continue;
      watcher *w = &l->w[fd];
      if (!w->active || w->gen != gen) continue; /* removed (or replaced) earlier in the batch */
      w->fn(l, fd, from_epoll(evs[i].events), w->ud);
    }
    run_timers(l);
    run_posts(l);
  }
  atomic_store(&l->stop_req, false);
  atomic_store(&l->running, false);
  return st;
}
