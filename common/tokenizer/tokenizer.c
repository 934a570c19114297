/* Loading tokenizer.json / tokenizer_config.json, added tokens, the encode pipeline, the
 * post-processor (BOS/EOS), vocabulary queries and chat templates. See tok_internal.h for the
 * order of the encode steps, which is that of Hugging Face `tokenizers`. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok_internal.h"

#define TK_MAX_FILE ((size_t)1 << 30)

/* ================================================================ files */

/* Reads a whole file into a NUL-terminated malloc'ed buffer. */
static pd_status read_file(const char *path, char **out, size_t *len, pd_err *e) {
  *out = NULL;
  FILE *f = fopen(path, "rb");
  if (!f)
    return pd_err_set(e, errno == ENOENT ? PD_ENOTFOUND : PD_EIO, "cannot open %s: %s", path,
                      strerror(errno));
  tk_buf b = {0};
  char chunk[1 << 16];
  size_t r;
  while ((r = fread(chunk, 1, sizeof chunk, f)) > 0) {
    if (b.n + r > TK_MAX_FILE) {
      fclose(f);
      tk_buf_free(&b);
      return pd_err_set(e, PD_EFORMAT, "%s: larger than %zu bytes", path, TK_MAX_FILE);
    }
    if (!tk_buf_put(&b, chunk, r)) {
      fclose(f);
      tk_buf_free(&b);
      return pd_err_set(e, PD_ENOMEM, "out of memory reading %s", path);
    }
  }
  bool bad = ferror(f);
  fclose(f);
  if (bad || !tk_buf_cstr(&b)) {
    tk_buf_free(&b);
    return pd_err_set(e, bad ? PD_EIO : PD_ENOMEM, "cannot read %s", path);
  }
  *out = b.p;
  *len = b.n;
  return PD_OK;
}

static bool file_exists(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f) fclose(f);
  return f != NULL;
}

static pd_status parse_json(const char *path, const char *text, size_t len, cJSON **out, pd_err *e) {
  const char *end = NULL;
  *out = cJSON_ParseWithLengthOpts(text, len, &end, false);
  if (!*out) {
    size_t at = end && end >= text ? (size_t)(end - text) : 0;
    if (!end) {
      /* cJSON reports the position only through a global; fall back to "somewhere". */
      return pd_err_set(e, PD_EFORMAT, "%s: invalid JSON (or out of memory)", path);
    }
    return pd_err_set(e, PD_EFORMAT, "%s: invalid JSON near byte %zu", path, at);
  }
  return PD_OK;
}

static char *xstrdup(const char *s) {
  size_t n = strlen(s) + 1;
  char *p = malloc(n);
  if (p) memcpy(p, s, n);
  return p;
}

/* ================================================================ ids */

/* A JSON number that is an integer id in [0, TK_MAX_ID). */
static bool json_id(const cJSON *x, int32_t *id) {
  *id = -1;
  if (!cJSON_IsNumber(x)) return false;
  double v = x->valuedouble;
  if (!(v >= 0 && v < TK_MAX_ID) || v != (double)(int32_t)v) return false;
  *id = (int32_t)v;
  return true;
}

/* ================================================================ added tokens */

static pd_status trie_init(tk_trie *tr, pd_err *e) {
  memset(tr, 0, sizeof *tr);
  if (!pd_map_init(&tr->edges, 64, 0)) return pd_err_set(e, PD_ENOMEM, "out of memory");
  tr->term = malloc(64 * sizeof *tr->term);
  if (!tr->term) return pd_err_set(e, PD_ENOMEM, "out of memory");
  tr->cap_nodes = 64;
  tr->n_nodes = 1;
  tr->term[0] = -1;
  return PD_OK;
}

static void trie_free(tk_trie *tr) {
  pd_map_free(&tr->edges);
  free(tr->term);
  tr->term = NULL;
}

static pd_status trie_add(tk_trie *tr, const char *s, size_t n, int32_t idx, pd_err *e) {
  if (!n) return PD_OK;
  uint64_t node = 0;
  for (size_t i = 0; i < n; i++) {
    uint64_t key = (node << 8) | (unsigned char)s[i], child;
    if (!tk_u64_get(&tr->edges, key, &child)) {
      if (tr->n_nodes == tr->cap_nodes) {
        size_t cap = tr->cap_nodes * 2;
        int32_t *t = realloc(tr->term, cap * sizeof *t);
        if (!t) return pd_err_set(e, PD_ENOMEM, "out of memory");
        tr->term = t;
        tr->cap_nodes = cap;
      }
      child = tr->n_nodes++;
      tr->term[child] = -1;
      if (!tk_u64_put(&tr->edges, key, child)) return pd_err_set(e, PD_ENOMEM, "out of memory");
    }
    node = child;
  }
  /* The first pattern with this content wins, like Aho-Corasick's leftmost-longest. */
  if (tr->term[node] < 0) tr->term[node] = idx;
  tr->first[(unsigned char)s[0]] = true;
  tr->n_patterns++;
  return PD_OK;
}

