#!/usr/bin/env python3
"""Differential HTTP/1.1 request parsing: pdserve's hand-written parser (common/http/http_parser.c,
through http_parse_dump) against llhttp (Node's parser, through the httptools package) on the
same byte streams.

  test_http_differential.py --dump BUILD/tests/http_parse_dump --repo REPO [--count N] [--seed S]

Inputs: every hand-written request of tests/unit/test_http_parser.c (its C string literals), the
http fuzz corpus (tests/fuzz/corpus/http), a table of request-smuggling shapes (Content-Length
with Transfer-Encoding, duplicate or conflicting Content-Length, obs-fold, bare CR and LF,
chunk-size overflow, chunk extensions, trailers, invalid field names and values, absolute-form
targets, HTTP/1.0 keep-alive, pipelining), requests generated from parts, and mutations of all
of these (seeded: the same inputs every run). Each input is one connection's bytes: requests
are taken one after another as the server does, until the bytes end, an error, or a request
that does not keep the connection alive.

Both parsers must agree on accept/reject and, for every request they both parse, on method,
target, version, header fields (names and values; llhttp keeps a value's trailing whitespace,
which RFC 9110 5.5 says is not part of it, so it is stripped before comparing), body (after
de-chunking), chunked framing and keep-alive. Where they disagree RFC 9112 (and RFC 9110)
decides: each known disagreement is in ALLOWED below with the section that settles it, and
pdserve must be the one that follows the RFC. A rule matches on what the input is, read from its
bytes by the RFC's grammar (a parser's error message only says which rule to try), so a pdserve
bug that refused a valid request is not excused by its own message. Any other disagreement fails
the test, printing the input. The test also fails when an ALLOWED rule never matched (a stale
entry), and when httptools is missing (pip install -r tests/integration/requirements.txt).
"""
import argparse
import json
import os
import random
import re
import struct
import subprocess
import sys

try:
    import httptools
except ImportError:
    print("test_http_differential: the httptools package is missing "
          "(pip install -r tests/integration/requirements.txt)")
    sys.exit(1)

# ---- llhttp ----------------------------------------------------------------------------------


class _Collector:
    def __init__(self):
        self.reqs, self.cur, self.in_trailers, self.parser = [], None, False, None

    def on_message_begin(self):
        self.cur = {"url": b"", "headers": [], "trailers": [], "body": b"", "chunks": 0}
        self.in_trailers = False

    def on_url(self, url):
        self.cur["url"] += url

    def on_header(self, name, value):
        self.cur["trailers" if self.in_trailers else "headers"].append((name, value))

    def on_headers_complete(self):
        self.in_trailers = True
        self.cur["method"] = self.parser.get_method()
        self.cur["version"] = self.parser.get_http_version()
        self.cur["keep_alive"] = self.parser.should_keep_alive()

    def on_body(self, body):
        self.cur["body"] += body

    def on_chunk_header(self):
        self.cur["chunks"] += 1

    def on_message_complete(self):
        self.reqs.append(self.cur)
        self.cur = None


def llhttp_parse(data):
    """{"requests": [...], "end": "done" | "more" | "error" | "close" | "upgrade", "error"}"""
    c = _Collector()
    p = httptools.HttpRequestParser(c)
    c.parser = p
    out = {"requests": c.reqs, "end": "done", "error": ""}
    try:
        p.feed_data(data)
        if c.cur is not None:
            out["end"] = "more"
    except httptools.HttpParserUpgrade:
        out["end"] = "upgrade"
        if c.cur is not None and "method" in c.cur:
            c.reqs.append(c.cur)  # headers of the upgrade request
    except httptools.HttpParserError as e:
        msg = str(e)
        out["end"] = "close" if "Data after `Connection: close`" in msg else "error"
        out["error"] = "%s: %s" % (type(e).__name__, msg)
    return out


# ---- pdserve ----------------------------------------------------------------------------------


def pd_parse_all(dump, inputs):
    """Runs http_parse_dump once over every input; returns its results in order."""
    blob = b"".join(struct.pack("<I", len(d)) + d for d in inputs)
    r = subprocess.run([dump], input=blob, capture_output=True, timeout=120)
    if r.returncode != 0:
        raise RuntimeError("http_parse_dump failed (%d): %s" % (r.returncode, r.stderr[-2000:]))
    lines = r.stdout.decode("ascii").splitlines()
    if len(lines) != len(inputs):
        raise RuntimeError("http_parse_dump printed %d results for %d inputs"
                           % (len(lines), len(inputs)))

    def raw(s):  # the dump writes bytes as \u00XX
        return s.encode("latin-1")

    out = []
    for line in lines:
        j = json.loads(line)
        for q in j["requests"]:
            for k in ("method", "target", "path", "query", "body"):
                q[k] = raw(q[k])
            q["headers"] = [(raw(n), raw(v)) for n, v in q["headers"]]
        j["error"] = j.get("error", "")
        out.append(j)
    return out


# ---- comparison ---------------------------------------------------------------------------------

OWS = b" \t"


