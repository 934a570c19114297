/* Private to common/tokenizer/: the pieces of a Hugging Face tokenizer.json pipeline.
 *
 * Encoding follows the `tokenizers` library step by step:
 *   1. added tokens whose `normalized` flag is false are cut out of the raw text (leftmost-longest);
 *   2. every remaining piece is normalized on its own, then added tokens with `normalized` true are
 *      cut out of the normalized text;
 *   3. the pre-tokenizer chain splits each remaining piece into words;
 *   4. the BPE model turns each word into ids;
 *   5. the post-processor adds BOS/EOS when asked.
 * Decoding runs the decoder chain as a stream (decoder.c), so one-shot and incremental decoding
 * are the same code. */
#ifndef PD_TOK_INTERNAL_H
#define PD_TOK_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <cjson/cJSON.h>
#include <pcre2.h>

#include "pd/chat_template.h"
#include "pd/map.h"
#include "pd/status.h"
#include "pd/tokenizer.h"

/* ---------------------------------------------------------------- byte buffer ---- */
/* A growable byte string. Not NUL-terminated unless tk_buf_cstr() is called. */
typedef struct tk_buf {
  char *p;
  size_t n, cap;
} tk_buf;

/* Each returns false on allocation failure (the buffer is left as it was). */
bool tk_buf_reserve(tk_buf *b, size_t extra);
bool tk_buf_put(tk_buf *b, const void *s, size_t n);
bool tk_buf_putc(tk_buf *b, char c);
bool tk_buf_cstr(tk_buf *b); /* writes a NUL after the last byte (not counted in n) */
void tk_buf_free(tk_buf *b);

/* ---------------------------------------------------------------- hash maps ---- */
/* The tokenizer's keys in the program's map (pd/map.h): byte strings -> id (keys borrowed from
 * the tokenizer's arena) and u64 -> u64, hashed with pd_map_hash and pd_map_hash_u64. */
static inline int32_t tk_str_get(const pd_map *m, const char *s, size_t len) { /* -1: absent */
  const pd_map_slot *x = pd_map_str_find(m, pd_map_hash(s, len), s, len);
  return x ? (int32_t)x->val : -1;
}
/* Inserts or overwrites; false on allocation failure. s must outlive the map. */
static inline bool tk_str_put(pd_map *m, const char *s, size_t len, int32_t id) {
  return pd_map_str_put(m, pd_map_hash(s, len), s, len, (uint32_t)id) != NULL;
}
static inline bool tk_u64_get(const pd_map *m, uint64_t k, uint64_t *v) {
  const pd_map_slot *x = pd_map_u64_find(m, pd_map_hash_u64(k), k);
  if (x) *v = x->val;
  return x != NULL;
}
static inline bool tk_u64_put(pd_map *m, uint64_t k, uint64_t v) {
  return pd_map_u64_put(m, pd_map_hash_u64(k), k, v) != NULL;
}

/* ---------------------------------------------------------------- arena ---- */
/* Bump allocator for the token strings (hundreds of thousands of small strings). */
typedef struct tk_arena_blk tk_arena_blk;
typedef struct tk_arena {
  tk_arena_blk *head;
} tk_arena;

/* NUL-terminated copy of s[0,n); NULL on allocation failure. */
char *tk_arena_dup(tk_arena *a, const char *s, size_t n);
void tk_arena_free(tk_arena *a);

/* ---------------------------------------------------------------- UTF-8 / Unicode ---- */
/* Length of the longest valid UTF-8 prefix of s[0,n) (n when all of it is valid). */
size_t tk_utf8_valid_prefix(const char *s, size_t n);
/* Decodes the character at s (which must be valid UTF-8, n > 0); returns its length. */
int tk_utf8_next(const char *s, size_t n, uint32_t *cp);
/* Length in bytes of the character starting with lead byte c (1 for invalid leads). */
int tk_utf8_len(unsigned char c);
int tk_utf8_encode(uint32_t cp, char out[4]);
/* Appends s[0,n) to out as UTF-8, replacing each maximal invalid subpart with U+FFFD (the rule
 * of Rust's String::from_utf8_lossy and Python's errors="replace"). When final is false, a
 * trailing sequence that is incomplete but could still become valid is left unconsumed.
 * Returns the bytes consumed, or (size_t)-1 on allocation failure. */