/* Longest pattern starting at s[i]; returns its length (0 when none) and *idx. */
static size_t trie_match_at(const tk_trie *tr, const char *s, size_t n, size_t i, int32_t *idx) {
  uint64_t node = 0;
  size_t best = 0;
  for (size_t j = i; j < n; j++) {
    uint64_t child;
    if (!tk_u64_get(&tr->edges, (node << 8) | (unsigned char)s[j], &child)) break;
    node = child;
    if (tr->term[node] >= 0) {
      best = j + 1 - i;
      *idx = tr->term[node];
    }
  }
  return best;
}

/* One piece of text cut by added-token matching. */
typedef struct cut {
  size_t s, e;
  int32_t id; /* -1: plain text */
} cut;
typedef struct cuts {
  cut *v;
  size_t n, cap;
} cuts;

static bool cuts_push(cuts *c, size_t s, size_t e, int32_t id) {
  if (c->n == c->cap) {
    size_t cap = c->cap ? c->cap * 2 : 16;
    cut *v = realloc(c->v, cap * sizeof *v);
    if (!v) return false;
    c->v = v;
    c->cap = cap;
  }
  c->v[c->n++] = (cut){s, e, id};
  return true;
}

static uint32_t last_cp(const char *s, size_t n) {
  size_t k = n - 1;
  while (k > 0 && ((unsigned char)s[k] & 0xC0) == 0x80) k--;
  uint32_t cp;
  tk_utf8_next(s + k, n - k, &cp);
  return cp;
}

/* AddedVocabulary::find_matches: cuts s[0,n) into plain pieces and added tokens, honouring
 * single_word, lstrip and rstrip. */
static pd_status find_added(const pd_tokenizer *t, const tk_trie *tr, const char *s, size_t n,
                            cuts *out, pd_err *e) {
  out->n = 0;
  size_t start_offset = 0, i = 0;
  while (i < n) {
    if (!tr->first[(unsigned char)s[i]]) {
      i++;
      continue;
    }
    int32_t idx = -1;
    size_t ml = trie_match_at(tr, s, n, i, &idx);
    if (!ml) {
      i++;
      continue;
    }
    const tk_added *a = &t->added[idx];
    size_t start = i, stop = i + ml;
    i = stop; /* the matcher resumes after the raw match, as Aho-Corasick does */
    if (a->single_word) {
      bool start_space = start == 0 || !tk_is_word_char(last_cp(s, start));
      uint32_t next_cp = 0;
      if (stop < n) tk_utf8_next(s + stop, n - stop, &next_cp);
      bool stop_space = stop == n || !tk_is_word_char(next_cp);
      if (!start_space || !stop_space) continue;
    }
    if (a->lstrip) {
      size_t ns = start;
      while (ns > 0) {
        size_t k = ns - 1;
        while (k > 0 && ((unsigned char)s[k] & 0xC0) == 0x80) k--;
        uint32_t cp;
        tk_utf8_next(s + k, ns - k, &cp);
        if (!tk_is_white_space(cp)) break;
        ns = k;
      }
      start = ns > start_offset ? ns : start_offset;
    }
    if (a->rstrip) {
      while (stop < n) {
        uint32_t cp;
        int l = tk_utf8_next(s + stop, n - stop, &cp);
        if (!tk_is_white_space(cp)) break;
        stop += (size_t)l;
      }
    }
    if (start < start_offset) start = start_offset; /* never overlap the previous cut */
    if (start_offset < start && !cuts_push(out, start_offset, start, -1)) goto oom;
    if (!cuts_push(out, start, stop, a->id)) goto oom;
    start_offset = stop;
    if (i < stop) i = stop;
  }
  if (start_offset != n && !cuts_push(out, start_offset, n, -1)) goto oom;
  return PD_OK;
oom:
  return pd_err_set(e, PD_ENOMEM, "out of memory");
}

/* ================================================================ encode */

typedef struct enc_ctx {
  const pd_tokenizer *t;
  tk_ids ids;
  tk_scratch sc;
  tk_buf norm;
  tk_words w[2];
  tk_bpe_scratch bpe;
  cuts raw_cuts, norm_cuts;
  pd_err *e;
} enc_ctx;

