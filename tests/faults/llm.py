"""A fake OpenAI-compatible model for fault tests: it decides from the conversation, not a script.

Every instruction `send <token> to <name>` a person gave since the model
last spoke becomes one `send_direct_message` call (with a fresh random call
id, as a real model's), and once the results are in, the model answers
`done <tokens>`. Replies stream in a few chunks with a delay between them,
so that a process killed at a random moment is often killed mid-stream or
mid-tool. Being a function of the conversation, it decides again the same
way after a crash, whatever was cut.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from tests.fake_openai import FakeOpenAI, Received, Reply, call_fragment, chunk, usage_chunk

INSTRUCTION = re.compile(r"send (\S+) to (\S+)")


def instruction(token: str, to: str) -> str:
    return f"send {token} to {to}"


def decide(messages: Sequence[Mapping[str, Any]]) -> tuple[list[tuple[str, str]], str]:
    """(the (token, name) pairs to send now, the answer if nothing is left to send).

    Instructions that came since the model last spoke are acted on first (also
    when they arrived during a tool round); once nothing new is asked, it answers.
    """
    since: list[Mapping[str, Any]] = []
    for message in reversed(messages):
        if message.get("role") == "assistant":
            break
        since.append(message)
    since.reverse()
    wanted = [
        (match[1], match[2])
        for m in since
        if m.get("role") == "user"
        for match in INSTRUCTION.finditer(str(m.get("content") or ""))
    ]
    if wanted:
        return wanted, ""
    sent = [
        json.loads(call["function"]["arguments"])["content"]
        for m in messages
        if m.get("role") == "assistant"
        for call in m.get("tool_calls") or []
    ]
    if any(m.get("role") == "tool" for m in since) and sent:
        return [], f"done {sent[-1]}"
    return [], "ok"


class DecidingLLM(FakeOpenAI):
    """`FakeOpenAI` whose replies follow `decide`, streamed with `delay` seconds between chunks."""

    def __init__(self, *, delay: float = 0.03) -> None:
        super().__init__()
        self.delay = delay

    async def _read_request(self, reader: Any) -> Received | None:
        request = await super()._read_request(reader)
        if request is not None:
            self.requests.clear()  # nothing reads them: keep memory flat
            calls, answer = decide(request.body.get("messages", []))
            self.script(self._tool_calls(calls) if calls else self._answer(answer))
        return request

    def _tool_calls(self, calls: list[tuple[str, str]]) -> Reply:
        chunks = [chunk(role="assistant", content="")]
        for index, (token, to) in enumerate(calls):
            arguments = json.dumps({"to": to, "content": token})
            chunks.append(
                chunk(
                    tool_calls=[
                        call_fragment(
                            index, call_id=f"call_{uuid.uuid4().hex[:12]}", name="send_direct_message"
                        )
                    ]
                )
            )
            half = len(arguments) // 2
            chunks += [
                chunk(tool_calls=[call_fragment(index, arguments=arguments[:half])]),
                chunk(tool_calls=[call_fragment(index, arguments=arguments[half:])]),
            ]
        chunks += [chunk(finish="tool_calls"), usage_chunk(20, 10)]
        return Reply(chunks=chunks, delay=self.delay)

    def _answer(self, text: str) -> Reply:
        pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
        chunks = [chunk(role="assistant", content=""), *(chunk(content=p) for p in pieces)]
        return Reply(chunks=[*chunks, chunk(finish="stop"), usage_chunk(20, 5)], delay=self.delay)
