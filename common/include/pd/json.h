/* Strict JSON for what clients send: RFC 8259 without the leniencies of cJSON_Parse, plus the
 * I-JSON rules (RFC 7493) an API needs, parsed into a cJSON tree (the one JSON tree type of the
 * project; the rest of the code reads requests through cJSON as before).
 *
 * Refused, each with the byte offset and the OpenAI-style path of the value at fault
 * ("max_tokens", "messages.[0].content"; "" for the document itself):
 *   - anything outside the RFC 8259 grammar (single quotes, comments, trailing commas, NaN,
 *     leading zeros, a byte order mark), and any byte after the value but whitespace;
 *   - raw control characters (bytes below 0x20, NUL included) inside strings;
 *   - the escape \u0000: C strings (and so prompts, stop strings, keys) cannot hold U+0000,
 *     which would silently end them early;
 *   - unpaired UTF-16 surrogate escapes (a \ud800 without a \udc00-\udfff after it, or a lone
 *     \udc00);
 *   - invalid UTF-8 anywhere (overlong forms, encoded surrogates, beyond U+10FFFF, cut short);
 *   - the same key twice in one object, at any depth (compared after unescaping: cJSON would
 *     let the first win, so {"max_tokens": 2, "max_tokens": -5} would pass as 2);
 *   - numbers beyond the range of a double (1e400);
 *   - nesting deeper than PD_JSON_MAX_DEPTH.
 *
 * Why not a library: jansson (Debian libjansson) refuses the same inputs but reports a line and
 * column, not which parameter, turns an integer beyond 64 bits into a syntax error of the whole
 * document, and would be a second tree type beside cJSON; json-c and yajl accept duplicate keys
 * or replace lone surrogates. UTF-8 is checked with utf8proc, as in the wire validators.
 *
 * Integers: a double holds integers exactly up to 2^53. An integer literal with more digits
 * (a 64-bit seed) keeps its text in the number item's valuestring (cJSON ignores that field for
 * numbers and frees it with the item), so pd_json_int64 reads it exactly. */
#ifndef PD_JSON_H
#define PD_JSON_H

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_JSON_MAX_DEPTH 128

typedef struct pd_json_error {
  pd_status code;  /* PD_EINVAL: not acceptable JSON; PD_ENOMEM */
  size_t offset;   /* byte offset of the fault in the input */
  char param[128]; /* path of the value at fault ("" for the document), truncated to fit */
  char msg[256];   /* what is wrong, without the offset */
} pd_json_error;

/* Parses s[0, n) (no NUL terminator needed). NULL with err filled when the text is refused or
 * memory runs out. Free the tree with cJSON_Delete. */
cJSON *pd_json_parse(const char *s, size_t n, pd_json_error *err);

/* The exact value of an integer-valued number item. false when item is not a number, has a
 * fraction, or lies outside [INT64_MIN, INT64_MAX]. */
bool pd_json_int64(const cJSON *item, int64_t *out);

#ifdef __cplusplus
}
#endif
#endif