static void enc_free(enc_ctx *c) {
  free(c->ids.v);
  pcre2_match_data_free(c->sc.md);
  tk_ranges_free(&c->sc.ranges);
  tk_buf_free(&c->sc.tmp);
  tk_buf_free(&c->sc.tmp2);
  tk_buf_free(&c->norm);
  tk_words_free(&c->w[0]);
  tk_words_free(&c->w[1]);
  tk_bpe_scratch_free(&c->bpe);
  free(c->raw_cuts.v);
  free(c->norm_cuts.v);
}

/* Pre-tokenizes and runs the model over one normalized piece. */
static pd_status enc_words(enc_ctx *c, const char *s, size_t n, bool first) {
  const pd_tokenizer *t = c->t;
  int which = 0;
  pd_status st = tk_pretok_apply(t->pt, t->n_pt, s, n, first, c->w, &which, &c->sc, c->e);
  if (st) return st;
  const tk_words *w = &c->w[which];
  for (size_t i = 0; i < w->n; i++) {
    st = tk_bpe_encode(&t->bpe, w->text.p + w->v[i].off, w->v[i].len, &c->bpe, &c->ids, c->e);
    if (st) return st;
  }
  return PD_OK;
}

/* Normalizes one plain piece of the raw text, cuts normalized added tokens out of it, and
 * encodes the rest. */
static pd_status enc_piece(enc_ctx *c, const char *s, size_t n, bool first) {
  const pd_tokenizer *t = c->t;
  pd_status st = tk_norm_apply(t->norm, t->n_norm, s, n, &c->norm, &c->sc, c->e);
  if (st) return st;
  const char *ns = c->norm.p;
  size_t nn = c->norm.n;
  if (!nn) return PD_OK;
  if (!t->trie_norm.n_patterns) return enc_words(c, ns, nn, first);
  if ((st = find_added(t, &t->trie_norm, ns, nn, &c->norm_cuts, c->e))) return st;
  for (size_t i = 0; i < c->norm_cuts.n; i++) {
    const cut *k = &c->norm_cuts.v[i];
    if (k->id >= 0) {
      if (!tk_ids_push(&c->ids, k->id)) return pd_err_set(c->e, PD_ENOMEM, "out of memory");
    } else if ((st = enc_words(c, ns + k->s, k->e - k->s, first && k->s == 0))) {
      return st;
    }
  }
  return PD_OK;
}

pd_status pd_tokenizer_encode(const pd_tokenizer *t, const char *text, size_t len,
                              bool add_special, int32_t **ids, size_t *n_ids, pd_err *e) {
  if (ids) *ids = NULL;
  if (n_ids) *n_ids = 0;
  if (!t || !ids || !n_ids || (len && !text))
    return pd_err_set(e, PD_EINVAL, "pd_tokenizer_encode: bad arguments");
  if (len > TK_MAX_FILE) return pd_err_set(e, PD_ERANGE, "text of %zu bytes is too long to encode", len);
  size_t valid = tk_utf8_valid_prefix(text, len);
  if (valid != len) return pd_err_set(e, PD_EINVAL, "text is not valid UTF-8 (byte %zu)", valid);

  enc_ctx c;
  memset(&c, 0, sizeof c);
  c.t = t;
  c.e = e;
  pd_status st = PD_OK;
  c.sc.md = pcre2_match_data_create(1, NULL);
  if (!c.sc.md) {
    st = pd_err_set(e, PD_ENOMEM, "out of memory");
    goto done;
  }
  if (add_special)
    for (size_t i = 0; i < t->n_pre; i++)
      if (!tk_ids_push(&c.ids, t->pre_ids[i])) goto oom;
  if (len) {
    if ((st = find_added(t, &t->trie_raw, text, len, &c.raw_cuts, e))) goto done;
    for (size_t i = 0; i < c.raw_cuts.n; i++) {
      const cut *k = &c.raw_cuts.v[i];
      if (k->id >= 0) {
        if (!tk_ids_push(&c.ids, k->id)) goto oom;
      } else if ((st = enc_piece(&c, text + k->s, k->e - k->s, k->s == 0))) {
        goto done;
      }
    }
  }
  if (add_special)
    for (size_t i = 0; i < t->n_post; i++)
      if (!tk_ids_push(&c.ids, t->post_ids[i])) goto oom;
  if (!c.ids.v && !(c.ids.v = malloc(sizeof(int32_t)))) goto oom;
  *ids = c.ids.v;
  *n_ids = c.ids.n;
  c.ids.v = NULL;
  goto done;
oom:
  st = pd_err_set(e, PD_ENOMEM, "out of memory");
done:
  enc_free(&c);
  return st;
}

/* ================================================================ post-processor */

typedef struct idlist {
  int32_t *v;
  size_t n;
} idlist;

