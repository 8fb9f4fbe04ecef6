"""The OpenAI-compatible request bodies tokenswift serves, read into frozen values.

Every bad request becomes a :class:`RequestError` naming the field and what is valid;
the app turns it into a 4xx with OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``). Fields a client library sends
by default and tokenswift honours are read; fields it cannot honour (log-probabilities,
tools, several choices, OpenAI's own penalties) are refused where set to anything but
their neutral value, so a client never silently gets something else than it asked for;
any other field is refused as unknown (a typo such as ``max_token`` would otherwise be
ignored).
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from tokenswift.errors import TokenswiftError
from tokenswift.prompts import check_messages

MAX_STOP_STRINGS = 4

# Read and honoured, per endpoint.
COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "user"})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"}
# Known to the API, not supported: accepted only with their neutral value.
NEUTRAL = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "parallel_tool_calls": (None,),
}


class RequestError(TokenswiftError):
    """A bad request: ``status`` (400, 404, ...), ``param`` (the field, or None)."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": self.param, "code": self.code}}


@attrs.frozen(kw_only=True)
class GenerationRequest:
    """One completion or chat completion, validated.

    prompt: the text to continue (completions) or None; messages: the chat (chat
    completions) or None; max_tokens: None for the server's default; temperature /
    top_p: None for the served spec's own; seed: None for a random one; stop: up to
    four strings the text ends before; include_usage: a streamed run's last chunk
    carries ``usage`` (``stream_options.include_usage``).
    """

    model: str
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False

    @property
    def chat(self) -> bool:
        return self.messages is not None


def _integer(body: dict, name: str, *, low: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}", param=name)
    if low is not None and value < low:
        raise RequestError(f"{name} must be at least {low}, got {value}", param=name)
    return value


def _number(body: dict, name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise RequestError(f"{name} must be a number, got {value!r}", param=name)
    if value < low or value > high or (low_open and value == low):
        interval = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise RequestError(f"{name} must be in {interval}, got {value}", param=name)
    return float(value)


def _boolean(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of them, got {value!r}", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    return tuple(stops)


def _check_fields(body: dict, allowed: frozenset[str]) -> None:
    for name, value in body.items():
        if name in allowed:
            continue
        if name in NEUTRAL:
            if value not in NEUTRAL[name]:
                raise RequestError(f"{name} is not supported by tokenswift (only its default, {NEUTRAL[name][-1]!r})", param=name)
            continue
        raise RequestError(f"unknown field {name!r}; this endpoint reads {sorted(allowed)}", param=name)


def parse_request(body: Any, *, chat: bool, served_model: str) -> GenerationRequest:
    """A request body (parsed JSON) of ``/v1/chat/completions`` (``chat``) or
    ``/v1/completions`` as a :class:`GenerationRequest`; raises :class:`RequestError`."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model is required: the name of the served model", param="model")
    if model != served_model:
        raise RequestError(f"unknown model {model!r}; this server serves {served_model!r}", param="model", status=404, code="model_not_found")
    if _integer(body, "n", low=1) not in (None, 1):
        raise RequestError(f"n must be 1 (one choice per request), got {body['n']}", param="n")
    max_tokens = _integer(body, "max_tokens", low=1)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _integer(body, "max_completion_tokens", low=1)
    stream = _boolean(body.get("stream"), "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise RequestError(f"stream_options takes only include_usage, got {options!r}", param="stream_options")
    include_usage = _boolean((options or {}).get("include_usage"), "stream_options.include_usage")
    prompt = messages = None
    if chat:
        if "messages" not in body:
            raise RequestError("messages is required: a list of {role, content}", param="messages")
        try:
            messages = tuple(check_messages(body["messages"]))
        except TokenswiftError as exc:
            raise RequestError(str(exc), param="messages") from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError(f"prompt must be a non-empty string, got {prompt!r:.60}", param="prompt")
    return GenerationRequest(
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, low_open=True),
        seed=_integer(body, "seed"),
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage=include_usage,
    )


def sampling_overrides(request: GenerationRequest) -> dict[str, Any]:
    """The ``[sampling]`` overrides a request asks for: temperature 0 is greedy."""
    if request.temperature == 0.0:
        return {"greedy": True}
    overrides: dict[str, Any] = {}
    if request.temperature is not None:
        overrides["temperature"] = request.temperature
    if request.top_p is not None and request.top_p < 1.0:
        overrides["top_p"] = request.top_p
    return overrides


class StopScanner:
    """Cuts streamed text before the first stop string: :meth:`push` returns the text
    that may be sent now, holding back a tail that could still begin a stop string;
    :attr:`stopped` says one was found (nothing after it is ever returned)."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        self.held += text
        cut = min((i for i in (self.held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.held = self.held[:cut], ""
            return out
        keep = max((k for s in self.stops for k in range(len(s) - 1, 0, -1) if self.held.endswith(s[:k])), default=0)
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(out):]
        return out

    def flush(self) -> str:
        """The held-back tail, once the text has ended without a stop string."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out
