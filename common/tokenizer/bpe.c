/* The BPE model of tokenizer.json: vocabulary, merges and the merge loop.
 *
 * Merges live in one hash map keyed by (left id, right id) and holding (rank, merged id), so a
 * word is merged without building strings. The merge loop is the one of `tokenizers`
 * (models/bpe/word.rs): symbols in a doubly linked list, candidate pairs in a binary heap
 * ordered by (rank, position); stale heap entries are skipped when popped. O(n log n) per word. */
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

void tk_bpe_scratch_free(tk_bpe_scratch *s) {
  free(s->sym);
  free(s->heap);
  tk_buf_free(&s->key);
  memset(s, 0, sizeof *s);
}

bool tk_ids_push(tk_ids *a, int32_t id) {
  if (a->n == a->cap) {
    size_t cap = a->cap ? a->cap * 2 : 64;
    int32_t *v = realloc(a->v, cap * sizeof *v);
    if (!v) return false;
    a->v = v;
    a->cap = cap;
  }
  a->v[a->n++] = id;
  return true;
}

void tk_bpe_free(tk_bpe *b) {
  pd_map_free(&b->vocab);
  pd_map_free(&b->merges);
  free(b->prefix);
  free(b->suffix);
  free(b->char_ids);
  memset(b, 0, sizeof *b);
}

static pd_status opt_string(const cJSON *model, const char *key, char **out, size_t *len, pd_err *e) {
  const cJSON *x = cJSON_GetObjectItemCaseSensitive(model, key);
  const char *s = "";
  if (x && !cJSON_IsNull(x)) {
    if (!cJSON_IsString(x)) return pd_err_set(e, PD_EFORMAT, "model: \"%s\" must be a string", key);
    s = x->valuestring;
  }
  *len = strlen(s);
  *out = malloc(*len + 1);
  if (!*out) return pd_err_set(e, PD_ENOMEM, "out of memory");
  memcpy(*out, s, *len + 1);
  return PD_OK;
}

/* Adds merge (a, b) with the given rank. */
static pd_status add_merge(tk_bpe *b, const char *l, size_t ll, const char *r, size_t rl,
                           uint32_t rank, pd_err *e) {
  int32_t li = tk_str_get(&b->vocab, l, ll), ri = tk_str_get(&b->vocab, r, rl);
  if (li < 0 || ri < 0)
    return pd_err_set(e, PD_EFORMAT, "merge %u: token \"%.*s\" is not in the vocabulary", rank,
                      (int)(li < 0 ? ll : rl), li < 0 ? l : r);
  /* The merged token is a + b without b's continuing-subword prefix. */
  if (rl < b->prefix_len)
    return pd_err_set(e, PD_EFORMAT, "merge %u: \"%.*s\" lacks the continuing-subword prefix",
                      rank, (int)rl, r);
  tk_buf *key = &(tk_buf){0};
  char stackbuf[256];
  size_t kn = ll + rl - b->prefix_len;
  char *k = stackbuf;
  if (kn > sizeof stackbuf) {
    if (!tk_buf_reserve(key, kn)) return pd_err_set(e, PD_ENOMEM, "out of memory");
    k = key->p;
  }
  memcpy(k, l, ll);
  memcpy(k + ll, r + b->prefix_len, rl - b->prefix_len);
  int32_t mi = tk_str_get(&b->vocab, k, kn);
  if (mi < 0) {
    pd_err_set(e, PD_EFORMAT, "merge %u: merged token \"%.*s\" is not in the vocabulary", rank,
               (int)kn, k);
    tk_buf_free(key);
    return PD_EFORMAT;
  }
  tk_buf_free(key);
  /* A repeated pair takes its last rank, as in `tokenizers` (HashMap collect). */
  if (!tk_u64_put(&b->merges, ((uint64_t)(uint32_t)li << 32) | (uint32_t)ri,
                  ((uint64_t)rank << 32) | (uint32_t)mi))
    return pd_err_set(e, PD_ENOMEM, "out of memory");
  return PD_OK;
}

