#!/usr/bin/env python3
"""pdctl client over the router's ZeroMQ client API: a streamed answer, the same text as the
non-streamed one and as the HTTP API's (greedy), chat, and a bounded failure on a dead port."""
import json

from test_pdctl_common import Cluster, http, main, run

PROMPT = "def fibonacci(n):"


def scenario(args):
    with Cluster(args) as c:
        c.up()
        ep = c.info["client_endpoint"]
        common = ["--endpoint", ep, "--prompt", PROMPT, "--max-tokens", "16", "--temperature",
                  "0", "--ignore-eos"]
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
        cj = run(args, ["client", "--endpoint", ep, "--chat", "Write a sort function",
                        "--max-tokens", "8", "--temperature", "0", "--json"], 60, check=0)
        cres = json.loads(cj.stdout)
        assert cres["choices"][0]["finish_reason"] in ("stop", "length"), cres
        assert 0 < len(cres["choices"][0]["token_ids"]) <= 8, cres

        # invalid input is refused with a message, exit 1
        bad = run(args, ["client", "--endpoint", ep, "--prompt", "x", "--max-tokens", "0"], 30)
        assert bad.returncode == 1 and "max-tokens" in bad.stderr, bad.stderr

    # CURVE: a router with a keypair (the published example pair of zmq_curve(7), for tests
    # only); the client needs its public key, and without it the handshake fails in time
    secret, public = "JTKVSB%%)wK0E.X)V>+}o?pNmC{O&4W4b!Ni{Lh6", "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
    with Cluster(args, extra=["--router-args", "--curve-secret-key " + secret],
                 node_flags=("--threads", "1", "--router-public-key", public)) as cc:
        cc.up()
        cep = cc.info["client_endpoint"]
        ok = run(args, ["client", "--endpoint", cep, "--server-key", public, "--prompt", PROMPT,
                        "--max-tokens", "16", "--temperature", "0", "--ignore-eos", "--json"],
                 60, check=0)
        assert json.loads(ok.stdout)["choices"][0]["text"] == ch["text"], ok.stdout
        plain = run(args, ["client", "--endpoint", cep, "--prompt", "x", "--connect-timeout",
                           "1000"], 30)
        assert plain.returncode == 1 and "handshake" in plain.stderr, plain.stderr

    # the cluster is gone: connecting fails within the connect timeout
    gone = run(args, ["client", "--endpoint", ep, "--prompt", "x", "--connect-timeout", "500"],
               30)
    assert gone.returncode == 1 and "timed out" in gone.stderr, gone.stderr
    assert gone.elapsed < 10, gone.elapsed


if __name__ == "__main__":
    main(scenario)
