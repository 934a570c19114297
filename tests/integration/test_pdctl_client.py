#!/usr/bin/env python3
"""pdctl client over the router's ZeroMQ client API: a streamed answer, the same text as the
non-streamed one and as the HTTP API's (greedy), chat, and a bounded failure on a dead port.
The client port of a default cluster is CURVE: without the router's key the handshake fails in
time; with an API key every request must carry it (from a file or PD_API_KEY, never argv)."""
import os
import json

from test_pdctl_common import Cluster, http, main, run

PROMPT = "def fibonacci(n):"


def scenario(args):
    with Cluster(args) as c:
        c.up()
        ep = c.info["client_endpoint"]
        conn = c.client_args()
        common = conn + ["--prompt", PROMPT, "--max-tokens", "16", "--temperature", "0",
                         "--ignore-eos"]
        s = run(args, ["client"] + common + ["--stream"], 60, check=0)
        streamed = s.stdout
        assert streamed.strip(), "no streamed text"
        assert "16 output tokens" in s.stderr, s.stderr

        j = run(args, ["client"] + common + ["--json"], 60, check=0)
        res = json.loads(j.stdout)
        ch = res["choices"][0]
        assert len(ch["token_ids"]) == 16, ch
        assert ch["finish_reason"] == "length", ch
        assert res["usage"]["completion_tokens"] == 16, res
        assert res["usage"]["prompt_tokens"] > 0, res
        # streamed text (printed with a final newline) equals the assembled text
        assert streamed == ch["text"] + "\n", (streamed, ch["text"])

        # the HTTP API gives the same greedy continuation
        st, body = http(c.url + "/v1/completions",
                        {"prompt": PROMPT, "max_tokens": 16, "temperature": 0,
                         "ignore_eos": True}, timeout=60)
        assert st == 200, (st, body)
        text = json.loads(body)["choices"][0]["text"]
        assert text == ch["text"], (text, ch["text"])

        # chat through the template
        cj = run(args, ["client"] + conn + ["--chat", "Write a sort function",
                        "--max-tokens", "8", "--temperature", "0", "--json"], 60, check=0)
        cres = json.loads(cj.stdout)
        assert cres["choices"][0]["finish_reason"] in ("stop", "length"), cres
        assert 0 < len(cres["choices"][0]["token_ids"]) <= 8, cres

        # invalid input is refused with a message, exit 1
        bad = run(args, ["client"] + conn + ["--prompt", "x", "--max-tokens", "0"], 30)
        assert bad.returncode == 1 and "max-tokens" in bad.stderr, bad.stderr

        # CURVE: the router's public key as Z85 text works as the key file does; without it
        # the handshake fails in time
        public = c.info["security"]["router_public_key"]
        ok = run(args, ["client", "--endpoint", ep, "--server-key", public, "--prompt", PROMPT,
                        "--max-tokens", "16", "--temperature", "0", "--ignore-eos", "--json"],
                 60, check=0)
        assert json.loads(ok.stdout)["choices"][0]["text"] == ch["text"], ok.stdout
        plain = run(args, ["client", "--endpoint", ep, "--prompt", "x", "--connect-timeout",
                           "1000"], 30)
        assert plain.returncode == 1 and "handshake" in plain.stderr, plain.stderr

    # an API key: requests without it are refused, with it (file or environment) answered
    keyfile = os.path.join(c.tmp, "client-key")
    with open(os.open(keyfile, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("k3y-for-the-client-test\n")
    with Cluster(args, extra=["--api-key-file", keyfile]) as ck:
        ck.up()
        conn = ck.client_args()
        assert "--api-key-file" in conn, conn
        nokey = [a for i, a in enumerate(conn) if "--api-key-file" not in conn[max(i - 1, 0):i + 1]]
        refused = run(args, ["client"] + nokey + ["--prompt", PROMPT, "--max-tokens", "4"], 30)
        assert refused.returncode == 1 and "unauthorized" in refused.stderr, refused.stderr
        wrong = run(args, ["client"] + nokey + ["--prompt", PROMPT, "--max-tokens", "4"], 30,
                    env=dict(os.environ, PD_API_KEY="not-the-key"))
        assert wrong.returncode == 1 and "unauthorized" in wrong.stderr, wrong.stderr
        good = run(args, ["client"] + conn + ["--prompt", PROMPT, "--max-tokens", "4"], 30,
                   check=0)
        assert "4 output tokens" in good.stderr, good.stderr
        env = run(args, ["client"] + nokey + ["--prompt", PROMPT, "--max-tokens", "4"], 30,
                  check=0, env=dict(os.environ, PD_API_KEY="k3y-for-the-client-test"))
        assert "4 output tokens" in env.stderr, env.stderr

    # the cluster is gone: connecting fails within the connect timeout
    gone = run(args, ["client", "--endpoint", ep, "--prompt", "x", "--connect-timeout", "500"],
               30)
    assert gone.returncode == 1 and "timed out" in gone.stderr, gone.stderr
    assert gone.elapsed < 10, gone.elapsed


if __name__ == "__main__":
    main(scenario)
