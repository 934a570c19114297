/* The router's one hash map: string -> pointer, open addressing (linear probing, tombstones),
 * keys copied. Used for wire request ids and ZeroMQ client request keys (router.h) and the HTTP
 * server's connections per peer address (http.c). Single-threaded, like its users. */
#ifndef PD_SMAP_H
#define PD_SMAP_H

#include <stdbool.h>
#include <stddef.h>

typedef struct smap_entry {
  char *key; /* NULL: empty; (char *)1: deleted */
  void *val;
} smap_entry;

typedef struct smap {
  smap_entry *v;
  size_t cap, n, used; /* used counts deleted slots too */
} smap;

void smap_init(smap *m);
void smap_free(smap *m);
bool smap_put(smap *m, const char *key, void *val); /* false on allocation failure */
void *smap_get(const smap *m, const char *key);
void smap_del(smap *m, const char *key);

#endif
