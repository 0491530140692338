"""The streaming client against a loopback server that closes kept-alive connections, as uvicorn
does after 5 idle seconds: a request sent on such a connection is sent again on a new one, and
a fresh connection that closes without answering is still an error."""

from __future__ import annotations

import asyncio
import json

from spark_pipelines.resources import bench_client

_USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def _sse() -> bytes:
    events = [
        {"choices": [{"delta": {"content": "he"}}]},
        {"choices": [{"delta": {"content": "llo"}}]},
        {"choices": [], "usage": _USAGE},
    ]
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
            + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")


async def _serve(answers_per_connection: int, seen: list[str]):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered = 0
        while True:
            head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
            if not head:
                break
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            if answered >= answers_per_connection:
                seen.append("closed unanswered")
                break  # the idle close racing the next request: no byte of an answer
            seen.append("answered")
            writer.write(_sse())
            await writer.drain()
            answered += 1
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def _two_requests(answers_per_connection: int):
    seen: list[str] = []
    server = await _serve(answers_per_connection, seen)
    port = server.sockets[0].getsockname()[1]
    pool = bench_client._Http1Pool(f"http://127.0.0.1:{port}/v1/chat/completions")
    body = {"model": "m", "messages": [], "stream": True}
    try:
        samples = [await bench_client._stream_one(pool, body, {}, ("p", "x", i, 8), timeout_s=10)
                   for i in (1, 2)]
    finally:
        pool.close()
        server.close()
        await server.wait_closed()
    return samples, seen


def test_a_request_on_a_connection_closed_while_idle_is_sent_again_on_a_new_one():
    samples, seen = asyncio.run(_two_requests(answers_per_connection=1))
    assert [s.error for s in samples] == [None, None]
    assert [s.completion_tokens for s in samples] == [2, 2]
    assert all(len(s.chunk_times) == 1 for s in samples)  # both text events came in one read
    assert seen == ["answered", "closed unanswered", "answered"]


def test_a_fresh_connection_closed_without_an_answer_is_an_error():
    samples, seen = asyncio.run(_two_requests(answers_per_connection=0))
    assert [s.error for s in samples] == ["ConnectionError: server closed the connection without answering"] * 2
    assert seen == ["closed unanswered"] * 2  # never sent twice: the connection was new