pd_status tk_bpe_load(struct pd_tokenizer *t, const cJSON *model, pd_err *e) {
  tk_bpe *b = &t->bpe;
  pd_status st;
  b->unk_id = -1;
  for (int i = 0; i < 256; i++) b->byte_ids[i] = -1;
  if ((st = opt_string(model, "continuing_subword_prefix", &b->prefix, &b->prefix_len, e))) return st;
  if ((st = opt_string(model, "end_of_word_suffix", &b->suffix, &b->suffix_len, e))) return st;
  b->fuse_unk = tk_json_bool(model, "fuse_unk", false);
  b->byte_fallback = tk_json_bool(model, "byte_fallback", false);
  b->ignore_merges = tk_json_bool(model, "ignore_merges", false);

  const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
  const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
  if (!cJSON_IsObject(vocab)) return pd_err_set(e, PD_EFORMAT, "model: \"vocab\" must be an object");
  if (!cJSON_IsArray(merges)) return pd_err_set(e, PD_EFORMAT, "model: \"merges\" must be an array");

  size_t nv = 0;
  for (const cJSON *it = vocab->child; it; it = it->next) nv++;
  if (!pd_map_init(&b->vocab, nv, 0)) return pd_err_set(e, PD_ENOMEM, "out of memory");
  b->max_id = -1;
  for (const cJSON *it = vocab->child; it; it = it->next) {
    double v = cJSON_IsNumber(it) ? it->valuedouble : -1;
    if (!(v >= 0 && v < TK_MAX_ID) || v != (double)(int32_t)v)
      return pd_err_set(e, PD_EFORMAT, "model: vocab entry \"%s\" needs an integer id in [0, %d)",
                        it->string ? it->string : "", TK_MAX_ID);
    int32_t id = (int32_t)v;
    size_t len = strlen(it->string);
    /* Hashes the JSON's string rather than its fresh copy: XXH3's wide loads over the copy's
     * just-made stores stall on store forwarding, and the table's cache miss waits for them
     * (Qwen3's 151k insertions: 24 ms that way, 17 ms this way). */
    uint64_t h = pd_map_hash(it->string, len);
    char *s = tk_arena_dup(&t->arena, it->string, len);
    if (!s || !pd_map_str_put(&b->vocab, h, s, len, (uint32_t)id))
      return pd_err_set(e, PD_ENOMEM, "out of memory");
    if (id > b->max_id) b->max_id = id;
  }
  if (b->max_id < 0) return pd_err_set(e, PD_EFORMAT, "model: empty vocabulary");

  size_t nm = 0;
  for (const cJSON *it = merges->child; it; it = it->next) nm++;
  if (nm > UINT32_MAX / 2) return pd_err_set(e, PD_EFORMAT, "model: too many merges");
  if (!pd_map_init(&b->merges, nm, 0)) return pd_err_set(e, PD_ENOMEM, "out of memory");
  uint32_t rank = 0;
  for (const cJSON *it = merges->child; it; it = it->next, rank++) {
    if (cJSON_IsString(it)) {
      /* "left right": split at a space such that both halves are tokens (normally the only
       * space, since byte-level and SentencePiece vocabularies spell spaces differently). */
      const char *s = it->valuestring, *sp = strchr(s, ' ');
      size_t n = strlen(s);
      if (!sp) return pd_err_set(e, PD_EFORMAT, "merge %u: \"%s\" is not \"left right\"", rank, s);
      const char *cand = sp;
      while (cand) {
        size_t ll = (size_t)(cand - s);
        if (tk_str_get(&b->vocab, s, ll) >= 0 &&
            tk_str_get(&b->vocab, cand + 1, n - ll - 1) >= 0)
          break;
        cand = strchr(cand + 1, ' ');
      }
      if (!cand) cand = sp; /* let add_merge report the missing token */
      size_t ll = (size_t)(cand - s);
      if ((st = add_merge(b, s, ll, cand + 1, n - ll - 1, rank, e))) return st;
    } else if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 2 && cJSON_IsString(it->child) &&
               cJSON_IsString(it->child->next)) {
      const char *l = it->child->valuestring, *r = it->child->next->valuestring;
      if ((st = add_merge(b, l, strlen(l), r, strlen(r), rank, e))) return st;
    } else {
      return pd_err_set(e, PD_EFORMAT, "merge %u: expected \"a b\" or [\"a\", \"b\"]", rank);
    }
  }

  const cJSON *unk = cJSON_GetObjectItemCaseSensitive(model, "unk_token");
  if (cJSON_IsString(unk)) {
    b->unk_id = tk_str_get(&b->vocab, unk->valuestring, strlen(unk->valuestring));
    if (b->unk_id < 0)
      return pd_err_set(e, PD_EFORMAT, "model: unk_token \"%s\" is not in the vocabulary",
                        unk->valuestring);
  } else if (unk && !cJSON_IsNull(unk)) {
    return pd_err_set(e, PD_EFORMAT, "model: \"unk_token\" must be a string or null");
  }

  if (b->byte_fallback) {
    for (int i = 0; i < 256; i++) {
      char name[8];
      snprintf(name, sizeof name, "<0x%02X>", i);
      b->byte_ids[i] = tk_str_get(&b->vocab, name, 6);
    }
  }
  /* Direct table for one-character tokens below U+0800: covers the byte-level alphabet and
   * most Latin/Cyrillic/Greek text without hashing. */
  if (!b->prefix_len && !b->suffix_len) {
    b->char_ids = malloc(0x800 * sizeof *b->char_ids);
    if (!b->char_ids) return pd_err_set(e, PD_ENOMEM, "out of memory");
    for (uint32_t cp = 0; cp < 0x800; cp++) {
      char enc[4];
      int l = tk_utf8_encode(cp, enc);
      b->char_ids[cp] = tk_str_get(&b->vocab, enc, (size_t)l);
    }
  }
  return PD_OK;
}