static bool idlist_add(idlist *l, int32_t id, bool front) {
  int32_t *v = realloc(l->v, (l->n + 1) * sizeof *v);
  if (!v) return false;
  l->v = v;
  if (front) {
    memmove(v + 1, v, l->n * sizeof *v);
    v[0] = id;
  } else {
    v[l->n] = id;
  }
  l->n++;
  return true;
}

static pd_status id_of(const pd_tokenizer *t, const char *what, const cJSON *x, int32_t *id, pd_err *e) {
  if (!json_id(x, id) || *id >= t->n_toks || !(t->toks[*id].flags & TK_TOK_PRESENT))
    return pd_err_set(e, PD_EFORMAT, "post_processor %s: bad token id", what);
  return PD_OK;
}

/* Collects the special tokens the post-processor puts before and after a single sequence. */
static pd_status parse_post(pd_tokenizer *t, const cJSON *j, idlist *pre, idlist *post, int depth,
                            pd_err *e) {
  if (!j || cJSON_IsNull(j)) return PD_OK;
  if (depth > 8) return pd_err_set(e, PD_EFORMAT, "post_processor: nested too deeply");
  const char *type = tk_json_str(j, "type");
  if (!type) return pd_err_set(e, PD_EFORMAT, "post_processor: missing \"type\"");
  pd_status st;
  if (!strcmp(type, "ByteLevel")) return PD_OK;
  if (!strcmp(type, "Sequence")) {
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(j, "processors");
    if (!cJSON_IsArray(list)) return pd_err_set(e, PD_EFORMAT, "post_processor Sequence: \"processors\" must be an array");
    /* Each processor wraps the output of the previous one. */
    const cJSON *it;
    cJSON_ArrayForEach(it, list) {
      idlist p2 = {0}, q2 = {0};
      st = parse_post(t, it, &p2, &q2, depth + 1, e);
      for (size_t i = 0; !st && i < p2.n; i++)
        if (!idlist_add(pre, p2.v[p2.n - 1 - i], true)) st = pd_err_set(e, PD_ENOMEM, "out of memory");
      for (size_t i = 0; !st && i < q2.n; i++)
        if (!idlist_add(post, q2.v[i], false)) st = pd_err_set(e, PD_ENOMEM, "out of memory");
      free(p2.v);
      free(q2.v);
      if (st) return st;
    }
    return PD_OK;
  }
  if (!strcmp(type, "RobertaProcessing") || !strcmp(type, "BertProcessing")) {
    const cJSON *cls = cJSON_GetObjectItemCaseSensitive(j, "cls");
    const cJSON *sep = cJSON_GetObjectItemCaseSensitive(j, "sep");
    if (!cJSON_IsArray(cls) || cJSON_GetArraySize(cls) != 2 || !cJSON_IsArray(sep) || cJSON_GetArraySize(sep) != 2)
      return pd_err_set(e, PD_EFORMAT, "post_processor %s: cls/sep must be [token, id]", type);
    int32_t c = -1, s = -1;
    if ((st = id_of(t, type, cJSON_GetArrayItem(cls, 1), &c, e))) return st;
    if ((st = id_of(t, type, cJSON_GetArrayItem(sep, 1), &s, e))) return st;
    if (!idlist_add(pre, c, false) || !idlist_add(post, s, false)) return pd_err_set(e, PD_ENOMEM, "out of memory");
    return PD_OK;
  }
  if (!strcmp(type, "TemplateProcessing")) {
    const cJSON *single = cJSON_GetObjectItemCaseSensitive(j, "single");
    const cJSON *specials = cJSON_GetObjectItemCaseSensitive(j, "special_tokens");
    if (!cJSON_IsArray(single)) return pd_err_set(e, PD_EFORMAT, "post_processor TemplateProcessing: \"single\" must be an array");
    bool after = false;
    const cJSON *it;
    cJSON_ArrayForEach(it, single) {
      const cJSON *seq = cJSON_GetObjectItemCaseSensitive(it, "Sequence");
      const cJSON *sp = cJSON_GetObjectItemCaseSensitive(it, "SpecialToken");
      if (seq) {
        after = true;
        continue;
      }
      const char *name = sp ? tk_json_str(sp, "id") : NULL;
      if (!name) return pd_err_set(e, PD_EFORMAT, "post_processor TemplateProcessing: bad template item");
      const cJSON *def = cJSON_GetObjectItemCaseSensitive(specials, name);
      const cJSON *dids = def ? cJSON_GetObjectItemCaseSensitive(def, "ids") : NULL;
      if (!cJSON_IsArray(dids))
        return pd_err_set(e, PD_EFORMAT, "post_processor TemplateProcessing: special token \"%s\" has no ids", name);
      const cJSON *x;
      cJSON_ArrayForEach(x, dids) {
        int32_t id = -1;
        if ((st = id_of(t, "TemplateProcessing", x, &id, e))) return st;
        if (!idlist_add(after ? post : pre, id, false)) return pd_err_set(e, PD_ENOMEM, "out of memory");
      }
    }
    return PD_OK;
  }
  return pd_err_set(e, PD_EUNSUPPORTED, "post_processor type \"%s\" is not supported", type);
}

