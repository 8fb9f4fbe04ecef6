"""``tokenswift serve``: an OpenAI-compatible HTTP API over one pipeline (Starlette).

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(both streamed as server-sent events with ``"stream": true``), and ``GET /health``
(whether a generation runs, how the last one ended).

Generations run one at a time, in the order they arrive, on one worker thread (the
model is CPU- or GPU-bound: two at once would only share it); the event loop stays free
to answer other requests and to notice a client that goes away, whose generation then
stops after its current step. A request's temperature/top_p select the pipeline's
``[sampling]`` (pipelines are kept per setting, the model shared); its seed makes the
output exactly what ``Pipeline.generate`` gives with the same seed and prompt or
messages. Every response carries ``usage`` and tokenswift's own statistics under
``"tokenswift"`` (tokens per step, acceptance, tokens/s, the seed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import secrets
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs

from tokenswift.errors import TokenswiftError
from tokenswift.pipeline import GenerationResult, Pipeline
from tokenswift.server.protocol import GenerationRequest, RequestError, StopScanner, parse_request, sampling_overrides

logger = logging.getLogger(__name__)

PIPELINES_KEPT = 2  # pipelines (one per sampling setting) kept built, each with its KV store


@attrs.frozen(kw_only=True)
class Finished:
    """How a generation ended: ``finish_reason`` as OpenAI names it ("stop", "length")
    or "disconnected" (its client went away; recorded, never sent); the result."""

    finish_reason: str
    result: GenerationResult

    def usage(self) -> dict[str, int]:
        prompt, completion = len(self.result.prompt_tokens), len(self.result.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def statistics(self) -> dict[str, Any]:
        """The run's summary (tokens/step, acceptance, tokens/s, ...) and its seed."""
        summary = self.result.stats.summary()
        summary.pop("finish_reason")  # the choice's finish_reason says how it ended, as OpenAI names it
        return {"seed": self.result.seed, **summary}