def first_difference(data, pd, ll):
    """None when both parsers read data the same way, else what differs (a short string)."""
    pd_end, ll_end = pd["end"], ll["end"]
    used = sum(q["consumed"] for q in pd["requests"])
    if pd_end in ("more", "close") and not data[used:].strip(b"\r\n"):
        pd_end = "done"  # blank lines after the last request: llhttp skips them too
    n = min(len(pd["requests"]), len(ll["requests"]))
    for i in range(n):
        a, b = pd["requests"][i], ll["requests"][i]
        if a["method"] != b["method"]:
            return "request %d: method %r / %r" % (i, a["method"], b["method"])
        if a["target"] != b["url"]:
            return "request %d: target %r / %r" % (i, a["target"], b["url"])
        if b["version"] != "1.%d" % a["minor"]:
            return "request %d: version 1.%d / %s" % (i, a["minor"], b["version"])
        bh = [(k, v.strip(OWS)) for k, v in b["headers"]]
        if a["headers"] != bh:
            return "request %d: headers %r / %r" % (i, a["headers"], bh)
        if ll["end"] == "upgrade" and i == len(ll["requests"]) - 1:
            break  # llhttp hands the rest of the connection over: no body, no end
        if a["body"] != b["body"]:
            return "request %d: body %r / %r" % (i, a["body"][:80], b["body"][:80])
        if a["chunked"] != (b["chunks"] > 0):
            return "request %d: chunked %s / %s" % (i, a["chunked"], b["chunks"] > 0)
        if a["keep_alive"] != b["keep_alive"]:
            return "request %d: keep-alive %s / %s" % (i, a["keep_alive"], b["keep_alive"])
    if ll_end == "upgrade":
        return "upgrade: llhttp hands the connection over after request %d" % (n - 1)
    if len(pd["requests"]) != len(ll["requests"]):
        return "requests %d / %d (ends %s / %s)" % (len(pd["requests"]), len(ll["requests"]),
                                                     pd_end, ll_end)
    if (pd_end == "error") != (ll_end == "error"):
        return "end %s %s / %s %s" % (pd_end, pd.get("status", ""), ll_end, ll["error"])
    if pd_end != "error" and pd_end != ll_end:
        return "end %s / %s" % (pd_end, ll_end)
    return None


# ---- what an input is, by RFC 9112 / 9110, read from the bytes --------------------------------
# An ALLOWED rule never rests on a parser's word alone: an error message says which rule may
# apply, and these readings of the input itself say whether it really is what the rule is about
# (no Host field, a character outside RFC 3986, a chunk line outside RFC 9112 7.1.1, ...). So a
# pdserve bug that refused a valid request with one of those messages fails the test.

BODY_LIMIT = 8 << 20  # pd_http_config_default: max_body_bytes
TOKEN = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
QUOTED = rb'"(?:[\t \x21\x23-\x5b\x5d-\x7e\x80-\xff]|\\[\t \x21-\x7e\x80-\xff])*"'
BWS = rb"[ \t]*"
CHUNK_EXT = (rb"(?:" + BWS + rb";" + BWS + TOKEN + rb"(?:" + BWS + rb"=" + BWS + rb"(?:" +
             TOKEN + rb"|" + QUOTED + rb"))?)*")
CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]+)(" + CHUNK_EXT + rb")\r\n")  # RFC 9112 7.1
REQUEST_LINE = re.compile(TOKEN + rb" [^ ]+ HTTP/[0-9]\.[0-9]")  # RFC 9112 3
URI_CHARS = re.compile(rb"(?:[A-Za-z0-9._~!$&'()*+,;=:@/?-]|%[0-9A-Fa-f]{2})*")  # RFC 3986
ABSOLUTE = re.compile(rb"[A-Za-z][A-Za-z0-9+.-]*://([^/?]*)")
IP_LITERAL = re.compile(rb"(?:[^@]*@)?\[[0-9A-Za-z.:~!$&'()*+,;=_-]+\](?::[0-9]*)?")


class Head:
    """The head of the request at data[off:], as RFC 9112 2.1 and 5 split it: before (the empty
    lines in front of it and its first byte), the request line and its three parts, the field
    lines (lower-case name, value without OWS) up to the first CRLF CRLF or the end of the
    input, and body_at, the offset after that CRLF CRLF."""

    def __init__(self, data, off):
        rest = data[off:]
        start = off + len(rest) - len(rest.lstrip(b"\r\n"))
        self.before = data[off:start + 1]
        end = data.find(b"\r\n\r\n", start)
        if end < 0:
            end = len(data)
        self.raw = data[start:end]
        lines = self.raw.split(b"\r\n")
        self.line = lines[0]
        parts = self.line.split(b" ")
        self.method = parts[0]
        self.target = parts[1] if len(parts) > 1 else b""
        self.version = parts[-1] if len(parts) > 2 else b""
        self.fields = [(n.lower(), v.strip(OWS))
                       for n, _, v in (x.partition(b":") for x in lines[1:])]
        self.body_at = end + 4

    def values(self, name):
        return [v for n, v in self.fields if n == name]

    def elements(self, name):
        """A list-valued field's elements (RFC 9110 5.6.1), lower case, empty ones dropped."""
        return [e.strip(OWS).lower() for v in self.values(name) for e in v.split(b",")
                if e.strip(OWS)]


