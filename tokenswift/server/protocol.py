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

import json
import math
from typing import Any

import attrs

from tokenswift.errors import TokenswiftError
from tokenswift.prompts import check_messages, check_text
from tokenswift.validation import check_seed

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
    """A request that gets an error: ``status`` (400, 404, 413, 503, ...), ``param``
    (the field, or None); ``type`` is OpenAI's ("invalid_request_error" for the
    client's mistakes, "server_error" for the server's state)."""

    def __init__(
        self, message: str, *, param: str | None = None, status: int = 400, code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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


def _shown(value: Any, *, as_json: bool = False) -> str:
    """A request value for an error message (its repr, or ``as_json``), cut short."""
    text = json.dumps(value) if as_json else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _text(value: str, name: str) -> str:
    """A string field that is valid Unicode (JSON's ``"\\ud800"`` is a lone surrogate)."""
    try:
        return check_text(value, name)
    except TokenswiftError as exc:
        raise RequestError(str(exc), param=name.split("[")[0]) from None


def _integer(body: dict, name: str, *, low: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {_shown(value)}", param=name)
    if low is not None and value < low:
        raise RequestError(f"{name} must be at least {low}, got {_shown(value)}", param=name)
    return value


def _number(body: dict, name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and math.isnan(value)):
        raise RequestError(f"{name} must be a number, got {_shown(value)}", param=name)
    if value < low or value > high or (low_open and value == low):
        interval = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise RequestError(f"{name} must be in {interval}, got {_shown(value)}", param=name)
    return float(value)


def _seed(body: dict) -> int | None:
    """The seed, in the range every seed has (:func:`tokenswift.validation.check_seed`)."""
    seed = _integer(body, "seed")
    if seed is None:
        return None
    try:
        return check_seed(seed)
    except TokenswiftError as exc:
        raise RequestError(str(exc), param="seed") from None


def _boolean(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {_shown(value)}", param=name)
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of them, got {_shown(value)}", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", param="stop")
    return tuple(_text(s, "stop") for s in stops)


def _check_fields(body: dict, allowed: frozenset[str]) -> None:
    for name, value in body.items():
        if name in allowed:
            continue
        if name in NEUTRAL:
            if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in NEUTRAL[name]):
                valid = [json.dumps(v) for v in NEUTRAL[name]]
                valid_text = valid[0] if len(valid) == 1 else ", ".join(valid[:-1]) + " or " + valid[-1]
                raise RequestError(
                    f"{name} is not supported by tokenswift: it may only be {valid_text} (its neutral values), "
                    f"got {_shown(value, as_json=True)}",
                    param=name,
                )
            continue
        raise RequestError(f"unknown field {_shown(name)}; this endpoint reads {sorted(allowed)}", param=name)


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
        raise RequestError(f"unknown model {_shown(model)}; this server serves {served_model!r}", param="model", status=404, code="model_not_found")
    if _integer(body, "n", low=1) not in (None, 1):
        raise RequestError(f"n must be 1 (one choice per request), got {_shown(body['n'])}", param="n")
    max_tokens = _integer(body, "max_tokens", low=1)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _integer(body, "max_completion_tokens", low=1)
    stream = _boolean(body.get("stream"), "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise RequestError(f"stream_options takes only include_usage, got {_shown(options)}", param="stream_options")
    include_usage = _boolean((options or {}).get("include_usage"), "stream_options.include_usage")
    user = body.get("user")  # an end user's id, read and not used
    if user is not None and not isinstance(user, str):
        raise RequestError(f"user must be a string, got {_shown(user)}", param="user")
    prompt = messages = None
    if chat:
        if "messages" not in body:
            raise RequestError("messages is required: a list of {role, content}", param="messages")
        try:
            messages = tuple(check_messages(body["messages"]))
        except TokenswiftError as exc:
            raise RequestError(str(exc), param="messages") from None
        for i, message in enumerate(messages):
            _text(message["content"], f"messages[{i}].content")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise RequestError(f"prompt must be a non-empty string, got {_shown(prompt)}", param="prompt")
        _text(prompt, "prompt")
    return GenerationRequest(
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, low_open=True),
        seed=_seed(body),
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
