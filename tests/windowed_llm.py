"""A model with a small context window, behind the fake OpenAI server.

It counts a request's tokens by its own rule (one per 2.5 bytes of the JSON
of the messages and tools: more than the runtime's estimate, which must
learn it from the usage reported) and, like OpenAI, answers HTTP 400
`context_length_exceeded` when the request and the answer's room exceed the
window. Otherwise it answers a short line, or a summary when asked for one,
and reports the prompt tokens it counted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from tests.fake_openai import Received, Reply, chunk, pieces, usage_chunk

SUMMARY_MARK = "running summary"


@dataclass
class WindowedModel:
    window: int = 4096
    answer_tokens: int = 64
    prompt_sizes: list[int] = field(default_factory=list)
    refusals: int = 0
    summaries: int = 0
    # Every request's messages, as sent.
    seen: list[list[dict[str, object]]] = field(default_factory=list)

    def count(self, body: dict[str, object]) -> int:
        text = json.dumps(body.get("messages", []), ensure_ascii=False)
        text += json.dumps(body.get("tools", []), ensure_ascii=False)
        return math.ceil(len(text.encode()) / 2.5)

    def __call__(self, request: Received) -> Reply:
        body = dict(request.body)
        messages = list(body.get("messages", []))
        self.seen.append(messages)
        prompt = self.count(body)
        if prompt + self.answer_tokens > self.window:
            self.refusals += 1
            message = (
                f"This model's maximum context length is {self.window} tokens. However, your messages"
                f" resulted in {prompt + self.answer_tokens} tokens."
                " Please reduce the length of the messages."
            )
            return Reply(
                400,
                body={
                    "error": {
                        "message": message,
                        "type": "invalid_request_error",
                        "param": "messages",
                        "code": "context_length_exceeded",
                    }
                },
            )
        self.prompt_sizes.append(prompt)
        first = str(messages[0].get("content", "")) if messages else ""
        if SUMMARY_MARK in first:
            self.summaries += 1
            text = f"Summary {self.summaries}: a long chat of numbered notes; nothing else stood out."
        else:
            text = f"Noted ({len(messages)} messages in view)."
        return Reply(
            chunks=[
                chunk(role="assistant", content=""),
                *(chunk(content=p) for p in pieces(text, 12)),
                chunk(finish="stop"),
                usage_chunk(prompt, 12),
            ]
        )