/* ---------------------------------------------------------------- merge loop */

static bool merge_less(const tk_bpe_merge *a, const tk_bpe_merge *b) {
  return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(tk_bpe_merge *h, size_t *n, tk_bpe_merge m) {
  size_t i = (*n)++;
  while (i > 0) {
    size_t p = (i - 1) / 2;
    if (!merge_less(&m, &h[p])) break;
    h[i] = h[p];
    i = p;
  }
  h[i] = m;
}

static tk_bpe_merge heap_pop(tk_bpe_merge *h, size_t *n) {
  tk_bpe_merge top = h[0], last = h[--(*n)];
  size_t i = 0;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= *n) break;
    if (c + 1 < *n && merge_less(&h[c + 1], &h[c])) c++;
    if (!merge_less(&h[c], &last)) break;
    h[i] = h[c];
    i = c;
  }
  if (*n) h[i] = last;
  return top;
}

static bool lookup_pair(const tk_bpe *b, int32_t l, int32_t r, uint32_t *rank, int32_t *id) {
  uint64_t v;
  if (!tk_u64_get(&b->merges, ((uint64_t)(uint32_t)l << 32) | (uint32_t)r, &v)) return false;
  *rank = (uint32_t)(v >> 32);
  *id = (int32_t)(uint32_t)v;
  return true;
}

/* Id of the word's character at s[0,l) (with prefix when not first, suffix when last). */
static int32_t char_id(const tk_bpe *b, const char *s, int l, bool first, bool last,
                       tk_buf *key) {
  if (b->char_ids && l <= 2) {
    uint32_t cp;
    tk_utf8_next(s, (size_t)l, &cp);
    return b->char_ids[cp];
  }
  bool pre = !first && b->prefix_len, suf = last && b->suffix_len;
  if (!pre && !suf) return tk_str_get(&b->vocab, s, (size_t)l);
  key->n = 0;
  if ((pre && !tk_buf_put(key, b->prefix, b->prefix_len)) || !tk_buf_put(key, s, (size_t)l) ||
      (suf && !tk_buf_put(key, b->suffix, b->suffix_len)))
    return -2;
  return tk_str_get(&b->vocab, key->p, key->n);
}

