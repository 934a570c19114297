/* Placeholder until the Jinja-subset interpreter lands (being written now). */
#include <stdlib.h>
#include "pd/chat_template.h"
pd_chat_template *pd_chat_template_parse(const char *src, size_t len, pd_err *e) {
  (void)src; (void)len;
  pd_err_set(e, PD_EUNSUPPORTED, "chat templates are not implemented yet");
  return NULL;
}
void pd_chat_template_free(pd_chat_template *t) { (void)t; }
pd_status pd_chat_template_render(const pd_chat_template *t, const pd_chat_vars *v, char **out, pd_err *e) {
  (void)t; (void)v; *out = NULL;
  return pd_err_set(e, PD_EUNSUPPORTED, "chat templates are not implemented yet");
}
