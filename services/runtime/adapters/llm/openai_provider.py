"""The LLM port over any OpenAI-compatible chat completions endpoint.

`OpenAIProvider` streams with the official `openai` client (OpenAI itself,
DeepSeek, vLLM, llama.cpp's server, ...). What it does, in one place:

* **The client**: its generic `post` (what `chat.completions.create` wraps),
  with the request body as we build it and chunks as parsed JSON: the same
  HTTP, headers, error types and SSE decoding, without the per-message
  transform and per-chunk pydantic models that cost most of the CPU.
* **Requests**: `stream=True` with `stream_options={"include_usage": True}`;
  `tools` only when the request has some; `temperature` and `max_tokens`
  only when set. The model and endpoint come from the request's
  `ModelSettings`, falling back to the constructor's defaults.
* **Deltas**: `delta.content` (and `delta.refusal`) become `ContentDelta`;
  the `reasoning_content` extra field that DeepSeek, vLLM and others send
  (or `reasoning`, its newer spelling) becomes `ReasoningDelta`; each
  `delta.tool_calls[i]` becomes a `ToolCallDelta`. The stream ends with one
  `Completion` assembled from exactly the deltas yielded.
* **Retries** are ours (the client's own are off): on HTTP 408, 409, 429 and
  5xx, connection errors, timeouts, and a stream cut before it finished
  (dropped connection, incomplete chunked body, an error event, or an end
  without a finish reason). Each retry restarts the request from scratch
  after an exponential backoff with jitter (at least `Retry-After`, at most
  `backoff_cap`). A retry is only made while the failed attempt has yielded
  no delta: deltas cannot be taken back, so a stream cut after N deltas
  raises `LLMUnavailable("stream cut after N deltas ...")` at once and the
  caller decides what to do with the partial step. A cut that comes after
  the finish reason loses only the usage, and the completion stands.
* **Errors**: other 4xx statuses (400, 401, 403, 404, 422, ...) raise
  `LLMRejected` at once; retries exhausted raise `LLMUnavailable`. An error
  sent inside the stream (OpenAI's `data: {"error": ...}`, or llama.cpp's
  `error: {...}` line) is read the same way: a client error by its code or
  type (`invalid_request_error`, a 4xx `code`, ...) is not retried. A request
  over the context window raises `ContextTooLong` either way. Messages
  name the endpoint, the model and the status, and the server's own error
  text with the API key redacted; the openai exception is not chained, as its
  body may echo the key.
* **The API key** is sent only to the default endpoint (`base_url`): a
  request naming another endpoint gets a placeholder key, so an agent's
  settings cannot send the key elsewhere. It is never logged and never shown
  in a repr.
* **Clients** are made on first use, one per endpoint, and closed by `aclose`.
* **Cancellation**: cancelling the consumer (or closing the iterator) closes
  the HTTP response, which drops the connection and stops the generation.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import urllib.parse
from collections.abc import AsyncIterator, Mapping
from typing import Any

import openai
from openai._streaming import ServerSentEvent, SSEDecoder

from services.runtime.domain.errors import ContextTooLong, LLMRejected, LLMUnavailable
from services.runtime.domain.llm import (
    Completion,
    CompletionAssembler,
    CompletionRequest,
    ContentDelta,
    Delta,
    FinishReason,
    ReasoningDelta,
    ToolCallDelta,
    Usage,
)
from services.runtime.service_layer.llm_port import LLM

logger = logging.getLogger(__name__)

OPENAI_BASE_URL = "https://api.openai.com/v1"

# Sent to endpoints other than the default one, which never get the real key;
# the client refuses to start without some key, and keyless servers ignore it.
_NO_KEY = "no-key"

# Statuses worth another try, as the openai client itself retries them.
_RETRYABLE_STATUSES = frozenset({408, 409, 429})

_MAX_DETAIL = 300


class _Retryable(Exception):
    """An attempt failed in a way that another attempt may not."""

    def __init__(self, reason: str, *, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


class _ErrorLinesDecoder(SSEDecoder):
    """The client's SSE decoder, also reading llama.cpp's server's `error:`
    lines (not an SSE field: the standard decoder drops them, and the stream
    then seems to end for no reason) as the OpenAI-style error event they are."""

    def decode(self, line: str) -> ServerSentEvent | None:
        if line.startswith("error:"):
            line = 'data: {"error": ' + line.removeprefix("error:").strip() + "}"
        return super().decode(line)


class _Client(openai.AsyncOpenAI):
    def _make_sse_decoder(self) -> SSEDecoder:
        return _ErrorLinesDecoder()


class OpenAIProvider(LLM):
    """Streams chat completions from OpenAI-compatible endpoints.

    Args:
        base_url: The default endpoint, such as `https://api.deepseek.com/v1`;
            empty means OpenAI's.
        api_key: The key for the default endpoint (a secret). Empty sends a
            placeholder, which keyless local servers accept.
        model: The model used when a request names none.
        request_timeout: Seconds allowed to connect, to send, and to wait for
            each piece of the stream (an idle limit, not a total).
        max_retries: Retries after the first attempt.
        backoff_base: Seconds before the first retry; it doubles each time.
        backoff_cap: The longest wait between attempts, in seconds.
        rng: The jitter's source of randomness (tests may seed one).
    """

    def __init__(
        self,
        *,
        base_url: str = "",
        api_key: str = "",
        model: str = "",
        request_timeout: float = 60.0,
        max_retries: int = 4,
        backoff_base: float = 0.5,
        backoff_cap: float = 8.0,
        rng: random.Random | None = None,
    ) -> None:
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if request_timeout <= 0 or backoff_base < 0 or backoff_cap < 0:
            raise ValueError("timeouts and backoffs must be positive")
        self._default_base_url = _normalize(base_url or OPENAI_BASE_URL)
        self._api_key = api_key
        self._default_model = model
        self._timeout = request_timeout
        self._max_retries = max_retries
        self._backoff_base = backoff_base
        self._backoff_cap = backoff_cap
        self._rng = rng or random.Random()
        self._clients: dict[str, openai.AsyncOpenAI] = {}

    def __repr__(self) -> str:
        return (
            f"OpenAIProvider(base_url={self._default_base_url!r}, model={self._default_model!r}, "
            f"api_key={'***' if self._api_key else ''!r})"
        )

    async def stream(self, request: CompletionRequest) -> AsyncIterator[Delta | Completion]:
        """Streams one completion; see the module docstring for retries and errors."""
        settings = request.settings
        base_url = _normalize(settings.base_url) if settings.base_url else self._default_base_url
        model = settings.model or self._default_model
        if not model:
            raise LLMRejected(f"no model named for {base_url} and no default model configured")
        client = self._client(base_url)
        body: dict[str, object] = {
            "model": model,
            # OpenAI's API shows the model a user message's `name`; others may refuse it.
            "messages": [m.to_openai(user_names=_is_openai(base_url)) for m in request.messages],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.tools:
            body["tools"] = [t.to_openai() for t in request.tools]
        if settings.temperature is not None:
            body["temperature"] = settings.temperature
        if settings.max_tokens is not None:
            body["max_tokens"] = settings.max_tokens
        attempts = self._max_retries + 1
        for attempt in range(attempts):
            state = _Attempt(model)
            try:
                # The client's generic POST, which `chat.completions.create`
                # wraps: the same request, headers, errors and SSE decoding, but
                # the body goes as it is and chunks come back as parsed JSON.
                # `create` would walk the context through its type-driven
                # transform (about 0.3 ms a message here) and build a pydantic
                # model of every chunk (about half of the runtime's CPU per delta).
                chunks = await client.post(
                    "/chat/completions",
                    body=body,
                    cast_to=object,
                    stream=True,
                    stream_cls=openai.AsyncStream[object],
                )
                async with chunks:
                    try:
                        async for chunk in chunks:
                            for delta in state.feed(chunk):
                                yield delta
                            # Chunks already buffered arrive without a pause;
                            # let the watchers' streams send meanwhile.
                            await asyncio.sleep(0)
                    except (openai.APIConnectionError, openai.APIError, ValueError) as exc:
                        if state.finish_reason is None:
                            if (refused := self._refused_in_stream(base_url, model, exc)) is not None:
                                raise refused from None
                            raise _Retryable(self._describe_cut(exc)) from None
                        logger.info("LLM stream from %s cut after its finish reason; usage lost", base_url)
                if state.finish_reason is None:
                    raise _Retryable("the stream ended without a finish reason")
            except openai.APIStatusError as exc:
                if not _retryable_status(exc.status_code):
                    raise self._refusal(base_url, model, exc) from None
                failure = _Retryable(self._status_reason(exc), retry_after=_retry_after(exc))
            except openai.APIConnectionError as exc:
                failure = _Retryable(self._describe_cut(exc))
            except _Retryable as exc:
                failure = exc
            else:
                yield state.completion()
                return

            where = f"{base_url} (model {model!r})"
            if state.deltas:
                raise LLMUnavailable(f"stream cut after {state.deltas} deltas from {where}: {failure.reason}")
            if attempt + 1 == attempts:
                raise LLMUnavailable(f"{where} failed after {attempts} attempts: {failure.reason}")
            delay = self._backoff(attempt, failure.retry_after)
            logger.warning(
                "LLM attempt %d/%d to %s failed (%s); retrying in %.2fs",
                attempt + 1,
                attempts,
                where,
                failure.reason,
                delay,
            )
            await asyncio.sleep(delay)

    async def aclose(self) -> None:
        """Closes every client made so far. Idempotent; later streams make new ones."""
        clients, self._clients = self._clients, {}
        for client in clients.values():
            await client.close()

    def _client(self, base_url: str) -> openai.AsyncOpenAI:
        client = self._clients.get(base_url)
        if client is None:
            key = self._api_key if base_url == self._default_base_url else ""
            client = _Client(
                api_key=key or _NO_KEY,
                base_url=base_url,
                timeout=openai.Timeout(self._timeout),
                max_retries=0,
            )
            self._clients[base_url] = client
        return client

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        # "Equal jitter": between half and all of the exponential delay, so
        # that agents failing together do not retry together.
        delay = min(self._backoff_cap, self._backoff_base * 2**attempt)
        delay *= 0.5 + self._rng.random() / 2
        if retry_after is not None:
            delay = max(delay, retry_after)
        return min(delay, self._backoff_cap)

    def _refusal(self, base_url: str, model: str, exc: openai.APIStatusError) -> LLMRejected:
        too_long = _context_too_long(exc.status_code, _error_fields(exc.body), exc.message)
        if too_long is not None:
            window, requested = too_long
            return ContextTooLong(self._rejection(base_url, model, exc), window=window, requested=requested)
        return LLMRejected(self._rejection(base_url, model, exc))

    def _refused_in_stream(self, base_url: str, model: str, exc: Exception) -> LLMRejected | None:
        """The refusal an error event in the stream says, if it is one no
        retry can change (a client error); None for anything else."""
        if isinstance(exc, openai.APIConnectionError) or not isinstance(exc, openai.APIError):
            return None
        fields = _error_fields(exc.body)
        status = _client_error_status(fields)
        if status is None:
            return None
        text = f"{base_url} refused model {model!r} in the stream"
        if detail := str(fields.get("message") or ""):
            text += f": {self._redact(detail)}"
        too_long = _context_too_long(status, fields, exc.message)
        if too_long is not None:
            return ContextTooLong(text, window=too_long[0], requested=too_long[1])
        return LLMRejected(text)

    def _status_reason(self, exc: openai.APIStatusError) -> str:
        """A retried status and the endpoint's own words for it, if it said any."""
        detail = str(_error_fields(exc.body).get("message") or "")
        return f"HTTP {exc.status_code}: {self._redact(detail)}" if detail else f"HTTP {exc.status_code}"

    def _rejection(self, base_url: str, model: str, exc: openai.APIStatusError) -> str:
        detail = exc.body.get("message") if isinstance(exc.body, Mapping) else exc.body
        text = f"{base_url} refused model {model!r} with HTTP {exc.status_code}"
        if detail:
            text += f": {self._redact(str(detail))}"
        return text

    def _describe_cut(self, exc: Exception) -> str:
        if isinstance(exc, openai.APITimeoutError):
            return "timed out"
        if isinstance(exc, openai.APIConnectionError):
            cause = exc.__cause__
            return f"connection failed ({type(cause).__name__})" if cause else "connection failed"
        if isinstance(exc, openai.APIError):
            return f"error event in the stream: {self._redact(exc.message)}"
        return "a malformed chunk"

    def _redact(self, text: str) -> str:
        """Server text, shortened and without the key (servers may echo it)."""
        text = text[:_MAX_DETAIL]
        return text.replace(self._api_key, "***") if self._api_key else text


