"""The gateway's front: nginx on the clients' port (gateway.proxy_port), LiteLLM behind it on the
gateway host's loopback (gateway.front.litellm_port). Pure: the fleet file's gateway section -> the
nginx site (an `upstream` and a `server` block for the `http` context), for the operator
(`spark-pipelines gateway-front`) and for the simulated gateway host alike.

Why a front: each drain and restore reloads LiteLLM gracefully (SIGHUP to its gunicorn master),
which ends the old worker, and uvicorn then closes every connection that worker holds outside a
response: a client's pooled keep-alive connection, and one it had accepted but not read yet. A
request written on such a connection is reset ("Connection reset by peer"). Measured on the
simulated gateway (2 nodes, a drain and a restore every few seconds, clients sending back to back):
without a front 3 of 173 requests failed on pooled keep-alive connections (httpx, no resend) over
20 reloads and 2 of 65 on fresh connections over 12; the OpenAI SDK's default client lost none
only by sending again (2 of 77). Users' clients reuse connections and most do not resend a POST,
so the gateway must not reset them:

- nginx holds the clients' connections (keep-alive on their side) and is never reloaded by a
  drain: no rotation change closes a client's connection;
- toward LiteLLM it opens a connection per request (`Connection: close`), so no request waits on
  a kept-alive connection the old worker owns;
- a request whose LiteLLM connection was reset or closed before any answer is sent again
  (`proxy_next_upstream error non_idempotent`, up to TRIES times: nginx tries each `server` entry
  once, so LiteLLM is listed TRIES times, never marked down). Nothing was answered, so nothing was
  done; nginx keeps the whole request until then (to a temp file when large), and never resends
  once a response began. A chat completion sent twice after a crash mid-request costs tokens,
  never a side effect.

Measured the same way with this front: 0 of 317 failed over 24 reloads (pooled, fresh and the
OpenAI SDK: no resend needed); nginx logged 5 resets from LiteLLM's old worker and sent each
again. Streams flow as they come (`proxy_buffering off`). Rejected: haproxy 2.6 (Debian 12), whose
`retry-on empty-response` covers a close but not a reset, so 2 of 107 requests on pooled and
fresh connections still failed over 12 reloads (502, its log "SH--"); two LiteLLM instances drained one at a time (a front is needed to switch between
them anyway, and twice LiteLLM's memory, where the front alone ends the resets); a proxy of our own
(a new HTTP/1.1 implementation in the serving path, where nginx is a package operators know).
`reload: restart` still drops the streams in flight: no front keeps a stream whose LiteLLM stopped.
"""

from __future__ import annotations

TRIES = 3  # sends of one request to LiteLLM at most (a reload resets a connection once)
CONNECT_TIMEOUT_S = 5  # LiteLLM is on the same host: a connect works at once or not at all
MAX_BODY = "100m"  # a chat request with a long history (nginx refuses larger ones with 413)
UPSTREAM = "spark_litellm"


def nginx_site(*, proxy_port: int, litellm_port: int, idle_timeout_s: int, source: str = "") -> str:
    """The front's nginx site (the `http` context's `upstream` and `server` blocks): clients on
    every address at `proxy_port`, LiteLLM at 127.0.0.1:`litellm_port`. `idle_timeout_s` bounds
    the silence within a request (a long prompt's first token, a stream between two tokens) and an
    idle client connection."""
    if proxy_port == litellm_port:
        raise ValueError(f"the front and LiteLLM cannot share port {proxy_port}")
    said = f" from {source}" if source else ""
    upstream = "\n".join(f"    server 127.0.0.1:{litellm_port} max_fails=0;" for _ in range(TRIES))
    return f"""# The LiteLLM gateway's front, written by spark-pipelines{said}
# (spark_pipelines/core/gateway_front.py says why). Clients connect on port {proxy_port}; LiteLLM
# listens on 127.0.0.1:{litellm_port} behind it.
upstream {UPSTREAM} {{
    # The same LiteLLM {TRIES} times: nginx sends a request again to the next entry only.
{upstream}
}}

server {{
    listen {proxy_port};
    client_max_body_size {MAX_BODY};
    keepalive_timeout {idle_timeout_s}s;
    keepalive_requests 1000000;

    location / {{
        proxy_pass http://{UPSTREAM};
        proxy_http_version 1.1;
        # A new connection to LiteLLM for each request; the clients' own stay open.
        proxy_set_header Connection close;
        proxy_set_header Host $http_host;
        proxy_buffering off;
        proxy_connect_timeout {CONNECT_TIMEOUT_S}s;
        proxy_read_timeout {idle_timeout_s}s;
        proxy_send_timeout {idle_timeout_s}s;
        # Reset or closed by LiteLLM before any answer (a graceful reload's old worker): sent again.
        proxy_next_upstream error non_idempotent;
        proxy_next_upstream_tries {TRIES};
    }}
}}
"""


__all__ = ["TRIES", "nginx_site"]
