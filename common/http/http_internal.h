/* Shared between the pdhttp sources only: not part of the public API. */
#ifndef PD_HTTP_INTERNAL_H
#define PD_HTTP_INTERNAL_H

#include "http.h"

/* Moves the completed request (after PD_HTTP_PARSE_DONE) out of the parser: *head, *hdrs and
 * *body become the caller's (free() each; any may be NULL), *msg points into them. The parser
 * is reset for the next request. */
void pdh_parser_take(pd_http_parser *p, char **head, pd_http_header **hdrs, char **body,
                     pd_http_request *msg);

/* ASCII case-insensitive equality of a[0, n) and the NUL-terminated b. */
bool pdh_eq_nocase(const char *a, size_t n, const char *b);

/* RFC 9110 token character (method, header name). */
bool pdh_is_tchar(unsigned char c);

#endif