class _Attempt:
    """What one attempt has streamed so far."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.deltas = 0
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self._assembler = CompletionAssembler()

    def feed(self, chunk: object) -> list[Delta]:
        """The deltas in one chunk (a `chat.completion.chunk` as parsed JSON),
        also noting its finish reason, usage and model.

        Raises:
            ValueError: the chunk is not shaped like one.
        """
        if not isinstance(chunk, dict):
            raise ValueError(f"a chunk that is not a JSON object: {str(chunk)[:80]!r}")
        model = chunk.get("model")
        if isinstance(model, str) and model:
            self.model = model
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = _usage(usage)
        deltas: list[Delta] = []
        for choice in _objects(chunk.get("choices"))[:1]:
            if choice.get("finish_reason") is not None:
                self.finish_reason = str(choice["finish_reason"])
            update = _object(choice.get("delta"))
            reasoning = _text(update, "reasoning_content") or _text(update, "reasoning")
            if reasoning:
                deltas.append(ReasoningDelta(reasoning))
            if content := _text(update, "content"):
                deltas.append(ContentDelta(content))
            if refusal := _text(update, "refusal"):
                deltas.append(ContentDelta(refusal))
            for call in _objects(update.get("tool_calls")):
                function = _object(call.get("function"))
                call_id, name = _text(call, "id") or None, _text(function, "name") or None
                arguments = _text(function, "arguments")
                index = call.get("index")
                if not isinstance(index, int):
                    raise ValueError(f"a tool call delta without an index: {call!r:.80}")
                if call_id or name or arguments:
                    deltas.append(ToolCallDelta(index=index, id=call_id, name=name, arguments=arguments))
        for delta in deltas:
            self._assembler.add(delta)
        self.deltas += len(deltas)
        return deltas

    def completion(self) -> Completion:
        return Completion(
            message=self._assembler.message(),
            finish_reason=FinishReason.parse(self.finish_reason),
            usage=self.usage,
            model=self.model,
        )


def _usage(usage: dict[str, Any]) -> Usage:
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(cached, int):
        # DeepSeek's spelling of the same figure.
        cached = usage.get("prompt_cache_hit_tokens")
    return Usage(
        input_tokens=_count(usage, "prompt_tokens"),
        output_tokens=_count(usage, "completion_tokens"),
        cached_tokens=cached if isinstance(cached, int) else 0,
    )


def _object(value: object) -> dict[str, Any]:
    """A JSON object that may be missing (null: empty)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {value!r:.80}")
    return value