/* ================================================================ config */

/* bos_token / eos_token: a string or an AddedToken object {"content": ...}. */
static const char *config_token(const cJSON *cfg, const char *key) {
  const cJSON *x = cJSON_GetObjectItemCaseSensitive(cfg, key);
  if (cJSON_IsString(x)) return x->valuestring;
  if (cJSON_IsObject(x)) return tk_json_str(x, "content");
  return NULL;
}

/* add_bos_token / add_eos_token in the config override the post-processor, as transformers'
 * Llama tokenizers rebuild their template from them. */
static pd_status apply_add_flag(const cJSON *cfg, const char *key, int32_t id, idlist *l, bool front,
                                pd_err *e) {
  const cJSON *x = cJSON_GetObjectItemCaseSensitive(cfg, key);
  if (!cJSON_IsBool(x) || id < 0) return PD_OK;
  bool has = false;
  for (size_t i = 0; i < l->n; i++) has |= l->v[i] == id;
  if (cJSON_IsTrue(x) && !has) {
    if (!idlist_add(l, id, front)) return pd_err_set(e, PD_ENOMEM, "out of memory");
  } else if (cJSON_IsFalse(x) && has) {
    size_t k = 0;
    for (size_t i = 0; i < l->n; i++)
      if (l->v[i] != id) l->v[k++] = l->v[i];
    l->n = k;
  }
  return PD_OK;
}

/* The template: chat_template.jinja when present, else the config's "chat_template" (a string,
 * or a list of {name, template} of which "default" is used). */
static pd_status load_chat(pd_tokenizer *t, const cJSON *cfg, const char *jinja_path, pd_err *e) {
  if (jinja_path && file_exists(jinja_path)) {
    size_t len;
    pd_status st = read_file(jinja_path, &t->chat_src, &len, e);
    if (st) return st;
  } else if (cfg) {
    const cJSON *ct = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
    const char *src = NULL;
    if (cJSON_IsString(ct)) {
      src = ct->valuestring;
    } else if (cJSON_IsArray(ct)) {
      const cJSON *it, *first = NULL;
      cJSON_ArrayForEach(it, ct) {
        const char *name = tk_json_str(it, "name"), *tpl = tk_json_str(it, "template");
        if (!tpl) continue;
        if (!first) first = it;
        if (name && !strcmp(name, "default")) src = tpl;
      }
      if (!src && first) src = tk_json_str(first, "template");
    }
    if (src && !(t->chat_src = xstrdup(src))) return pd_err_set(e, PD_ENOMEM, "out of memory");
  }
  if (t->chat_src) {
    pd_err_clear(&t->chat_err);
    t->chat = pd_chat_template_parse(t->chat_src, strlen(t->chat_src), &t->chat_err);
    if (!t->chat && t->chat_err.code == PD_OK)
      pd_err_set(&t->chat_err, PD_EINVAL, "chat template could not be parsed");
  }
  return PD_OK;
}

/* ================================================================ load */

/* Added tokens get their ids the way `tokenizers` gives them when it reads a tokenizer.json
 * (AddedVocabulary::add_tokens, one entry at a time, in file order): the id of the same content
 * already added or in the model vocabulary, else the next free id after the model vocabulary.
 * The "id" written in the file is not used (`tokenizers` only warns when it differs); in
 * published files the two agree. */