def head_at(data, pd, k):
    """The k-th request's head, where pdserve's split of the stream puts it (the requests
    before it were compared alike with llhttp)."""
    return Head(data, sum(q["consumed"] for q in pd["requests"][:k]))


def target_chars_ok(t):
    """RFC 3986 characters only, with '[' ']' only around an IP literal in the authority of an
    absolute URI."""
    m = ABSOLUTE.match(t)
    if m and re.search(rb"[\[\]]", m.group(1)):
        if not IP_LITERAL.fullmatch(m.group(1)):
            return False
        t = t[:m.start(1)] + re.sub(rb"[\[\]]", b"", m.group(1)) + t[m.end(1):]
    return URI_CHARS.fullmatch(t) is not None


def target_form_ok(method, t):
    """RFC 9112 3.2 as pdserve serves it: origin-form, absolute-form (http or https), or
    asterisk-form with OPTIONS."""
    return t.startswith(b"/") or re.match(rb"(?i)https?://", t) is not None or (
        t == b"*" and method == b"OPTIONS")


class Chunked:
    """A chunked body read from data[at:] by RFC 9112 7.1: body (the chunk data), how it ends
    ("done": last chunk and trailer section read; "more": the bytes end first; "bad": a chunk
    line outside the grammar, or chunk data without its CRLF), exts (each chunk line's
    extensions) and totals (the running sum of the declared chunk sizes)."""

    def __init__(self, data, at):
        self.body, self.exts, self.totals, self.how = b"", [], [], "more"
        pos = at
        while pos < len(data):
            m = CHUNK_LINE.match(data, pos)
            if not m:
                self.how = "bad" if b"\r\n" in data[pos:] else "more"
                return
            size = int(m.group(1), 16)
            self.exts.append(m.group(2))
            self.totals.append((self.totals[-1] if self.totals else 0) + size)
            pos = m.end()
            if size == 0:
                self.how = "done" if data.find(b"\r\n\r\n", pos - 2) >= 0 else "more"
                return
            self.body += data[pos:pos + size]
            if len(data) < pos + size + 2:
                return
            if data[pos + size:pos + size + 2] != b"\r\n":
                self.how = "bad"
                return
            pos += size + 2


# ---- where llhttp and pdserve may differ: RFC 9112 / 9110 decides ----------------------------

LLHTTP_METHODS = {
    b"DELETE", b"GET", b"HEAD", b"POST", b"PUT", b"CONNECT", b"OPTIONS", b"TRACE", b"COPY",
    b"LOCK", b"MKCOL", b"MOVE", b"PROPFIND", b"PROPPATCH", b"SEARCH", b"UNLOCK", b"BIND",
    b"REBIND", b"UNBIND", b"ACL", b"REPORT", b"MKACTIVITY", b"CHECKOUT", b"MERGE", b"M-SEARCH",
    b"NOTIFY", b"SUBSCRIBE", b"UNSUBSCRIBE", b"PATCH", b"PURGE", b"MKCALENDAR", b"LINK",
    b"UNLINK", b"SOURCE", b"QUERY"}


def _pd_error(pd, *parts):
    return pd["end"] == "error" and any(p in pd["error"] for p in parts)


def _ll_error(ll, *parts):
    return ll["end"] == "error" and any(p in ll["error"] for p in parts)


def _pd_took(c):
    """pdserve took the request llhttp refused (or is still reading it: no error)."""
    return len(c.pd["requests"]) > c.k or c.pd["end"] != "error"


def _keep_alive_differs(c):
    """Request i (from the difference) is HTTP/1.0 with both close and keep-alive in
    Connection."""
    m = re.match(r"request (\d+): keep-alive False / True", c.diff)
    if not m:
        return False
    h = head_at(c.data, c.pd, int(m.group(1)))
    return h.version == b"HTTP/1.0" and {b"close", b"keep-alive"} <= set(h.elements(b"connection"))


def _bws_only(c):
    """Request k's chunked body is valid by RFC 9112 7.1.1, has BWS in a chunk extension, and
    pdserve read it as that grammar does."""
    ch = Chunked(c.data, c.ll_head.body_at)
    if ch.how == "bad" or not any(re.search(rb"[ \t]", e) for e in ch.exts):
        return False
    return len(c.pd["requests"]) <= c.k or c.pd["requests"][c.k]["body"] == ch.body


def _body_over_limit(h, data):
    cls = [int(v) for v in h.values(b"content-length") if v.isdigit()]
    if h.elements(b"transfer-encoding"):
        return any(t > BODY_LIMIT for t in Chunked(data, h.body_at).totals)
    return any(v > BODY_LIMIT for v in cls)