def _objects(value: object) -> list[dict[str, Any]]:
    """A JSON array of objects that may be missing (null: empty)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"expected a JSON array, got {value!r:.80}")
    return [_object(item) for item in value]


def _count(fields: dict[str, Any], name: str) -> int:
    value = fields.get(name)
    return value if isinstance(value, int) else 0


def _text(fields: dict[str, Any], name: str) -> str:
    """A string field, or "" when it is missing, null or not a string."""
    value = fields.get(name)
    return value if isinstance(value, str) else ""


def _is_openai(base_url: str) -> bool:
    return urllib.parse.urlsplit(base_url).hostname == "api.openai.com"


def _normalize(base_url: str) -> str:
    return base_url.rstrip("/")


# How endpoints say a request is longer than the context window: OpenAI's
# code, llama.cpp's error type, and the words others use.
_CONTEXT_CODES = frozenset(
    {"context_length_exceeded", "exceed_context_size_error", "string_above_max_length"}
)
_CONTEXT_WORDS = re.compile(
    r"maximum context length|context length|context size|context window|too many tokens|prompt is too long",
    re.IGNORECASE,
)
_OPENAI_NUMBERS = re.compile(
    r"maximum context length is (\d+) tokens.*?(?:resulted in|requested) (\d+) tokens",
    re.IGNORECASE | re.DOTALL,
)
_LLAMA_CPP_PYTHON_NUMBERS = re.compile(
    r"requested tokens \((\d+)\) exceed context window of (\d+)", re.IGNORECASE
)


def _error_fields(body: object) -> Mapping[str, Any]:
    """An error's fields (`code`, `type`, `message`, ...), from the error
    object itself or a body that wraps it in `error`."""
    if not isinstance(body, Mapping):
        return {}
    inner = body.get("error")
    return inner if isinstance(inner, Mapping) else body


# Error types that say the request itself is wrong (OpenAI's, and others').
_CLIENT_ERROR_TYPES = frozenset(
    {"invalid_request_error", "authentication_error", "permission_error", "not_found_error"}
)


def _client_error_status(fields: Mapping[str, Any]) -> int | None:
    """The 4xx status an error event in a stream stands for, if it says the
    request is at fault (rate limits excepted); None otherwise."""
    code = fields.get("code")
    if isinstance(code, int):
        return code if 400 <= code < 500 and code not in _RETRYABLE_STATUSES else None
    kinds = {str(code or ""), str(fields.get("type") or "")}
    if kinds & (_CLIENT_ERROR_TYPES | _CONTEXT_CODES):
        return 400
    return None


def _context_too_long(
    status: int, body: Mapping[str, Any], fallback_message: str = ""
) -> tuple[int | None, int | None] | None:
    """(window, requested) when an error (its status and fields) says the
    request exceeds the context window (each None when not said); None when
    it says something else."""
    if status not in (400, 413, 422):
        return None
    message = str(body.get("message") or fallback_message or "")
    kinds = {str(body.get("code") or ""), str(body.get("type") or "")}
    if not (kinds & _CONTEXT_CODES or _CONTEXT_WORDS.search(message)):
        return None
    window = requested = None
    if (numbers := _OPENAI_NUMBERS.search(message)) is not None:
        window, requested = int(numbers[1]), int(numbers[2])
    elif (numbers := _LLAMA_CPP_PYTHON_NUMBERS.search(message)) is not None:
        requested, window = int(numbers[1]), int(numbers[2])
    if isinstance(body.get("n_ctx"), int):
        window = int(body["n_ctx"])
    if isinstance(body.get("n_prompt_tokens"), int):
        requested = int(body["n_prompt_tokens"])
    return window, requested


def _retryable_status(status: int) -> bool:
    return status in _RETRYABLE_STATUSES or status >= 500


def _retry_after(exc: openai.APIStatusError) -> float | None:
    value = exc.response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: rare enough to fall back on our backoff