static pd_status load_added(pd_tokenizer *t, const cJSON *list, pd_err *e) {
  if (!list || cJSON_IsNull(list)) list = NULL;
  else if (!cJSON_IsArray(list)) return pd_err_set(e, PD_EFORMAT, "\"added_tokens\" must be an array");
  size_t n = list ? (size_t)cJSON_GetArraySize(list) : 0;
  t->added = calloc(n ? n : 1, sizeof *t->added);
  if (!t->added || !pd_map_init(&t->added_map, n, 0)) return pd_err_set(e, PD_ENOMEM, "out of memory");
  int32_t max_added = -1;
  const int32_t n_vocab = (int32_t)pd_map_count(&t->bpe.vocab);
  const cJSON *it;
  for (it = list ? list->child : NULL; it; it = it->next) {
    int32_t declared;
    const char *content = tk_json_str(it, "content");
    if (!cJSON_IsObject(it) || !content || !json_id(cJSON_GetObjectItemCaseSensitive(it, "id"), &declared))
      return pd_err_set(e, PD_EFORMAT, "added_tokens: each entry needs \"id\" and \"content\"");
    if (!*content) continue; /* `tokenizers` ignores empty added tokens */
    size_t len = strlen(content);
    bool special = tk_json_bool(it, "special", false);
    tk_added a = {
        .special = special,
        .single_word = tk_json_bool(it, "single_word", false),
        .lstrip = tk_json_bool(it, "lstrip", false),
        .rstrip = tk_json_bool(it, "rstrip", false),
        .normalized = tk_json_bool(it, "normalized", !special),
    };
    int32_t id = tk_str_get(&t->added_map, content, len);
    if (id >= 0) {
      /* Same content again: same id, the new flags replace the old ones. */
      for (size_t i = 0; i < t->n_added; i++) {
        tk_added *o = &t->added[i];
        if (o->id == id && o->len == len && !memcmp(o->s, content, len)) {
          a.id = id;
          a.s = o->s;
          a.len = len;
          a.special |= o->special;
          *o = a;
        }
      }
      continue;
    }
    id = tk_str_get(&t->bpe.vocab, content, len);
    if (id < 0) {
      if (max_added < 0) id = n_vocab;
      else id = (max_added >= n_vocab || n_vocab == 0) ? max_added + 1 : n_vocab;
      if (id >= TK_MAX_ID) return pd_err_set(e, PD_EFORMAT, "added_tokens: too many tokens");
    }
    char *s = tk_arena_dup(&t->arena, content, len);
    if (!s) return pd_err_set(e, PD_ENOMEM, "out of memory");
    a.id = id;
    a.s = s;
    a.len = len;
    t->added[t->n_added++] = a;
    if (!tk_str_put(&t->added_map, s, len, id)) return pd_err_set(e, PD_ENOMEM, "out of memory");
    if (id > max_added) max_added = id;
  }
  return PD_OK;
}

/* The id table: vocabulary strings, then added tokens over them. */
static pd_status build_toks(pd_tokenizer *t, pd_err *e) {
  int32_t max_id = t->bpe.max_id;
  for (size_t i = 0; i < t->n_added; i++)
    if (t->added[i].id > max_id) max_id = t->added[i].id;
  t->n_toks = max_id + 1;
  t->toks = calloc((size_t)t->n_toks, sizeof *t->toks);
  if (!t->toks) return pd_err_set(e, PD_ENOMEM, "out of memory");
  /* Where the vocabulary gives one id to several strings, the id decodes to the smallest (by
   * length, then bytes): a choice that does not depend on the map's order. */
  const pd_map_slot *x;
  for (pd_map_it it = {0}; (x = pd_map_next(&t->bpe.vocab, &it));) {
    tk_tok *o = &t->toks[x->val];
    const char *s = pd_map_str_key(x);
    uint32_t len = (uint32_t)pd_map_str_len(x);
    if (o->flags && (o->len < len || (o->len == len && memcmp(o->s, s, len) <= 0))) continue;
    *o = (tk_tok){s, len, TK_TOK_PRESENT};
  }
  for (size_t i = 0; i < t->n_added; i++) {
    const tk_added *a = &t->added[i];
    t->toks[a->id] = (tk_tok){a->s, (uint32_t)a->len,
                              (uint8_t)(TK_TOK_PRESENT | TK_TOK_ADDED | (a->special ? TK_TOK_SPECIAL : 0))};
  }
  return PD_OK;
}

/* Tries for the raw (normalized: false) and normalized added tokens. A normalized token is
 * matched by its normalized form, as `tokenizers` does. */
static pd_status build_tries(pd_tokenizer *t, pd_err *e) {
  pd_status st;
  if ((st = trie_init(&t->trie_raw, e)) || (st = trie_init(&t->trie_norm, e))) return st;
  tk_scratch sc;
  memset(&sc, 0, sizeof sc);
  tk_buf nb = {0};
  sc.md = pcre2_match_data_create(1, NULL);
  if (!sc.md) return pd_err_set(e, PD_ENOMEM, "out of memory");
  /* Special tokens first, then the others, the order of refresh_added_tokens(). */
  for (int pass = 0; pass < 2 && !st; pass++) {
    for (size_t i = 0; i < t->n_added && !st; i++) {
      const tk_added *a = &t->added[i];
      if (a->special != (pass == 0)) continue;
      if (!a->normalized) {
        st = trie_add(&t->trie_raw, a->s, a->len, (int32_t)i, e);
      } else {
        st = tk_norm_apply(t->norm, t->n_norm, a->s, a->len, &nb, &sc, e);
        if (!st) st = trie_add(&t->trie_norm, nb.p, nb.n, (int32_t)i, e);
      }
    }
  }
  tk_buf_free(&nb);
  tk_buf_free(&sc.tmp);
  tk_buf_free(&sc.tmp2);
  tk_ranges_free(&sc.ranges);
  pcre2_match_data_free(sc.md);
  return st;
}