# Each: (key, the RFC section and why pdserve is right, predicate(c)) where c holds data, pd,
# ll, diff (what differs first), k (the first request llhttp did not complete) with ll_head
# (its head), and pd_head (the head of the first request pdserve did not complete). Rules are
# tried in order; each reads the input (above) for what it is about.
ALLOWED = [
    ("method-extension",
     "RFC 9110 9.1: a method is any token (case-sensitive) and the set is extensible; pdserve "
     "parses it and the router answers 404/405, llhttp refuses methods outside its table",
     lambda c: c.ll["error"].startswith("HttpParserInvalidMethodError") and
     re.match(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,32} ", c.ll_head.line) is not None and
     c.ll_head.method not in LLHTTP_METHODS),
    ("http-1x-minor",
     "RFC 9110 2.5 and 6.2: a recipient of HTTP/1.x with a higher minor version than it "
     "implements treats it as its highest (1.1); llhttp refuses versions it does not know",
     lambda c: _ll_error(c.ll, "Invalid HTTP version") and
     re.search(rb" HTTP/1\.[2-9]$", c.ll_head.line) is not None),
    ("http10-close-wins",
     "RFC 9112 9.3: with the close option the connection does not persist, whatever else "
     "Connection says; llhttp keeps an HTTP/1.0 connection alive when keep-alive is there too",
     _keep_alive_differs),
    ("host-required",
     "RFC 9112 3.2: a server MUST respond 400 to an HTTP/1.1 request without a Host field and "
     "to any request with more than one; llhttp does not look at Host",
     lambda c: _pd_error(c.pd, "requires exactly one Host header") and (
         len(c.pd_head.values(b"host")) > 1 or (
             not c.pd_head.values(b"host") and
             re.fullmatch(rb"HTTP/1\.[1-9]", c.pd_head.version) is not None))),
    ("te-in-http10",
     "RFC 9112 6.1: Transfer-Encoding in an HTTP/1.0 message MUST be treated as faulty "
     "framing; pdserve refuses it (400), llhttp de-chunks it",
     lambda c: _pd_error(c.pd, "Transfer-Encoding in an HTTP/1.0 request") and
     c.pd_head.version == b"HTTP/1.0" and c.pd_head.values(b"transfer-encoding") != []),
    ("te-unknown-coding",
     "RFC 9112 6.1: a server that receives a transfer coding it does not understand SHOULD "
     "answer 501; pdserve knows only chunked, llhttp passes gzip/deflate bodies through coded",
     lambda c: _pd_error(c.pd, "unsupported transfer coding") and
     any(e != b"chunked" for e in c.pd_head.elements(b"transfer-encoding"))),
    ("te-empty-list-element",
     "RFC 9110 5.6.1: a recipient MUST accept and ignore empty list elements, so "
     "\"chunked,\" is the list (chunked); llhttp takes a trailing comma for a coding after "
     "chunked",
     lambda c: _ll_error(c.ll, "Invalid `Transfer-Encoding` header value") and _pd_took(c) and
     c.ll_head.elements(b"transfer-encoding") == [b"chunked"] and
     any(not e.strip(OWS) for v in c.ll_head.values(b"transfer-encoding")
         for e in v.split(b","))),
    ("expect-unsupported",
     "RFC 9110 10.1.1: a server MAY answer 417 to an expectation other than 100-continue; "
     "llhttp does not look at Expect",
     lambda c: _pd_error(c.pd, "unsupported expectation") and
     any(v.lower() != b"100-continue" for v in c.pd_head.values(b"expect"))),
    ("http-major-version",
     "RFC 9110 15.6.6: 505 for a major version the server does not support; llhttp parses "
     "HTTP/2.0 (and 0.9) request lines as HTTP/1",
     lambda c: _pd_error(c.pd, "only HTTP/1.x is supported") and
     re.fullmatch(rb"HTTP/[02-9]\.[0-9]", c.pd_head.version) is not None),
    ("request-line-grammar",
     "RFC 9112 3: request-line = method SP request-target SP HTTP-version, the version "
     "required (no HTTP/0.9 simple requests); a recipient MAY parse other whitespace but need "
     "not: pdserve refuses, llhttp takes extra spaces and lines without a version",
     lambda c: _pd_error(c.pd, "malformed request line", "malformed HTTP version") and
     REQUEST_LINE.fullmatch(c.pd_head.line) is None),
    ("duplicate-equal-content-length",
     "RFC 9110 8.6: a recipient MAY accept repeated Content-Length fields with one value as one; "
     "pdserve does, llhttp refuses any repeat; differing values are refused by both",
     lambda c: _ll_error(c.ll, "Duplicate Content-Length") and _pd_took(c) and
     len(c.ll_head.values(b"content-length")) > 1 and
     len(set(c.ll_head.values(b"content-length"))) == 1),
    ("trailer-framing-field",
     "RFC 9110 6.5.1: a trailer field is never merged into the header section, so a "
     "Content-Length or Transfer-Encoding there frames nothing; pdserve discards trailers, "
     "llhttp checks them as if they were header fields",
     lambda c: _ll_error(c.ll, "Content-Length", "Transfer-Encoding") and _pd_took(c) and
     not c.ll_head.values(b"content-length") and
     re.search(rb"\r\n0(?:;[^\r\n]*)?\r\n(?:[^\r\n]+\r\n)*?"
               rb"(?:Content-Length|Transfer-Encoding)[ \t]*:", c.data, re.I) is not None),
    ("target-characters",
     "RFC 9112 3.2 and 3 with RFC 3986: a request-target holds unreserved, sub-delims, ':', '@', "
     "'/', '?' and pct-encoded octets ('[' ']' in an IP literal), and an invalid request-line "
     "gets 400; llhttp takes '{', '|', '\"', '#', '%zz' and others",
     lambda c: _pd_error(c.pd, "invalid character in request target",
                         "invalid percent-encoding in request target") and
     not target_chars_ok(c.pd_head.target)),
    ("bare-lf",
     "RFC 9112 2.2: a recipient MAY take a bare LF for a line end, and need not; pdserve refuses "
     "it anywhere in a head (parsers that disagree on line ends disagree on fields), llhttp "
     "takes it after an HTTP/0.9-style request line",
     lambda c: _pd_error(c.pd, "bare LF in request head") and
     re.search(rb"(?<!\r)\n", c.pd_head.raw) is not None),
    ("chunk-extension-bws",
     "RFC 9112 7.1.1 and RFC 9110 5.6.3: chunk-ext has BWS around ';' and '=', which a "
     "recipient MUST parse and remove; llhttp refuses whitespace there",
     lambda c: _ll_error(c.ll, "chunk size", "chunk extensions") and _pd_took(c) and
     _bws_only(c)),
    ("chunk-extension-grammar",
     "RFC 9112 7.1.1: chunk-ext-name is a token (one or more tchar) and chunk-ext-val a token "
     "or a quoted-string; llhttp accepts an empty name (\"1;=x\") and some other shapes",
     lambda c: _pd_error(c.pd, "malformed chunk extension") and
     Chunked(c.data, c.pd_head.body_at).how == "bad"),
    ("target-form",
     "RFC 9112 3.2: a request-target is origin-form, absolute-form (pdserve: http and https "
     "URIs), authority-form (CONNECT only, which an origin server need not support) or "
     "asterisk-form (OPTIONS only, 3.2.4); llhttp takes any scheme and '*' with any method",
     lambda c: _pd_error(c.pd, "unsupported request target form",
                         "'*' target is only for OPTIONS") and
     not target_form_ok(c.pd_head.method, c.pd_head.target)),
    ("upgrade",
     "RFC 9110 7.8: a server MAY ignore Upgrade; pdserve serves the request as it is, llhttp "
     "stops parsing there (and CONNECT is a tunnel to it)",
     lambda c: c.diff.startswith("upgrade")),
    ("body-limit",
     "RFC 9110 15.5.14: 413 for a body over the server's limit (8 MiB by default), decided "
     "from Content-Length or the chunk sizes before the bytes arrive",
     lambda c: _pd_error(c.pd, "request body too large") and
     _body_over_limit(c.pd_head, c.data)),
    ("bare-cr-before-request-line",
     "RFC 9112 2.2: a bare CR makes its element invalid; only empty lines (CRLF, or LF) may "
     "come before a request line, and llhttp skips a lone CR too",
     lambda c: _pd_error(c.pd, "bare CR before the request line") and
     re.search(rb"\r(?=[^\n])", c.pd_head.before) is not None),
    ("reject-timing",
     "RFC 9112 is silent on when: llhttp refuses a bad byte of a head as it arrives, pdserve "
     "(but for the method) once the head is complete, or the other way round for a bare LF; "
     "completed with CRLF CRLF, both refuse the input",
     lambda c: c.completed is not None and c.completed[0]["end"] == "error" and
     c.completed[1]["end"] == "error"),
]