pd_status tk_bpe_encode(const tk_bpe *b, const char *w, size_t n, tk_bpe_scratch *sc,
                        tk_ids *out, pd_err *e) {
  if (!n) return PD_OK;
  if (b->ignore_merges) {
    int32_t id = tk_str_get(&b->vocab, w, n);
    if (id >= 0) return tk_ids_push(out, id) ? PD_OK : pd_err_set(e, PD_ENOMEM, "out of memory");
  }
  /* At most n symbols (one per byte with byte fallback). */
  if (sc->sym_cap < n) {
    tk_bpe_sym *s = realloc(sc->sym, n * sizeof *s);
    if (!s) return pd_err_set(e, PD_ENOMEM, "out of memory");
    sc->sym = s;
    sc->sym_cap = n;
  }
  tk_bpe_sym *sym = sc->sym;
  size_t ns = 0;
  int32_t unk_id = -1;
  uint32_t unk_len = 0;
#define ADD_SYM(ID, LEN)                                                              \
  do {                                                                                \
    sym[ns] = (tk_bpe_sym){(ID), (int32_t)ns - 1, (int32_t)ns + 1, (uint32_t)(LEN)}; \
    ns++;                                                                             \
  } while (0)

  for (size_t i = 0; i < n;) {
    int l = tk_utf8_len((unsigned char)w[i]);
    if ((size_t)l > n - i) l = (int)(n - i);
    int32_t id = char_id(b, w + i, l, i == 0, i + (size_t)l == n, &sc->key);
    if (id == -2) return pd_err_set(e, PD_ENOMEM, "out of memory");
    if (id >= 0) {
      if (unk_id >= 0) {
        ADD_SYM(unk_id, unk_len);
        unk_id = -1;
      }
      ADD_SYM(id, l);
    } else {
      bool done = false;
      if (b->byte_fallback) {
        /* `tokenizers` spells the bytes of the character as looked up (with prefix/suffix). */
        bool pre = i != 0 && b->prefix_len, suf = i + (size_t)l == n && b->suffix_len;
        size_t total = (pre ? b->prefix_len : 0) + (size_t)l + (suf ? b->suffix_len : 0);
        const char *parts[3] = {pre ? b->prefix : "", w + i, suf ? b->suffix : ""};
        size_t lens[3] = {pre ? b->prefix_len : 0, (size_t)l, suf ? b->suffix_len : 0};
        bool all = true;
        for (int p = 0; p < 3 && all; p++)
          for (size_t k = 0; k < lens[p]; k++)
            if (b->byte_ids[(unsigned char)parts[p][k]] < 0) all = false;
        if (all) {
          if (ns + total > sc->sym_cap) {
            size_t cap = ns + total + (n - i);
            tk_bpe_sym *s2 = realloc(sc->sym, cap * sizeof *s2);
            if (!s2) return pd_err_set(e, PD_ENOMEM, "out of memory");
            sc->sym = sym = s2;
            sc->sym_cap = cap;
          }
          /* The pending unk is not flushed first: this reproduces `tokenizers`. */
          for (int p = 0; p < 3; p++)
            for (size_t k = 0; k < lens[p]; k++) ADD_SYM(b->byte_ids[(unsigned char)parts[p][k]], 1);
          done = true;
        }
      }
      if (!done && b->unk_id >= 0) {
        if (unk_id >= 0 && b->fuse_unk) {
          unk_len += (uint32_t)l;
        } else {
          if (unk_id >= 0) ADD_SYM(unk_id, unk_len);
          unk_id = b->unk_id;
          unk_len = (uint32_t)l;
        }
      }
      /* No unk token: the character is dropped, as in `tokenizers`. */
    }
    i += (size_t)l;
    /* Byte fallback can emit several symbols per character; keep room for the rest. */
    if (ns + (n - i) + 1 > sc->sym_cap) {
      size_t cap = ns + (n - i) + 16;
      tk_bpe_sym *s2 = realloc(sc->sym, cap * sizeof *s2);
      if (!s2) return pd_err_set(e, PD_ENOMEM, "out of memory");
      sc->sym = sym = s2;
      sc->sym_cap = cap;
    }
  }
  if (unk_id >= 0) ADD_SYM(unk_id, unk_len);
#undef ADD_SYM
  if (!ns) return PD_OK;
  sym[ns - 1].next = -1;

  /* Heap: initial pairs plus at most two new ones per merge. */
  size_t hcap = 3 * ns + 1;
  if (sc->heap_cap < hcap) {
    tk_bpe_merge *h = realloc(sc->heap, hcap * sizeof *h);
    if (!h) return pd_err_set(e, PD_ENOMEM, "out of memory");
    sc->heap = h;
    sc->heap_cap = hcap;
  }
  tk_bpe_merge *heap = sc->heap;
  size_t hn = 0;
  for (size_t i = 0; i + 1 < ns; i++) {
    uint32_t rank;
    int32_t nid;
    if (lookup_pair(b, sym[i].id, sym[i + 1].id, &rank, &nid))
      heap_push(heap, &hn, (tk_bpe_merge){rank, (uint32_t)i, nid});
  }
  while (hn) {
    tk_bpe_merge top = heap_pop(heap, &hn);
    tk_bpe_sym *cur = &sym[top.pos];
    if (cur->len == 0 || cur->next < 0) continue;
    tk_bpe_sym *right = &sym[cur->next];
    uint32_t rank;
    int32_t nid;
    /* Stale entry: the pair at this position changed since it was queued. */
    if (!lookup_pair(b, cur->id, right->id, &rank, &nid) || nid != top.new_id) continue;
    cur->id = top.new_id;
    cur->len += right->len;
    cur->next = right->next;
    right->len = 0;
    if (cur->next >= 0) sym[cur->next].prev = (int32_t)top.pos;
    if (cur->prev >= 0 && lookup_pair(b, sym[cur->prev].id, cur->id, &rank, &nid))
      heap_push(heap, &hn, (tk_bpe_merge){rank, (uint32_t)cur->prev, nid});
    if (cur->next >= 0 && lookup_pair(b, cur->id, sym[cur->next].id, &rank, &nid))
      heap_push(heap, &hn, (tk_bpe_merge){rank, top.pos, nid});
  }
  for (size_t i = 0; i < ns; i++)
    if (sym[i].len && !tk_ids_push(out, sym[i].id)) return pd_err_set(e, PD_ENOMEM, "out of memory");
  return PD_OK;
}