class Engine:
    """The served model: pipelines per sampling setting and one worker thread that runs
    their generations in turn.

    make_pipeline(sampling_overrides) builds a pipeline over the already-loaded model;
    default_max_tokens: a request's ``max_tokens`` where it gives none."""

    def __init__(self, make_pipeline: Callable[[dict], Pipeline], model_name: str, *, default_max_tokens: int = 256) -> None:
        self.make_pipeline = make_pipeline
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        self._pipelines: OrderedDict[str, Pipeline] = OrderedDict()
        self._worker = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenswift-generate")
        self._state = threading.Lock()  # the counters and the last end
        self._building = threading.Lock()  # the pipelines
        self.running = 0  # generations started and not ended
        self.waiting = 0  # generations queued behind them
        self.last: dict[str, Any] | None = None  # the last generation's end, for /health
        self._closing = threading.Event()  # set by close(): running generations stop

    def pipeline(self, overrides: dict) -> Pipeline:
        """The pipeline for these ``[sampling]`` overrides (built once, the model shared)."""
        key = json.dumps(overrides, sort_keys=True)
        with self._building:
            if key not in self._pipelines:
                self._pipelines[key] = self.make_pipeline(overrides)
                while len(self._pipelines) > PIPELINES_KEPT:
                    self._pipelines.popitem(last=False)
            self._pipelines.move_to_end(key)
            return self._pipelines[key]

    def check(self, request: GenerationRequest) -> None:
        """Refuse a request the pipeline would refuse (too long for the context, a chat
        for a model without a template) before any response starts."""
        pipe = self.pipeline(sampling_overrides(request))
        try:
            prompt = pipe.chat_prompt(list(request.messages)) if request.chat else request.prompt
            pipe.check(prompt, self.max_tokens(request))
        except (ValueError, TypeError, TokenswiftError) as exc:  # e.g. a tokenizer without a chat template
            raise RequestError(str(exc), param="messages" if request.chat else "prompt") from None

    def max_tokens(self, request: GenerationRequest) -> int:
        return request.max_tokens if request.max_tokens is not None else self.default_max_tokens

    def health(self) -> dict[str, Any]:
        with self._state:
            return {"status": "ok", "model": self.model_name, "running": self.running, "waiting": self.waiting, "last": self.last}

    async def generate(self, request: GenerationRequest) -> AsyncIterator[str | Finished]:
        """The request's text as it is committed (pieces of str), then one
        :class:`Finished`. Closing the iterator early (the client went away) stops the
        generation after its current step; the next request then starts."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        gone = threading.Event()
        scanner = StopScanner(request.stop)
        seed = request.seed if request.seed is not None else secrets.randbits(63)

        def put(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def stream(chunk) -> None:
            text = scanner.push(chunk.text or "")
            if text:
                put(text)

        def work() -> None:
            with self._state:
                self.waiting -= 1
                self.running += 1
            try:
                if gone.is_set() or self._closing.is_set():  # its client left while it waited
                    return
                pipe = self.pipeline(sampling_overrides(request))
                result = pipe.generate(
                    request.prompt,
                    self.max_tokens(request),
                    seed=seed,
                    stream=stream,
                    messages=list(request.messages) if request.chat else None,
                    cancel=lambda: gone.is_set() or scanner.stopped or self._closing.is_set(),
                )
                tail = scanner.flush()
                if tail:
                    put(tail)
                if gone.is_set():
                    reason = "disconnected"
                elif scanner.stopped or result.stats.finish_reason == "eos":
                    reason = "stop"
                else:
                    reason = "length"
                finished = Finished(finish_reason=reason, result=result)
                with self._state:
                    self.last = {**finished.usage(), **finished.statistics(), "finish_reason": reason}
                logger.info("%s: %d tokens, %s", reason, len(result.tokens), finished.statistics())
                put(finished)
            except BaseException as exc:  # noqa: BLE001 - handed to the request's task
                put(exc)
            finally:
                with self._state:
                    self.running -= 1

        with self._state:
            self.waiting += 1
        self._worker.submit(work)
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, Finished):
                    return
        finally:
            gone.set()  # a no-op once finished; otherwise the client went away

    def close(self) -> None:
        """Stop the running generation after its step, drop the queued ones."""
        self._closing.set()
        self._worker.shutdown(wait=False, cancel_futures=True)


def _chunk_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def create_app(engine: Engine):
    """The Starlette application serving ``engine``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def error(exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({
            "object": "list",
            "data": [{"id": engine.model_name, "object": "model", "created": engine.created, "owned_by": "tokenswift"}],
        })

    async def health(request: Request) -> JSONResponse:
        return JSONResponse(engine.health())

    async def read(request: Request, chat: bool) -> GenerationRequest:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            raise RequestError(f"the request body is not valid JSON: {exc}") from None
        parsed = parse_request(body, chat=chat, served_model=engine.model_name)
        engine.check(parsed)
        return parsed

    def choice(chat: bool, text: str, finish_reason: str | None, *, delta: bool) -> dict[str, Any]:
        if not chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if delta:
            return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish_reason}

    async def complete(request: Request, chat: bool):
        try:
            parsed = await read(request, chat)
        except RequestError as exc:
            return error(exc)
        ident, created = _chunk_id(chat), int(time.time())
        head = {"id": ident, "created": created, "model": engine.model_name}
        if not parsed.stream:
            pieces: list[str] = []
            async for item in engine.generate(parsed):
                if isinstance(item, Finished):
                    body = {
                        **head, "object": "chat.completion" if chat else "text_completion",
                        "choices": [choice(chat, "".join(pieces), item.finish_reason, delta=False)],
                        "usage": item.usage(), "tokenswift": item.statistics(),
                    }
                    return JSONResponse(body)
                pieces.append(item)

        async def events() -> AsyncIterator[str]:
            kind = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
            if chat:
                yield _sse({**kind, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
            async for item in engine.generate(parsed):
                if isinstance(item, Finished):
                    yield _sse({**kind, "choices": [choice(chat, "", item.finish_reason, delta=True)], "tokenswift": item.statistics()})
                    if parsed.include_usage:
                        yield _sse({**kind, "choices": [], "usage": item.usage()})
                    yield "data: [DONE]\n\n"
                    return
                yield _sse({**kind, "choices": [choice(chat, item, None, delta=True)]})

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def completions(request: Request):
        return await complete(request, chat=False)

    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    async def not_found(request: Request, exc) -> JSONResponse:
        return error(RequestError(f"no route {request.method} {request.url.path}; routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health", status=404))

    async def not_allowed(request: Request, exc) -> JSONResponse:
        return error(RequestError(f"{request.method} is not allowed on {request.url.path}", status=405))

    routes = [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.close()

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_allowed}, lifespan=lifespan)
    app.state.engine = engine
    return app