class Case:
    def __init__(self, data, pd, ll, diff, completed=None):
        self.data, self.pd, self.ll, self.diff = data, pd, ll, diff
        self.k = len(ll["requests"])
        self.ll_head = head_at(data, pd, self.k)
        self.pd_head = head_at(data, pd, len(pd["requests"]))
        self.completed = completed  # (pd, ll) of data + CRLF CRLF, for reject-timing


def classify(case):
    for key, _why, pred in ALLOWED:
        try:
            if pred(case):
                return key
        except (KeyError, IndexError, ValueError):
            pass
    return None


# ---- inputs -------------------------------------------------------------------------------------

def c_string_literals(path):
    """The requests written as C string literals in a C file (adjacent literals joined)."""
    src = open(path, encoding="utf-8").read()
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    out = []
    for m in re.finditer(r'(?:"(?:[^"\\\n]|\\.)*"\s*)+', src):
        parts = re.findall(r'"((?:[^"\\\n]|\\.)*)"', m.group(0))
        raw = "".join(parts)
        b = bytearray()
        i = 0
        while i < len(raw):
            ch = raw[i]
            if ch != "\\":
                b += ch.encode("utf-8")
                i += 1
                continue
            nx = raw[i + 1]
            if nx == "x":
                j = i + 2
                while j < len(raw) and raw[j] in "0123456789abcdefABCDEF":
                    j += 1
                b.append(int(raw[i + 2:j], 16) & 0xff)
                i = j
            elif nx in "01234567":
                j = i + 1
                while j < len(raw) and j < i + 4 and raw[j] in "01234567":
                    j += 1
                b.append(int(raw[i + 1:j], 8) & 0xff)
                i = j
            else:
                b += {"n": b"\n", "r": b"\r", "t": b"\t", "0": b"\0", "\\": b"\\", '"': b'"',
                      "'": b"'", "?": b"?"}.get(nx, nx.encode())
                i += 2
        b = bytes(b)
        if b" HTTP/" in b or b"HTTP/1" in b:
            out.append(b)
    return out


