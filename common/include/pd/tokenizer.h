/* Tokenizers from Hugging Face tokenizer.json: byte-level BPE (GPT-2 / Llama 3 / Qwen2 style,
 * with Split regex pre-tokenizers) and SentencePiece-style BPE with byte fallback (Llama 2),
 * NFC normalization, added/special tokens matched in text, decoding, incremental decoding,
 * and chat templates (tokenizer_config.json "chat_template" or chat_template.jinja). */
#ifndef PD_TOKENIZER_H
#define PD_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pd/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_tokenizer pd_tokenizer;

/* Loads dir/tokenizer.json, plus dir/tokenizer_config.json (special token names, add_bos,
 * chat_template) and dir/chat_template.jinja when present. */
pd_tokenizer *pd_tokenizer_load(const char *dir, pd_err *e);
/* Same, from explicit paths; config_path may be NULL. */
pd_tokenizer *pd_tokenizer_load_files(const char *tokenizer_json, const char *config_path,
                                      pd_err *e);
void pd_tokenizer_free(pd_tokenizer *t);

int pd_tokenizer_vocab_size(const pd_tokenizer *t); /* max id + 1, added tokens included */

/* Encodes UTF-8 text (len bytes). add_special adds the BOS token when the tokenizer's config
 * asks for it (add_bos_token / post-processor). *ids is malloc'ed; the caller frees it.
 * Invalid UTF-8 is PD_EINVAL. */
pd_status pd_tokenizer_encode(const pd_tokenizer *t, const char *text, size_t len,
                              bool add_special, int32_t **ids, size_t *n_ids, pd_err *e);

/* Decodes ids to UTF-8 (malloc'ed, NUL-terminated; *len without the NUL). Invalid byte
 * sequences become U+FFFD. Ids out of range are PD_EINVAL. */
pd_status pd_tokenizer_decode(const pd_tokenizer *t, const int32_t *ids, size_t n_ids,
                              bool skip_special, char **text, size_t *len, pd_err *e);

/* The vocabulary string of id (as in tokenizer.json), or NULL when out of range. */
const char *pd_tokenizer_id_to_token(const pd_tokenizer *t, int32_t id);
/* The id of a vocabulary or added-token string, or -1. */
int32_t pd_tokenizer_token_to_id(const pd_tokenizer *t, const char *token);
bool pd_tokenizer_is_special(const pd_tokenizer *t, int32_t id);
/* From tokenizer_config.json (bos_token / eos_token); -1 when not set. */
int32_t pd_tokenizer_bos_id(const pd_tokenizer *t);
int32_t pd_tokenizer_eos_id(const pd_tokenizer *t);

/* ---- incremental decoding ----
 * Feeds tokens one at a time; returns only text that is final: never a split UTF-8 sequence,
 * and (for byte-level and byte-fallback tokens) bytes are held until they form whole
 * characters. The concatenation of all pushes and the final flush equals
 * pd_tokenizer_decode of all ids. */
typedef struct pd_detok pd_detok;
pd_detok *pd_detok_new(const pd_tokenizer *t, bool skip_special);
void pd_detok_free(pd_detok *d);
/* Appends the new text to *out (a buffer owned by d, valid until the next call), length in
 * *out_len (may be 0). */
pd_status pd_detok_push(pd_detok *d, int32_t id, const char **out, size_t *out_len, pd_err *e);
/* Emits whatever is held back (incomplete bytes become U+FFFD). */
pd_status pd_detok_flush(pd_detok *d, const char **out, size_t *out_len, pd_err *e);

/* ---- chat templates ---- */
typedef struct pd_chat_msg {
  const char *role;
  const char *content;
} pd_chat_msg;

bool pd_tokenizer_has_chat_template(const pd_tokenizer *t);
/* Renders the tokenizer's chat template over msgs (with bos_token / eos_token from the config
 * and add_generation_prompt). *out is malloc'ed. A template that cannot be rendered is
 * PD_EUNSUPPORTED or PD_EINVAL with a message that says why. */
pd_status pd_tokenizer_apply_chat(const pd_tokenizer *t, const pd_chat_msg *msgs, size_t n,
                                  bool add_generation_prompt, char **out, pd_err *e);

#ifdef __cplusplus
}
#endif
#endif