static pd_status load_json(pd_tokenizer *t, const cJSON *root, pd_err *e) {
  pd_status st;
  if (!cJSON_IsObject(root)) return pd_err_set(e, PD_EFORMAT, "top level must be an object");
  const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
  if (!cJSON_IsObject(model)) return pd_err_set(e, PD_EFORMAT, "missing \"model\" object");
  const char *mtype = tk_json_str(model, "type");
  if (mtype && strcmp(mtype, "BPE"))
    return pd_err_set(e, PD_EUNSUPPORTED, "model type \"%s\" is not supported (only BPE)", mtype);
  if ((st = tk_bpe_load(t, model, e))) return st;
  if ((st = load_added(t, cJSON_GetObjectItemCaseSensitive(root, "added_tokens"), e))) return st;
  if ((st = build_toks(t, e))) return st;
  if ((st = tk_norm_parse(cJSON_GetObjectItemCaseSensitive(root, "normalizer"), &t->norm, &t->n_norm, e))) return st;
  if ((st = tk_pretok_parse(cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), &t->pt, &t->n_pt, e))) return st;
  if ((st = tk_dec_parse(cJSON_GetObjectItemCaseSensitive(root, "decoder"), &t->dec, &t->n_dec, e))) return st;
  if ((st = build_tries(t, e))) return st;
  return PD_OK;
}

static pd_tokenizer *load(const char *json_path, const char *config_path, const char *jinja_path,
                          pd_err *e) {
  pd_tokenizer *t = calloc(1, sizeof *t);
  if (!t) {
    pd_err_set(e, PD_ENOMEM, "out of memory");
    return NULL;
  }
  t->bos = t->eos = -1;
  char *text = NULL, *ctext = NULL;
  cJSON *root = NULL, *cfg = NULL;
  idlist pre = {0}, post = {0};
  size_t len = 0;
  pd_status st = read_file(json_path, &text, &len, e);
  /* cJSON does not validate UTF-8 inside strings; token strings must be valid. */
  if (!st && tk_utf8_valid_prefix(text, len) != len)
    st = pd_err_set(e, PD_EFORMAT, "%s: not valid UTF-8 (byte %zu)", json_path, tk_utf8_valid_prefix(text, len));
  if (!st) st = parse_json(json_path, text, len, &root, e);
  free(text);
  if (!st) {
    st = load_json(t, root, e);
    if (st) pd_err_prefix(e, "%s", json_path);
  }
  if (!st) {
    st = parse_post(t, cJSON_GetObjectItemCaseSensitive(root, "post_processor"), &pre, &post, 0, e);
    if (st) pd_err_prefix(e, "%s", json_path);
  }
  cJSON_Delete(root);

  if (!st && config_path) {
    st = read_file(config_path, &ctext, &len, e);
    if (!st) st = parse_json(config_path, ctext, len, &cfg, e);
    free(ctext);
    if (!st && !cJSON_IsObject(cfg)) st = pd_err_set(e, PD_EFORMAT, "%s: top level must be an object", config_path);
    if (!st) {
      const char *b = config_token(cfg, "bos_token"), *s = config_token(cfg, "eos_token");
      if (b) {
        t->bos = pd_tokenizer_token_to_id(t, b);
        if (!(t->bos_str = xstrdup(b))) st = pd_err_set(e, PD_ENOMEM, "out of memory");
      }
      if (s && !st) {
        t->eos = pd_tokenizer_token_to_id(t, s);
        if (!(t->eos_str = xstrdup(s))) st = pd_err_set(e, PD_ENOMEM, "out of memory");
      }
    }
    if (!st) st = apply_add_flag(cfg, "add_bos_token", t->bos, &pre, true, e);
    if (!st) st = apply_add_flag(cfg, "add_eos_token", t->eos, &post, false, e);
  }
  if (!st) st = load_chat(t, cfg, jinja_path, e);
  cJSON_Delete(cfg);
  t->pre_ids = pre.v;
  t->n_pre = pre.n;
  t->post_ids = post.v;
  t->n_post = post.n;
  if (st) {
    pd_tokenizer_free(t);
    return NULL;
  }
  return t;
}