SMUGGLING = [
    # Content-Length and Transfer-Encoding together, in both orders, and variants of each
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 6\r\n\r\n"
    b"0\r\n\r\nX",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding:\tchunked\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked \r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: \x0bchunked\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: identity"
    b"\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: identity, chunked\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: CHUNKED\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: ,chunked\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
    # duplicate or conflicting Content-Length
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc",
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3, 3\r\n\r\nabc",
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3,4\r\n\r\nabcd",
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +3\r\n\r\nabc",
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0x3\r\n\r\nabc",
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3 3\r\n\r\nabc",
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 003\r\n\r\nabc",
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 18446744073709551616\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length:\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length : 3\r\n\r\nabc",
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabcGET / HTTP/1.1\r\nHost: a\r\n\r\n",
    # obs-fold, whitespace before the first field and before colons
    b"GET / HTTP/1.1\r\nHost: a\r\nX: a\r\n b\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX: a\r\n\tb\r\n\r\n",
    b"GET / HTTP/1.1\r\n Host: a\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n 0\r\n\r\nx",
    b"GET / HTTP/1.1\r\nHost\t: a\r\n\r\n",
    # bare CR and LF
    b"GET / HTTP/1.1\nHost: a\n\n",
    b"GET / HTTP/1.1\r\nHost: a\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\n\n",
    b"GET / HTTP/1.1\rHost: a\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\rX: b\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\n\r\r\n",
    b"GET /\r HTTP/1.1\r\nHost: a\r\n\r\n",
    b"\rGET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\nx\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\n\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\n",
    # chunk sizes: overflow, leading zeros, signs, whitespace
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"fffffffffffffffff\r\nx\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"10000000000000001\r\nx\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"00000000000000000000001\r\nx\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\nx\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0x1\r\nx\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n 1\r\nx\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1 \r\nx\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nxy\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nx\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n800001\r\n",
    # chunk extensions
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"1;a=b;c;d=\"e f\"\r\nx\r\n0;last\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1 ; a = b\r\nx\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1;a=\"\\\"\"\r\nx\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1;a=\"\r\nx\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1;a\x00\r\nx\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1;\r\nx\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1;a=b\rc\r\nx\r\n0\r\n\r\n",
    # trailers
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n"
    b"Trailer-A: 1\r\nTrailer-B:2\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n"
    b"Content-Length: 5\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n"
    b"Bad Name: 1\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n"
    b"A: 1\r\n b\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n"
    b"A: \x01\r\n\r\n",
    # invalid field names and values
    b"GET / HTTP/1.1\r\nHost: a\r\nX@Y: 1\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\n: 1\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX\x00: 1\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX: 1\x00\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX: 1\x7f\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX: caf\xc3\xa9 \x80\xff\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX: \t v \t\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX:\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX-\xc3\xa9: 1\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nNoColon\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nX:: 1\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\n!#$%&'*+-.^_`|~0aZ: 1\r\n\r\n",
    # targets and versions
    b"GET http://example.com/a?b=c HTTP/1.1\r\nHost: example.com\r\n\r\n",
    b"GET https://example.com HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET HTTP://EXAMPLE.COM:8000/p HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET ftp://example.com/a HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET example.com:80 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
    b"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET * HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET /a?b?c=d%20e&f HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET //a//b HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET /\xc3\xa9 HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET / HTTP/1.1 \r\nHost: a\r\n\r\n",
    b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET / HTTP/1.01\r\nHost: a\r\n\r\n",
    b"GET / HTTP/1.2\r\nHost: a\r\n\r\n",
    b"GET / HTTP/2.0\r\nHost: a\r\n\r\n",
    b"GET / HTTP/0.9\r\nHost: a\r\n\r\n",
    b"GET / http/1.1\r\nHost: a\r\n\r\n",
    b"GET /\r\n\r\n",
    b"get / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"PURGE / HTTP/1.1\r\nHost: a\r\n\r\n",
    b"BREW / HTTP/1.1\r\nHost: a\r\n\r\n",
    # Host
    b"GET / HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    b"GET / HTTP/1.0\r\n\r\n",
    # HTTP/1.0 keep-alive and Connection
    b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /2 HTTP/1.0\r\n\r\nGET /3 HTTP/1.0\r\n\r\n",
    b"GET / HTTP/1.0\r\nConnection: Keep-Alive, Close\r\n\r\nGET /2 HTTP/1.0\r\n\r\n",
    b"GET / HTTP/1.0\r\nConnection: foo\r\nConnection: keep-alive\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\nGET /2 HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nConnection: keep-alive\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nConnection: x,close\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nConnection: closed\r\n\r\n",
    # Expect
    b"POST / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\nx",
    b"POST / HTTP/1.1\r\nHost: a\r\nExpect: 200-ok\r\nContent-Length: 1\r\n\r\nx",
    # pipelining
    b"GET /1 HTTP/1.1\r\nHost: a\r\n\r\nPOST /2 HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nab"
    b"POST /3 HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\ncd\r\n0\r\n\r\n"
    b"\r\nGET /4 HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET /1 HTTP/1.1\r\nHost: a\r\n\r\nGET /2 HTTP/1.1\r\nHost: a\r\n\r\nGARBAGE\r\n\r\n",
    b"GET /1 HTTP/1.1\r\nHost: a\r\n\r\nGET /2 HTTP/1.1\r\nHost: a\r\n",
    b"GET / HTTP/1.1\r\nHost: a\r\nUpgrade: h2c\r\nConnection: Upgrade, HTTP2-Settings\r\n\r\n",
    # one witness at least for each ALLOWED rule not shown above
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked,\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n1;=b\r\nx\r\n0\r\n\r\n",
    b"GET /a{b}|c HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET /a%zz HTTP/1.1\r\nHost: a\r\n\r\n",
    b"GET http://h\\/x HTTP/1.1\r\nHost: a\r\n\r\n",
    b"OPTIONS /P/1.0\nContent-Length: 11\r\nHost: a\r\n\r\nhello world",
    b"PUT / HTTP/.1",
]

