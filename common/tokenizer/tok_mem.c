/* Byte buffers and the string arena of the tokenizer (tok_internal.h). */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

/* ================================================================ tk_buf */

bool tk_buf_reserve(tk_buf *b, size_t extra) {
  if (b->cap - b->n > extra) return true; /* keep one spare byte for tk_buf_cstr */
  size_t need = b->n + extra + 1;
  if (need < b->n) return false;
  size_t cap = b->cap ? b->cap : 64;
  while (cap < need) {
    if (cap > SIZE_MAX / 2) return false;
    cap *= 2;
  }
  char *p = realloc(b->p, cap);
  if (!p) return false;
  b->p = p;
  b->cap = cap;
  return true;
}

bool tk_buf_put(tk_buf *b, const void *s, size_t n) {
  if (!n) return true;
  if (!tk_buf_reserve(b, n)) return false;
  memcpy(b->p + b->n, s, n);
  b->n += n;
  return true;
}

bool tk_buf_putc(tk_buf *b, char c) {
  if (!tk_buf_reserve(b, 1)) return false;
  b->p[b->n++] = c;
  return true;
}

bool tk_buf_cstr(tk_buf *b) {
  if (!tk_buf_reserve(b, 0)) return false;
  b->p[b->n] = 0;
  return true;
}

void tk_buf_free(tk_buf *b) {
  free(b->p);
  b->p = NULL;
  b->n = b->cap = 0;
}

/* ================================================================ tk_arena */

struct tk_arena_blk {
  tk_arena_blk *next;
  size_t used, cap;
  char data[];
};

char *tk_arena_dup(tk_arena *a, const char *s, size_t n) {
  if (n >= SIZE_MAX / 2) return NULL;
  tk_arena_blk *b = a->head;
  if (!b || b->cap - b->used < n + 1) {
    size_t cap = n + 1 > (1u << 20) ? n + 1 : (1u << 20);
    b = malloc(sizeof *b + cap);
    if (!b) return NULL;
    b->next = a->head;
    b->used = 0;
    b->cap = cap;
    a->head = b;
  }
  char *p = b->data + b->used;
  if (n) memcpy(p, s, n);
  p[n] = 0;
  b->used += n + 1;
  return p;
}

void tk_arena_free(tk_arena *a) {
  tk_arena_blk *b = a->head;
  while (b) {
    tk_arena_blk *next = b->next;
    free(b);
    b = next;
  }
  a->head = NULL;
}