size_t tk_utf8_lossy(tk_buf *out, const unsigned char *s, size_t n, bool final);

extern const char tk_fffd[3]; /* U+FFFD in UTF-8 */

bool tk_is_white_space(uint32_t cp); /* Unicode White_Space (Rust char::is_whitespace) */
bool tk_is_word_char(uint32_t cp);   /* Rust regex \w: letters, marks, Nd, Nl, Pc, joiners */

/* GPT-2 byte-level alphabet: byte b <-> a printable code point (U+0021..U+0143). */
typedef struct tk_bytelevel {
  char enc[256][2];     /* UTF-8 of the code point for byte b */
  uint8_t enc_len[256]; /* 1 or 2 */
  int16_t dec[324];     /* code point -> byte, -1 when not in the alphabet */
} tk_bytelevel;
const tk_bytelevel *tk_bytelevel_table(void);
/* Appends the byte-level form of s[0,n) to out; false on allocation failure. */
bool tk_bytelevel_encode(tk_buf *out, const char *s, size_t n);

/* ---------------------------------------------------------------- regex ---- */
typedef struct tk_range {
  size_t s, e;
} tk_range;
typedef struct tk_ranges {
  tk_range *v;
  size_t n, cap;
} tk_ranges;
bool tk_ranges_push(tk_ranges *r, size_t s, size_t e);
void tk_ranges_free(tk_ranges *r);

/* Compiles a pattern with PCRE2_UTF|PCRE2_UCP (or as a literal string), JIT when available.
 * what names the pattern in error messages. */
pcre2_code *tk_re_compile(const char *pat, size_t len, bool literal, const char *what, pd_err *e);
/* All matches of re in s[0,n), iterated like the Rust/Oniguruma find_iter of `tokenizers`
 * (an empty match right where the previous match ended is skipped). */
pd_status tk_re_find_all(const pcre2_code *re, const char *s, size_t n, pcre2_match_data *md,
                         tk_ranges *out, pd_err *e);
/* Replaces every match of re (or every occurrence of the literal lit when re is NULL) in
 * s[0,n) by rep, appending the result to out. */
pd_status tk_replace_all(const pcre2_code *re, const char *lit, size_t lit_len, const char *rep,
                         size_t rep_len, const char *s, size_t n, pcre2_match_data *md,
                         tk_ranges *scratch, tk_buf *out, pd_err *e);

/* ---------------------------------------------------------------- JSON helpers ---- */
/* A string member, or NULL when absent / not a string. */
const char *tk_json_str(const cJSON *o, const char *key);
/* A bool member, or dflt when absent / not a bool. */
bool tk_json_bool(const cJSON *o, const char *key, bool dflt);
/* Reads pattern {"String": s} or {"Regex": r}; *is_regex tells which. */
pd_status tk_json_pattern(const cJSON *o, const char *what, const char **pat, bool *is_regex,
                          pd_err *e);

/* ---------------------------------------------------------------- normalizers ---- */
typedef enum tk_norm_type {
  TK_NORM_NFC,
  TK_NORM_NFD,
  TK_NORM_NFKC,
  TK_NORM_NFKD,
  TK_NORM_LOWERCASE,
  TK_NORM_PREPEND,
  TK_NORM_APPEND,
  TK_NORM_REPLACE,
  TK_NORM_STRIP,
  TK_NORM_STRIP_ACCENTS,
  TK_NORM_BYTELEVEL,
} tk_norm_type;

typedef struct tk_norm {
  tk_norm_type type;
  char *str; /* prepend / append / replace content */
  size_t str_len;
  char *pat; /* literal replace pattern (when re is NULL) */
  size_t pat_len;
  pcre2_code *re; /* regex replace pattern */
  bool left, right; /* strip */
} tk_norm;