METHODS = [b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"OPTIONS", b"PATCH", b"get", b"FOO",
           b"M-SEARCH", b"G\xc3T"]
TARGETS = [b"/", b"/v1/chat/completions", b"/a?b=c&d=%20", b"/%zz", b"*", b"http://h/x?y",
           b"https://h", b"h:1", b"/a b", b"/a\tb", b"/\x7f", b"/{x}", b"/#f", b"", b"/a%00b"]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/1.2", b"HTTP/2.0", b"HTTP/1.1 ", b"HTTP/1", b"HTTP/11",
            b"HTTPS/1.1"]
FIELDS = [b"Host: a", b"Host: a:8000", b"Host:", b"Host: b", b"Connection: close",
          b"Connection: keep-alive", b"Connection: upgrade", b"Content-Length: 5",
          b"Content-Length: 0", b"Content-Length: 5", b"Content-Length: 7", b"Content-Length: x",
          b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip, chunked",
          b"Transfer-Encoding: chunked, gzip", b"Expect: 100-continue", b"Expect: x",
          b"X-A: b", b"X-A:  b  ", b"X-A:", b" X-A: b", b"X-A : b", b"X-A: b\x01", b"X-A: \x80",
          b"Accept: */*", b"User-Agent: t/1", b"Trailer: X-T", b"Upgrade: websocket"]
BODIES_CHUNKED = [b"5\r\nhello\r\n0\r\n\r\n", b"0\r\n\r\n", b"2;x=y\r\nhi\r\n0\r\nX-T: 1\r\n\r\n",
                  b"2 \r\nhi\r\n0\r\n\r\n", b"2\r\nhi\r\n", b"g\r\n", b"2\r\nhi\r\n0\r\n",
                  b"1;a=\"b\"\r\nx\r\n0;c\r\nT: u\r\nU: v\r\n\r\n"]
BODIES_CL = [b"", b"hello", b"hello world", b"hel"]


def generated(rng, n):
    out = []
    for _ in range(n):
        reqs = []
        for _ in range(1 + (rng.random() < 0.3) + (rng.random() < 0.1)):
            line = b" ".join([rng.choice(METHODS[:7]) if rng.random() < 0.8 else
                              rng.choice(METHODS), rng.choice(TARGETS[:7]) if rng.random() < 0.8
                              else rng.choice(TARGETS), rng.choice(VERSIONS[:2])
                              if rng.random() < 0.85 else rng.choice(VERSIONS)])
            fields = [b"Host: a"] if rng.random() < 0.85 else []
            fields += rng.sample(FIELDS, rng.randrange(0, 4))
            chunked = any(f.startswith(b"Transfer-Encoding") for f in fields)
            body = rng.choice(BODIES_CHUNKED) if chunked else rng.choice(BODIES_CL)
            if not chunked and body and rng.random() < 0.7 and \
                    not any(f.startswith(b"Content-Length") for f in fields):
                fields.append(b"Content-Length: %d" % len(body))
            rng.shuffle(fields)
            reqs.append(line + b"\r\n" + b"".join(f + b"\r\n" for f in fields) + b"\r\n" + body)
        out.append(b"".join(reqs))
    return out