/* dir/name into a malloc'ed string. */
static char *join(const char *dir, const char *name) {
  size_t a = strlen(dir), b = strlen(name);
  char *p = malloc(a + b + 2);
  if (!p) return NULL;
  memcpy(p, dir, a);
  size_t k = a;
  if (a && dir[a - 1] != '/') p[k++] = '/';
  memcpy(p + k, name, b + 1);
  return p;
}

pd_tokenizer *pd_tokenizer_load(const char *dir, pd_err *e) {
  if (!dir) {
    pd_err_set(e, PD_EINVAL, "pd_tokenizer_load: NULL directory");
    return NULL;
  }
  char *json = join(dir, "tokenizer.json"), *cfg = join(dir, "tokenizer_config.json");
  char *jinja = join(dir, "chat_template.jinja");
  pd_tokenizer *t = NULL;
  if (!json || !cfg || !jinja) pd_err_set(e, PD_ENOMEM, "out of memory");
  else t = load(json, file_exists(cfg) ? cfg : NULL, jinja, e);
  free(json);
  free(cfg);
  free(jinja);
  return t;
}

pd_tokenizer *pd_tokenizer_load_files(const char *tokenizer_json, const char *config_path, pd_err *e) {
  if (!tokenizer_json) {
    pd_err_set(e, PD_EINVAL, "pd_tokenizer_load_files: NULL path");
    return NULL;
  }
  return load(tokenizer_json, config_path, NULL, e);
}

void pd_tokenizer_free(pd_tokenizer *t) {
  if (!t) return;
  tk_bpe_free(&t->bpe);
  pd_map_free(&t->added_map);
  free(t->added);
  trie_free(&t->trie_raw);
  trie_free(&t->trie_norm);
  tk_norm_free(t->norm, t->n_norm);
  tk_pretok_free(t->pt, t->n_pt);
  tk_dec_free(t->dec, t->n_dec);
  free(t->pre_ids);
  free(t->post_ids);
  free(t->bos_str);
  free(t->eos_str);
  free(t->chat_src);
  pd_chat_template_free(t->chat);
  free(t->toks);
  tk_arena_free(&t->arena);
  free(t);
}

/* ================================================================ queries */

int pd_tokenizer_vocab_size(const pd_tokenizer *t) { return t ? t->n_toks : 0; }

const char *pd_tokenizer_id_to_token(const pd_tokenizer *t, int32_t id) {
  if (!t || id < 0 || id >= t->n_toks || !(t->toks[id].flags & TK_TOK_PRESENT)) return NULL;
  return t->toks[id].s;
}

int32_t pd_tokenizer_token_to_id(const pd_tokenizer *t, const char *token) {
  if (!t || !token) return -1;
  size_t n = strlen(token);
  int32_t id = tk_str_get(&t->added_map, token, n);
  return id >= 0 ? id : tk_str_get(&t->bpe.vocab, token, n);
}

bool pd_tokenizer_is_special(const pd_tokenizer *t, int32_t id) {
  return t && id >= 0 && id < t->n_toks && (t->toks[id].flags & TK_TOK_SPECIAL);
}

int32_t pd_tokenizer_bos_id(const pd_tokenizer *t) { return t ? t->bos : -1; }
int32_t pd_tokenizer_eos_id(const pd_tokenizer *t) { return t ? t->eos : -1; }

/* ================================================================ chat */

bool pd_tokenizer_has_chat_template(const pd_tokenizer *t) { return t && t->chat_src; }

pd_status pd_tokenizer_apply_chat(const pd_tokenizer *t, const pd_chat_msg *msgs, size_t n,
                                  bool add_generation_prompt, char **out, pd_err *e) {
  if (out) *out = NULL;
  if (!t || !out || (n && !msgs)) return pd_err_set(e, PD_EINVAL, "pd_tokenizer_apply_chat: bad arguments");
  for (size_t i = 0; i < n; i++)
    if (!msgs[i].role || !msgs[i].content)
      return pd_err_set(e, PD_EINVAL, "chat message %zu has no role or content", i);
  if (!t->chat_src) return pd_err_set(e, PD_ENOTFOUND, "the tokenizer has no chat template");
  if (!t->chat) {
    pd_status code = t->chat_err.code ? t->chat_err.code : PD_EINVAL;
    return pd_err_set(e, code, "chat template: %s", t->chat_err.msg);
  }
  pd_chat_vars v = {
      .messages = msgs,
      .n_messages = n,
      .add_generation_prompt = add_generation_prompt,
      .bos_token = t->bos_str,
      .eos_token = t->eos_str,
  };
  return pd_chat_template_render(t->chat, &v, out, e);
}