/* Parses a normalizer (JSON null / NULL means none), flattening Sequence. */
pd_status tk_norm_parse(const cJSON *j, tk_norm **out, size_t *n, pd_err *e);
void tk_norm_free(tk_norm *v, size_t n);

/* Per-call scratch shared by the encode steps. */
typedef struct tk_scratch {
  pcre2_match_data *md;
  tk_ranges ranges;
  tk_buf tmp, tmp2;
} tk_scratch;

/* Runs the chain over s[0,n) into out (cleared first). */
pd_status tk_norm_apply(const tk_norm *v, size_t nv, const char *s, size_t n, tk_buf *out,
                        tk_scratch *sc, pd_err *e);

/* ---------------------------------------------------------------- pre-tokenizers ---- */
typedef enum tk_split_behavior {
  TK_SPLIT_REMOVED,
  TK_SPLIT_ISOLATED,
  TK_SPLIT_MERGED_PREV,
  TK_SPLIT_MERGED_NEXT,
  TK_SPLIT_CONTIGUOUS,
} tk_split_behavior;

typedef enum tk_prepend_scheme { TK_PREPEND_ALWAYS, TK_PREPEND_FIRST, TK_PREPEND_NEVER } tk_prepend_scheme;

typedef enum tk_pretok_type { TK_PT_SPLIT, TK_PT_BYTELEVEL, TK_PT_METASPACE } tk_pretok_type;

typedef struct tk_pretok {
  tk_pretok_type type;
  pcre2_code *re; /* split pattern; ByteLevel: the GPT-2 regex when use_regex */
  tk_split_behavior behavior;
  bool invert;
  bool add_prefix_space; /* ByteLevel */
  char repl[4];          /* Metaspace replacement character (UTF-8) */
  int repl_len;
  tk_prepend_scheme prepend;
  bool split;
} tk_pretok;

/* Words produced by pre-tokenization: spans into text. first: the span starts at offset 0 of
 * the original input (Metaspace prepend_scheme "first"). */
typedef struct tk_span {
  size_t off, len;
  bool first;
} tk_span;
typedef struct tk_words {
  tk_buf text;
  tk_span *v;
  size_t n, cap;
} tk_words;
void tk_words_free(tk_words *w);

pd_status tk_pretok_parse(const cJSON *j, tk_pretok **out, size_t *n, pd_err *e);
void tk_pretok_free(tk_pretok *v, size_t n);
/* Splits s[0,n) with the chain; the result is in w[*which] (w[0] and w[1] are double buffers). */
pd_status tk_pretok_apply(const tk_pretok *v, size_t nv, const char *s, size_t n, bool first,
                          tk_words w[2], int *which, tk_scratch *sc, pd_err *e);

/* ---------------------------------------------------------------- BPE model ---- */
/* Largest id accepted in a tokenizer.json (2^24): keeps a damaged file from asking for a huge
 * id table; real vocabularies stay below 300k. */
#define TK_MAX_ID (1 << 24)

typedef struct tk_bpe {
  pd_map vocab;     /* model vocabulary: token string -> id (strings in the tokenizer's arena) */
  int32_t max_id;   /* largest vocabulary id */
  pd_map merges;    /* (left id << 32 | right id) -> (rank << 32 | merged id) */
  int32_t unk_id;   /* -1: no unk token (unknown characters are dropped, as in `tokenizers`) */
  bool fuse_unk, byte_fallback, ignore_merges;
  char *prefix; /* continuing_subword_prefix ("" when none) */
  size_t prefix_len;
  char *suffix; /* end_of_word_suffix */
  size_t suffix_len;
  int32_t byte_ids[256]; /* id of "<0xNN>" or -1 */
  int32_t *char_ids;     /* [0x800]: id of the one-character token for code points < 0x800, -1
                            when absent; NULL when prefix/suffix make it unusable */
} tk_bpe;