INTERESTING = [b"\r", b"\n", b"\r\n", b" ", b"\t", b":", b";", b",", b"=", b"\"", b"\\", b"\x00",
               b"\x7f", b"\xff", b"0", b"f", b"-", b"chunked", b"Content-Length: 1\r\n",
               b"Transfer-Encoding: chunked\r\n", b"\r\n\r\n", b"HTTP/1.1", b"1.0"]


def mutate(rng, data):
    d = bytearray(data)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(6)
        at = rng.randrange(len(d) + 1)
        if op == 0 and d:
            d[min(at, len(d) - 1)] = rng.randrange(256)
        elif op == 1:
            d[at:at] = rng.choice(INTERESTING)
        elif op == 2 and d:
            del d[at:at + rng.randrange(1, 6)]
        elif op == 3 and d:
            n = rng.randrange(1, 16)
            d[at:at] = d[at:at + n]
        elif op == 4 and d:
            d = d[:at]
        else:
            d[at:at] = rng.choice(SMUGGLING)
    return bytes(d)


def corpus_inputs(repo):
    d = os.path.join(repo, "tests", "fuzz", "corpus", "http")
    out = []
    if os.path.isdir(d):
        for name in sorted(os.listdir(d)):
            with open(os.path.join(d, name), "rb") as f:
                out.append(f.read()[2:])  # the fuzz target's two control bytes
    return out


# ---- main ---------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True)
    ap.add_argument("--repo", required=True)
    ap.add_argument("--count", type=int, default=100000, help="generated and mutated inputs")
    ap.add_argument("--seed", type=int, default=30)
    a = ap.parse_args()
    rng = random.Random(a.seed)

    hand = c_string_literals(os.path.join(a.repo, "tests", "unit", "test_http_parser.c"))
    base = hand + SMUGGLING + corpus_inputs(a.repo)
    gen = generated(rng, a.count // 2)
    mutated = [mutate(rng, rng.choice(base + gen)) for _ in range(a.count - len(gen))]
    inputs = base + gen + mutated
    kinds = (["hand-written"] * len(hand) + ["smuggling"] * len(SMUGGLING) +
             ["fuzz corpus"] * (len(base) - len(hand) - len(SMUGGLING)) +
             ["generated"] * len(gen) + ["mutated"] * len(mutated))

    pd_all = pd_parse_all(a.dump, inputs)
    allowed_hits = {key: 0 for key, _, _ in ALLOWED}
    failures, pending = [], []
    agree = accepted = 0
    for data, kind, pd in zip(inputs, kinds, pd_all):
        ll = llhttp_parse(data)
        diff = first_difference(data, pd, ll)
        if diff is None:
            agree += 1
            accepted += pd["end"] != "error"
            continue
        key = classify(Case(data, pd, ll, diff))
        if key:
            allowed_hits[key] += 1
        elif "more" in (pd["end"], ll["end"]) and "error" in (pd["end"], ll["end"]):
            pending.append((kind, data, diff, pd, ll))  # one refused, the other still reading
        else:
            failures.append((kind, data, diff, pd, ll))
    # Inputs one parser refused while the other waited for more: completed with CRLF CRLF
    done = pd_parse_all(a.dump, [p[1] + b"\r\n\r\n" for p in pending]) if pending else []
    for (kind, data, diff, pd, ll), pd2 in zip(pending, done):
        key = classify(Case(data, pd, ll, diff, (pd2, llhttp_parse(data + b"\r\n\r\n"))))
        if key:
            allowed_hits[key] += 1
        else:
            failures.append((kind, data, diff, pd, ll))

    print("test_http_differential: %d inputs (%d hand-written, %d smuggling shapes, %d from the "
          "fuzz corpus, %d generated, %d mutated)"
          % (len(inputs), len(hand), len(SMUGGLING), len(base) - len(hand) - len(SMUGGLING),
             len(gen), len(mutated)))
    print("  %d read alike (%d of them accepted), %d differ where RFC 9112/9110 decides:"
          % (agree, accepted, sum(allowed_hits.values())))
    for key, why, _ in ALLOWED:
        print("    %-32s %5d  %s" % (key, allowed_hits[key], why[:90]))
    stale = [k for k, n in allowed_hits.items() if n == 0]
    for kind, data, diff, pd, ll in failures[:25]:
        print("DISAGREE (%s): %s\n  input %r\n  pdserve %s %s %s\n  llhttp  %s %s"
              % (kind, diff, data[:300], pd["end"], pd.get("status", ""), pd["error"],
                 ll["end"], ll["error"]))
    if failures:
        print("test_http_differential: %d unexplained disagreements" % len(failures))
    if stale:
        print("test_http_differential: ALLOWED rules that matched nothing (remove them, or the "
              "inputs that showed them are gone): %s" % ", ".join(stale))
    ok = not failures and not stale
    print("%d passed, %d failed" % (len(inputs) - len(failures), len(failures)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
