/* A Jinja2 subset interpreter for Hugging Face chat templates.
 *
 * Supports what published chat templates use: {{ }}, {% %}, {# #}, whitespace control (-),
 * for (with loop.index/index0/first/last/length, else), if/elif/else, set (also ns.attr with
 * namespace()), macros are not required; expressions with literals (string, number, bool,
 * none, list, dict), attribute and item access, slices ([::-1]), + - * / % ~, comparisons,
 * and/or/not, in / not in, is defined / none / string ..., ternary (a if c else b), filters
 * (trim, length, upper, lower, tojson, default, first, last, join, replace, string, items),
 * string methods (startswith, endswith, strip, split, ...), raise_exception(). */
#ifndef PD_CHAT_TEMPLATE_H
#define PD_CHAT_TEMPLATE_H

#include <stdbool.h>
#include <stddef.h>

#include "pd/status.h"
#include "pd/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_chat_template pd_chat_template;

/* Parses the template source. Syntax errors are PD_EINVAL; constructs outside the subset are
 * PD_EUNSUPPORTED; messages give the position. */
pd_chat_template *pd_chat_template_parse(const char *src, size_t len, pd_err *e);
void pd_chat_template_free(pd_chat_template *t);

typedef struct pd_chat_vars {
  const pd_chat_msg *messages;
  size_t n_messages;
  bool add_generation_prompt;
  const char *bos_token; /* may be NULL (renders as "") */
  const char *eos_token; /* may be NULL */
} pd_chat_vars;

/* Renders into a malloc'ed NUL-terminated string. raise_exception() in the template becomes
 * PD_EINVAL with its message. Rendering is bounded (loop iterations, output size). */
pd_status pd_chat_template_render(const pd_chat_template *t, const pd_chat_vars *v, char **out,
                                  pd_err *e);

#ifdef __cplusplus
}
#endif
#endif
