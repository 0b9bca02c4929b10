"""Idempotency keys of an agent's side effects, derived from what was decided.

A side effect (an IM message a tool sends, a group or agent it creates, the
answer posted to the chat) carries a key made from the stored step that
decided it: the assistant step with the tool call, or the answer step. A run
that goes on after a crash runs the same stored decisions again with the same
keys, and the service that receives them does the effect once. A new decision
(a new completion) gets new keys.
"""

from __future__ import annotations

import hashlib
import uuid

# The longest call id kept as it is; longer or unusual ones are hashed, so
# that a key fits every service's request_id limit (128 characters).
_MAX_PLAIN_CALL_ID = 64


def tool_request_id(step_id: uuid.UUID, call_id: str) -> str:
    """The key of the side effect of one tool call of an assistant step."""
    plain = call_id.isascii() and call_id.isprintable() and 0 < len(call_id) <= _MAX_PLAIN_CALL_ID
    tail = call_id if plain else hashlib.sha256(call_id.encode("utf-8", "replace")).hexdigest()[:32]
    return f"tool/{step_id}/{tail}"


def answer_request_id(step_id: uuid.UUID, part: int) -> str:
    """The key of one part of the answer an assistant step gave."""
    return f"answer/{step_id}/{part}"


def failure_request_id(run_id: uuid.UUID) -> str:
    """The key of the notice that a run ended without its answer."""
    return f"failure/{run_id}"