/* Scratch for merging one word. */
typedef struct tk_bpe_sym {
  int32_t id;
  int32_t prev, next;
  uint32_t len; /* bytes; 0 marks a symbol merged away */
} tk_bpe_sym;
typedef struct tk_bpe_merge {
  uint32_t rank, pos;
  int32_t new_id;
} tk_bpe_merge;
typedef struct tk_bpe_scratch {
  tk_bpe_sym *sym;
  size_t sym_cap;
  tk_bpe_merge *heap;
  size_t heap_cap;
  tk_buf key;
} tk_bpe_scratch;
void tk_bpe_scratch_free(tk_bpe_scratch *s);

typedef struct tk_ids {
  int32_t *v;
  size_t n, cap;
} tk_ids;
bool tk_ids_push(tk_ids *a, int32_t id);

struct pd_tokenizer;
/* Builds vocab and merges from the "model" object; the strings go to t's arena. */
pd_status tk_bpe_load(struct pd_tokenizer *t, const cJSON *model, pd_err *e);
void tk_bpe_free(tk_bpe *b);
/* Appends the ids of one word. */
pd_status tk_bpe_encode(const tk_bpe *b, const char *w, size_t n, tk_bpe_scratch *sc,
                        tk_ids *out, pd_err *e);

/* ---------------------------------------------------------------- decoders ---- */
typedef enum tk_dec_type {
  TK_DEC_REPLACE,
  TK_DEC_BYTEFALLBACK,
  TK_DEC_FUSE,
  TK_DEC_STRIP,
  TK_DEC_BYTELEVEL,
  TK_DEC_METASPACE,
  TK_DEC_JOIN, /* no decoder: tokens joined with " " */
} tk_dec_type;

typedef struct tk_dec {
  tk_dec_type type;
  bool fused; /* the input of this stage is one token (a Fuse or ByteLevel came before) */
  char *pat;  /* Replace: literal pattern (re NULL) */
  size_t pat_len;
  pcre2_code *re;
  char *content; /* Replace content */
  size_t content_len;
  uint32_t strip_cp; /* Strip */
  size_t strip_start, strip_stop;
  char meta[4]; /* Metaspace replacement (UTF-8) */
  int meta_len;
  bool meta_drop_first; /* prepend_scheme != never: drop it in the first token */
} tk_dec;

pd_status tk_dec_parse(const cJSON *j, tk_dec **out, size_t *n, pd_err *e);
void tk_dec_free(tk_dec *v, size_t n);

/* ---------------------------------------------------------------- the tokenizer ---- */
enum { TK_TOK_PRESENT = 1, TK_TOK_ADDED = 2, TK_TOK_SPECIAL = 4 };

typedef struct tk_tok {
  const char *s; /* NUL-terminated, in the arena */
  uint32_t len;
  uint8_t flags;
} tk_tok;

typedef struct tk_added {
  int32_t id;
  const char *s;
  size_t len;
  bool special, single_word, lstrip, rstrip, normalized;
} tk_added;

/* Byte trie over added-token contents for leftmost-longest matching. */
typedef struct tk_trie {
  pd_map edges;    /* (node << 8 | byte) -> child node */
  int32_t *term;   /* node -> index into pd_tokenizer.added, or -1 */
  size_t n_nodes, cap_nodes;
  bool first[256]; /* bytes that start some pattern */
  size_t n_patterns;
} tk_trie;

struct pd_tokenizer {
  tk_arena arena;
  tk_tok *toks; /* [n_toks], indexed by id */
  int32_t n_toks;
  tk_bpe bpe;
  pd_map added_map; /* added-token content -> id */
  tk_added *added;
  size_t n_added;
  tk_trie trie_raw, trie_norm;
  tk_norm *norm;
  size_t n_norm;
  tk_pretok *pt;
  size_t n_pt;
  tk_dec *dec;
  size_t n_dec;
  int32_t *pre_ids, *post_ids; /* added around the text by add_special */
  size_t n_pre, n_post;
  int32_t bos, eos;
  char *bos_str, *eos_str;
  char *chat_src;            /* template source, or NULL */
  pd_chat_template *chat;    /* parsed template, NULL when parsing failed */
  pd_err chat_err;           /* why parsing failed */
};

#endif
