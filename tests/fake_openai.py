"""A fake OpenAI-compatible chat completions server, for tests and benchmarks.

It speaks HTTP/1.1 on 127.0.0.1 with the standard library only: each
request takes the next scripted `Reply` (a status, SSE chunks, an optional
cut or stall) and is recorded, headers and JSON body included. The helpers
below it build the chunks a real server streams.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Reply:
    """One scripted response."""

    status: int = 200
    chunks: Sequence[Mapping[str, Any]] = ()
    # Drop the connection after this many chunks (before the end of the body).
    cut_after: int | None = None
    # Seconds to wait before each chunk.
    delay: float = 0.0
    # After the chunks, keep the stream open until the client goes away.
    hold: bool = False
    # Sent as it is after the chunks (lines that are not `data:`).
    raw: bytes = b""
    # End with `data: [DONE]`.
    done: bool = True
    body: Mapping[str, Any] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Received:
    path: str
    headers: Mapping[str, str]  # lower-case names
    body: Mapping[str, Any]


class FakeOpenAI:
    """A scriptable OpenAI-compatible chat completions server."""

    def __init__(self) -> None:
        self.replies: deque[Reply] = deque()
        self.requests: list[Received] = []
        self.client_left = asyncio.Event()
        # Answers every request instead of the script, when set.
        self.responder: Callable[[Received], Reply] | None = None
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    def script(self, *replies: Reply) -> None:
        self.replies.extend(replies)

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while (request := await self._read_request(reader)) is not None:
                self.requests.append(request)
                if self.responder is not None:
                    reply = self.responder(request)
                elif self.replies:
                    reply = self.replies.popleft()
                else:
                    reply = Reply(400, body=error_body("unscripted"))
                if not await self._respond(reply, reader, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _read_request(self, reader: asyncio.StreamReader) -> Received | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None  # the client closed a kept-alive connection
        request_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        return Received(path=request_line.split(" ")[1], headers=headers, body=json.loads(body or b"{}"))

    async def _respond(
        self, reply: Reply, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Writes one response; False when the connection is over."""
        if reply.status != 200:
            payload = json.dumps(reply.body or error_body(f"status {reply.status}")).encode()
            writer.write(
                _head(reply.status, {"Content-Type": "application/json", "Content-Length": str(len(payload))})
                + payload
            )
            await writer.drain()
            return True
        headers = {"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked", **reply.headers}
        writer.write(_head(200, headers))
        for sent, chunk in enumerate(reply.chunks):
            if sent == reply.cut_after:
                return False
            if reply.delay:
                await asyncio.sleep(reply.delay)
            writer.write(_http_chunk(f"data: {json.dumps(chunk)}\n\n".encode()))
            await writer.drain()
        if reply.cut_after is not None:
            return False
        if reply.raw:
            writer.write(_http_chunk(reply.raw))
        if reply.hold:
            while await reader.read(1024):
                pass
            self.client_left.set()
            return False
        if reply.done:
            writer.write(_http_chunk(b"data: [DONE]\n\n"))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


def _head(status: int, headers: Mapping[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} Scripted", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _http_chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def error_body(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "code": None}}


def chunk(
    *,
    content: str | None = None,
    reasoning: str | None = None,
    reasoning_field: str = "reasoning_content",
    tool_calls: list[dict[str, Any]] | None = None,
    finish: str | None = None,
    role: str | None = None,
    model: str = "fake-model-2025",
) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    if reasoning is not None:
        delta[reasoning_field] = reasoning
    if tool_calls is not None:
        delta["tool_calls"] = tool_calls
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def usage_chunk(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "fake-model-2025",
        "choices": [],
        "usage": usage,
    }


def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def text_reply(text: str, *, finish: str = "stop") -> Reply:
    return Reply(
        chunks=[
            chunk(role="assistant", content=""),
            *(chunk(content=p) for p in pieces(text)),
            chunk(finish=finish),
            usage_chunk(10, 5),
        ]
    )


def call_fragment(
    index: int, *, arguments: str = "", call_id: str | None = None, name: str | None = None
) -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": arguments}
    if name is not None:
        function["name"] = name
    fragment: dict[str, Any] = {"index": index, "function": function}
    if call_id is not None:
        fragment["id"] = call_id
        fragment["type"] = "function"
    return fragment
